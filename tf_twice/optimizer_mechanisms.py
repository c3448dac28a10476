"""What every tf_twice DP optimizer class adds to its Keras base.

`tf_twice.optimizers` builds the public classes from these mixins: the
mechanism (a ``PrivateAggregator``) a ``DPModel`` compiled with the
optimizer runs, and the refusal of every other use (`Mechanism`); its update
applied on Keras's own optimizers (`NativeMechanism`, with `Keras3Apply` on
Keras 3) or on tensorflow-privacy's vectorized DP optimizers
(`TfPrivacyMechanism`, TensorFlow 2.15).
"""

import math
from typing import Any, Optional, Sequence

import tensorflow as tf

from tf_twice import _keras
from tf_twice import _validate
from tf_twice import config as config_lib
from tf_twice.mechanism import aggregator as aggregator_lib
from tf_twice.mechanism import basis as basis_lib

__all__ = ['Keras3Apply', 'Mechanism', 'NativeMechanism',
           'TfPrivacyMechanism']

_ACC_SLOT = 'dp_clipped_sum'


_PLAIN_MODEL_REFUSAL = (
    '{name} trains only a tf_twice.keras.DPModel. Keras gives the optimizer '
    'of a plain model the loss of one batched forward pass, whose '
    'per-example gradients are not isolated (in the backward pass '
    '0 * NaN = NaN, so one record with a NaN, inf or huge feature would '
    'erase every other record\'s gradient, a change of up to '
    'B * l2_norm_clip that the accountant does not cover). The recipe that '
    'works: training = tf_twice.keras.make_private(model, config, x, y, '
    'delta=..., target_epsilon=..., epochs=...); '
    'training.model.compile(optimizer=tf.keras.optimizers.SGD(...), '
    'loss=...); training.model.fit(training.data, epochs=training.epochs) '
    '(Poisson-sampled data, its ledger attached). With this optimizer '
    'instead of a config: private = tf_twice.keras.DPModel(model); '
    'private.compile(optimizer={name}(config, ...), loss=...); '
    'private.fit(tf_twice.sampling.poisson_batches(x, y, '
    'expected_batch_size=config.expected_batch_size), '
    'callbacks=[tf_twice.keras.PrivacyLedger.for_model(private, '
    'delta=...)]).')


# TF Privacy's keyword arguments, and what twice sampling adds to them: an
# optimizer given these instead of a config builds
# ``TwiceSamplingConfig.single(**them)`` (one block).
_MECHANISM_ARGUMENTS = ('l2_norm_clip', 'noise_multiplier', 'num_examples',
                        'expected_batch_size', 'coordinate_sampling_rate',
                        'linf_norm_clip')


class Mechanism:
    """What every tf_twice DP optimizer class adds to its Keras base: the
    mechanism (a ``PrivateAggregator``) that a ``DPModel`` compiled with it
    runs, and the refusal of every other use."""

    def _init_mechanism(self, config: Any, seed: Optional[int],
                        basis: Optional[basis_lib.HybridBasis],
                        kwargs: dict) -> aggregator_lib.PrivateAggregator:
        if 'num_microbatches' in kwargs:
            raise ValueError(
                'num_microbatches is not supported: microbatched clipping is '
                'not covered by the twice-sampling analysis (DPModel\'s '
                'physical_batch_size splits large batches without changing '
                'the records).')
        mechanism = {name: kwargs.pop(name) for name in _MECHANISM_ARGUMENTS
                     if name in kwargs}
        if config is None:
            # TF Privacy's style: the mechanism as keyword arguments.
            missing = [name for name in ('num_examples', 'expected_batch_size')
                       if name not in mechanism]
            if missing:
                raise ValueError(
                    'give config (a tf_twice.TwiceSamplingConfig) or the '
                    'mechanism as keyword arguments; missing: '
                    f'{", ".join(missing)} (the accountant and the update\'s '
                    'normalisation need them).')
            config = config_lib.TwiceSamplingConfig.single(**mechanism)
        elif mechanism:
            raise ValueError(
                'give the mechanism either as config or as keyword '
                f'arguments ({", ".join(_MECHANISM_ARGUMENTS)}), not both; '
                f'got config and {", ".join(mechanism)}.')
        # A dict comes from get_config, as Keras's loaders rebuild the
        # optimizer: a hybrid one then refuses to train until set_basis
        # (no artifact holds the basis).
        from_artifact = isinstance(config, dict)
        if from_artifact:
            config = config_lib.TwiceSamplingConfig.from_dict(config)
        aggregator = aggregator_lib.PrivateAggregator(
            config, basis, seed, awaiting_basis=from_artifact)
        # Not tracked: neither the step keys nor the basis are saved with
        # the optimizer; `bind_to_dp_model` sets the mark.
        object.__setattr__(self, '_aggregator', aggregator)
        object.__setattr__(self, '_bound_to_dp_model', False)
        object.__setattr__(self, '_applying_private_update', False)
        return aggregator

    @property
    def aggregator(self) -> aggregator_lib.PrivateAggregator:
        """The mechanism a ``DPModel`` compiled with this optimizer runs."""
        return self._aggregator

    @property
    def config(self) -> config_lib.TwiceSamplingConfig:
        """The mechanism's config (with the basis's dimensions)."""
        return self._aggregator.config

    @property
    def basis(self) -> Optional[basis_lib.HybridBasis]:
        """The hybrid-clipping basis (None: one block)."""
        return self._aggregator.basis

    def set_basis(self, basis: basis_lib.HybridBasis, *,
                  block_scales: Optional[Sequence[float]] = None) -> None:
        """Uses ``basis`` (and ``block_scales``) from the next step on,
        without retracing (``BasisHolder.set_basis``)."""
        self._aggregator.set_basis(basis, block_scales=block_scales)

    def bind_to_dp_model(self) -> None:
        """Called by ``DPModel.compile``: from now on this optimizer may be
        built. Any other model's ``fit`` is refused when it builds it."""
        object.__setattr__(self, '_bound_to_dp_model', True)

    def _refuse_unless_bound(self) -> None:
        if not self._bound_to_dp_model:
            raise ValueError(_PLAIN_MODEL_REFUSAL.format(
                name=type(self).__name__))

    def _refuse_unless_private(self) -> None:
        if not self._applying_private_update:
            raise ValueError(
                f'{type(self).__name__}.apply_gradients would apply '
                'gradients that were not clipped, masked and noised. '
                + _PLAIN_MODEL_REFUSAL.format(name=type(self).__name__))

    def _mechanism_config(self, config: dict) -> dict:
        """``get_config``'s: public parameters only, no seed, no random
        state; the mechanism as ``config``."""
        for name in ('l2_norm_clip', 'noise_multiplier',
                     'num_microbatches', 'use_xla', 'seed'):
            config.pop(name, None)
        config['config'] = self._aggregator.config.to_dict()
        return config


class NativeMechanism(Mechanism):
    """The twice-sampling DP optimizer on Keras's own optimizer (Keras 3, or
    tf-keras's non-legacy optimizers), for stacks without
    tensorflow-privacy; the arguments of the tensorflow-privacy-derived
    class of the same name (TensorFlow 2.15). Compile a
    ``tf_twice.keras.DPModel`` wrapper with it (module docstring)."""

    def __init__(
        self,
        config: Optional[config_lib.TwiceSamplingConfig] = None,
        gradient_accumulation_steps: Optional[int] = 1,
        seed: Optional[int] = None,
        *args,  # pylint: disable=keyword-arg-before-vararg
        basis: Optional[basis_lib.HybridBasis] = None,
        **kwargs,
    ) -> None:
        steps = _validate.integer(
            'gradient_accumulation_steps',
            1 if gradient_accumulation_steps is None
            else gradient_accumulation_steps, 1)
        if steps > 1:
            if not _keras.IS_KERAS_3:
                raise ValueError(
                    'gradient_accumulation_steps > 1 needs Keras 3 or the '
                    'tensorflow-privacy-derived classes (TensorFlow 2.15); '
                    f'got {steps} on Keras {_keras.KERAS_VERSION}.')
            # Keras 3's: the mean of the last k released gradients.
            kwargs['gradient_accumulation_steps'] = steps
        self._init_mechanism(config, seed, basis, kwargs)
        super().__init__(*args, **kwargs)

    def build(self, variables):
        self._refuse_unless_bound()
        super().build(variables)

    def apply_private_update(self, noised_grads, var_list):
        """Applies the released (noised, normalised) update of one step;
        called by ``DPModel.train_step``."""
        object.__setattr__(self, '_applying_private_update', True)
        try:
            return super().apply_gradients(zip(noised_grads, var_list))
        finally:
            object.__setattr__(self, '_applying_private_update', False)

    def apply_gradients(self, *args, **kwargs):
        self._refuse_unless_private()
        return super().apply_gradients(*args, **kwargs)

    def get_config(self):
        return self._mechanism_config(super().get_config())


class Keras3Apply:
    """Keras 3's one entry point: its apply_gradients, its LossScaleOptimizer
    and custom loops all call ``apply`` (tf-keras's optimizers have none)."""

    def apply(self, *args, **kwargs):
        self._refuse_unless_private()
        return super().apply(*args, **kwargs)


class TfPrivacyMechanism(Mechanism):
    """DP-SGD with twice sampling on top of a tensorflow-privacy vectorized
    Keras 2 optimizer.

    Each step releases, for its batch, the sum over examples of the
    l2-clipped (c2), l-infinity clipped (c_inf), Bernoulli(q2)-masked
    per-example gradients plus N(0, (noise_multiplier * c2)^2) per
    coordinate, divided by expected_batch_size * q2. Compile a
    ``tf_twice.keras.DPModel`` wrapper with it:

    ```python
    config = tf_twice.TwiceSamplingConfig.single(
        num_examples=len(x), expected_batch_size=256, l2_norm_clip=1.0,
        linf_norm_clip=0.1, noise_multiplier=1.1,
        coordinate_sampling_rate=0.5)
    opt = TwiceSamplingDPKerasSGDOptimizer(config, learning_rate=0.1)
    private = tf_twice.keras.DPModel(model, physical_batch_size=64)
    private.compile(optimizer=opt,
                    loss=tf.keras.losses.SparseCategoricalCrossentropy(
                        from_logits=True))
    ```
    """

    def __init__(
        self,
        config: Optional[config_lib.TwiceSamplingConfig] = None,
        gradient_accumulation_steps: int = 1,
        seed: Optional[int] = None,
        *args,  # pylint: disable=keyword-arg-before-vararg
        basis: Optional[basis_lib.HybridBasis] = None,
        **kwargs,
    ) -> None:
        """Initialises the optimizer.

        Args:
          config: the mechanism (``tf_twice.TwiceSamplingConfig``),
            calibrated; with a basis, one Block per basis block. Or None
            and, as TF Privacy's optimizers take them, keyword arguments:
            ``l2_norm_clip``, ``noise_multiplier``, ``num_examples``,
            ``expected_batch_size`` and optionally
            ``coordinate_sampling_rate`` and ``linf_norm_clip``
            (``TwiceSamplingConfig.single``).
          gradient_accumulation_steps: k >= 1. As in tf_privacy, every step
            releases its own noised gradient and the weights change every
            k-th step, by the mean of the last k released gradients. Each
            step is one DP step (one logical batch), so a privacy ledger
            that counts steps stays exact; the mean is post-processing.
          seed: of the step keys, for experiments; None (default) uses OS
            entropy. Never saved (not in get_config or checkpoints).
          *args: passed on to the Keras optimizer.
          basis: None (one block) or a ``HybridBasis`` over the model's
            trainable variables, learned from public data only (keyword
            only).
          **kwargs: passed on to the Keras optimizer (learning_rate...).
        """
        aggregator = self._init_mechanism(config, seed, basis, kwargs)
        gradient_accumulation_steps = _validate.integer(
            'gradient_accumulation_steps', gradient_accumulation_steps, 1)
        config = aggregator.config
        # tf_privacy's base only stores these (its query is unused): give it
        # numbers, the global l2 clip and the effective multiplier.
        base_clip = math.sqrt(sum(c * c for c in config.l2_norm_clips))
        base_noise = (0.0 if min(config.noise_multipliers) == 0 else
                      sum(z**-2 for z in config.noise_multipliers)**-0.5)
        super().__init__(base_clip, base_noise, None, True, *args, **kwargs)
        self.gradient_accumulation_steps = gradient_accumulation_steps

    def _create_slots(self, var_list):
        super()._create_slots(var_list)
        if self.gradient_accumulation_steps > 1:
            for var in var_list:
                self.add_slot(var, _ACC_SLOT)

    def _prepare_local(self, var_device, var_dtype, apply_state):
        super()._prepare_local(var_device, var_dtype, apply_state)
        if self.gradient_accumulation_steps > 1:
            apply_state[(var_device, var_dtype)]['apply_update'] = (
                self._is_update_step())

    def _is_update_step(self) -> tf.Tensor:
        return tf.equal(
            tf.math.floormod(self.iterations + 1,
                             self.gradient_accumulation_steps), 0)

    def _resource_apply_dense(self, grad, var, apply_state=None):
        if self.gradient_accumulation_steps == 1:
            return super()._resource_apply_dense(grad, var, apply_state)
        var_device, var_dtype = var.device, var.dtype.base_dtype
        coefficients = ((apply_state or {}).get((var_device, var_dtype))
                        or self._fallback_apply_state(var_device, var_dtype))
        parent = super()

        def _apply():
            op = parent._resource_apply_dense(grad, var, apply_state)
            with tf.control_dependencies([op]):
                return tf.constant(True)

        return tf.cond(coefficients['apply_update'], _apply,
                       lambda: tf.constant(False))

    def _resource_apply_sparse(self, *args, **kwargs):
        # Gradients from the aggregation are always dense.
        raise NotImplementedError(
            'TwiceSampling DP optimizers produce dense gradients only.')

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        raise ValueError(_PLAIN_MODEL_REFUSAL.format(name=type(self).__name__))

    def apply_private_update(self, noised_grads, var_list):
        """Applies the released (noised, normalised) update of one step.

        Called by ``DPModel.train_step`` with the output of this optimizer's
        aggregator; with gradient accumulation the weights change every
        k-th step by the mean of the last k updates.
        """
        var_list = list(var_list)
        if self.gradient_accumulation_steps > 1:
            noised_grads = self._accumulate(noised_grads, var_list)
        self._was_dp_gradients_called = True
        # tf_privacy's apply_gradients, past this class's refusal.
        return super().apply_gradients(zip(noised_grads, var_list))

    def _accumulate(self, noised_grads, var_list):
        """Sums released gradients; every k-th step returns their mean."""
        # The accumulators are slots, created here (before apply_gradients
        # would) because they are read now.
        with tf.init_scope():
            self._create_all_weights(var_list)
        accumulators = [self.get_slot(v, _ACC_SLOT) for v in var_list]
        totals = [a + g for a, g in zip(accumulators, noised_grads)]
        update_now = self._is_update_step()
        steps = float(self.gradient_accumulation_steps)
        grads = tf.cond(
            update_now, lambda: [t / steps for t in totals],
            lambda: [tf.zeros_like(t) for t in totals])
        for acc, total in zip(accumulators, totals):
            acc.assign(tf.where(update_now, tf.zeros_like(total), total))
        return grads

    def get_gradients(self, loss, params):
        raise ValueError(_PLAIN_MODEL_REFUSAL.format(name=type(self).__name__))

    def apply_gradients(self, *args, **kwargs):
        self._refuse_unless_private()  # apply_private_update skips it.

    def get_config(self):
        config = self._mechanism_config(super().get_config())
        config['gradient_accumulation_steps'] = (
            self.gradient_accumulation_steps)
        return config
