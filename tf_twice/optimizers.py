"""Keras DP optimizers with twice sampling, derived from TensorFlow Privacy.

``make_twice_sampling_optimizer_class(cls)`` subclasses tf_privacy's
vectorized DP optimizer for ``cls`` and replaces its clip-noise-normalise step
by ``tf_twice.mechanism.aggregation``: per-example l2 clipping, optional
l-infinity clipping, a Bernoulli(q2) coordinate mask per example, Gaussian
noise of std ``noise_multiplier * l2_norm_clip`` and division by
``expected_batch_size * q2``.

Per-example gradients come from ``tape.jacobian`` of the per-example loss, as
in tf_privacy; that back-propagates through the whole batch once per example
(O(B^2)). ``tf_twice.keras.make_private`` computes them in O(B) and runs the
same aggregation.

Privacy: with Poisson sampling of examples at rate q1 (expected batch size
n * q1) and one optimizer update per logical batch, each update is the
(q1, q2)-twice-sampled Gaussian mechanism with l2 bound c2 and l-infinity
bound c_inf of the paper's "Privacy Amplification from Twice Sampling"
theorem. The model must not mix examples in its forward pass (no
BatchNormalization), or per-example gradients lose their meaning.

Hybrid clipping: ``basis=`` (a ``HybridBasis`` learned from public data) with
per-block sequences ``l2_norm_clip``, ``noise_multiplier`` and
``linf_norm_clip`` runs the per-block step of ``tf_twice.mechanism.hybrid``
(the code the fast path runs); each update is then the multi-block event
with ``block_dimensions = basis.block_dimensions``. ``set_basis`` changes the
basis between steps without retracing; the basis is not checkpointed with
the optimizer (relearn it, or set a saved one, on resume).
"""

import math
from typing import Optional, Sequence, Type, Union

import tensorflow as tf
from tensorflow_privacy.privacy.optimizers import (
    dp_optimizer_keras_vectorized as tfp_vectorized)

from tf_twice.mechanism import aggregation
from tf_twice.mechanism import basis as basis_lib
from tf_twice.mechanism import hybrid

__all__ = [
    'TwiceSamplingDPKerasAdagradOptimizer',
    'TwiceSamplingDPKerasAdamOptimizer',
    'TwiceSamplingDPKerasSGDOptimizer',
    'make_twice_sampling_optimizer_class',
]

_LegacyOptimizer = tf.keras.optimizers.legacy.Optimizer

# tf_privacy's own vectorized classes, reused so that isinstance checks
# against them keep working.
_TFP_VECTORIZED = {
    tf.keras.optimizers.legacy.SGD:
        tfp_vectorized.VectorizedDPKerasSGDOptimizer,
    tf.keras.optimizers.legacy.Adam:
        tfp_vectorized.VectorizedDPKerasAdamOptimizer,
    tf.keras.optimizers.legacy.Adagrad:
        tfp_vectorized.VectorizedDPKerasAdagradOptimizer,
}

_ACC_SLOT = 'dp_clipped_sum'


def _check_per_example_loss(loss: tf.Tensor) -> None:
    rank = loss.shape.rank
    if rank is not None and rank == 0:
        raise ValueError(
            'The loss passed to a TwiceSampling DP optimizer is a scalar; it '
            'must be a vector of per-example losses. Build the loss with '
            'reduction=tf.keras.losses.Reduction.NONE, e.g. '
            'tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, '
            'reduction=tf.keras.losses.Reduction.NONE).')


def make_twice_sampling_optimizer_class(
        cls: Type[_LegacyOptimizer]) -> Type[_LegacyOptimizer]:
    """Returns a twice-sampling DP subclass of the Keras optimizer ``cls``.

    Args:
      cls: a ``tf.keras.optimizers.legacy.Optimizer`` subclass (tf_privacy's
        optimizers subclass Keras 2 legacy optimizers). The result subclasses
        tf_privacy's vectorized DP version of ``cls``.

    Returns:
      The class ``TwiceSamplingDPKeras<cls.__name__>Optimizer``.
    """
    if not (isinstance(cls, type) and issubclass(cls, _LegacyOptimizer)):
        raise ValueError(
            'cls must be a subclass of tf.keras.optimizers.legacy.Optimizer '
            f'(e.g. tf.keras.optimizers.legacy.SGD), got {cls!r}.')
    base = _TFP_VECTORIZED.get(cls)
    if base is None:
        base = tfp_vectorized.make_vectorized_keras_optimizer_class(cls)
    class_name = f'TwiceSamplingDPKeras{cls.__name__}Optimizer'

    class TwiceSamplingOptimizer(hybrid.BasisHolder, base):  # pylint: disable=missing-docstring
        __doc__ = f"""DP-SGD with twice sampling on top of `{cls.__name__}`.

        Each step releases, for its batch, the sum over examples of the
        l2-clipped (c2), l-infinity clipped (c_inf), Bernoulli(q2)-masked
        per-example gradients plus N(0, (noise_multiplier * c2)^2) per
        coordinate, divided by expected_batch_size * q2. Use a per-example
        loss:

        ```python
        opt = {class_name}(l2_norm_clip=1.0, linf_norm_clip=0.1,
                           noise_multiplier=1.1, coordinate_sampling_rate=0.5,
                           expected_batch_size=256, learning_rate=0.1)
        model.compile(optimizer=opt,
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True,
                          reduction=tf.keras.losses.Reduction.NONE))
        ```
        """

        def __init__(
            self,
            l2_norm_clip: Union[float, Sequence[float]],
            noise_multiplier: Union[float, Sequence[float]],
            expected_batch_size: float,
            linf_norm_clip: Union[None, float,
                                  Sequence[Optional[float]]] = None,
            coordinate_sampling_rate: float = 1.0,
            num_microbatches: Optional[int] = None,
            gradient_accumulation_steps: int = 1,
            seed: Optional[int] = None,
            *args,  # pylint: disable=keyword-arg-before-vararg
            basis: Optional[basis_lib.HybridBasis] = None,
            **kwargs,
        ) -> None:
            """Initialises the optimizer.

            Args:
              l2_norm_clip: c2 > 0, l2 bound of one record's gradient; with
                a basis, c2_j per block (principal blocks, then residual).
              noise_multiplier: z >= 0; noise std per coordinate is z * c2;
                with a basis, z_j per block.
              expected_batch_size: expected number of records per logical
                batch (n * q1 for Poisson sampling, counting examples, or
                microbatches when ``num_microbatches`` is set) of ONE step.
                The update is divided by
                expected_batch_size * q2, never by the realised size.
              linf_norm_clip: c_inf > 0 applied per coordinate after the l2
                clip, or None; with a basis, None or one per block.
              coordinate_sampling_rate: q2 in (0, 1].
              num_microbatches: as in tf_privacy: None makes every example a
                record; otherwise the batch is split into this many
                microbatches whose mean losses are the records.
              gradient_accumulation_steps: k >= 1. As in tf_privacy, every
                step releases its own noised gradient and the weights change
                every k-th step, by the mean of the last k released
                gradients. Each step is one DP step (one logical batch, e.g.
                one Poisson sample), so a privacy ledger that counts steps
                stays exact; the mean is post-processing. For one large
                logical batch split into physical microbatches use
                ``tf_twice.keras.make_private`` instead, which adds noise
                once per logical batch.
              seed: seed of the generator of masks and noise; None draws a
                non-deterministic seed.
              *args: passed on to ``{cls.__name__}``.
              basis: None (one block) or a ``HybridBasis`` over the
                model's trainable variables, learned from public data only
                (keyword only).
              **kwargs: passed on to ``{cls.__name__}`` (learning_rate...).
            """
            self._params = hybrid.block_params(
                basis,
                l2_norm_clip=l2_norm_clip,
                noise_multiplier=noise_multiplier,
                expected_batch_size=expected_batch_size,
                linf_norm_clip=linf_norm_clip,
                coordinate_sampling_rate=coordinate_sampling_rate)
            if num_microbatches is not None and (
                    isinstance(num_microbatches, bool)
                    or not isinstance(num_microbatches, int)
                    or num_microbatches < 1):
                raise ValueError(
                    'num_microbatches must be None or an integer >= 1, got '
                    f'{num_microbatches!r}.')
            if (isinstance(gradient_accumulation_steps, bool)
                    or not isinstance(gradient_accumulation_steps, int)
                    or gradient_accumulation_steps < 1):
                raise ValueError(
                    'gradient_accumulation_steps must be an integer >= 1, '
                    f'got {gradient_accumulation_steps!r}.')
            # tf_privacy's base only stores these (its query is unused): give
            # it numbers, the global l2 clip and the effective multiplier.
            params = self._params
            base_clip = (params.l2_norm_clip if params.num_blocks == 1 else
                         math.sqrt(sum(c * c for c in params.l2_norm_clips)))
            base_noise = (params.noise_multiplier if params.num_blocks == 1
                          else 0.0 if min(params.noise_multipliers) == 0
                          else sum(z**-2 for z in
                                   params.noise_multipliers)**-0.5)
            super().__init__(base_clip, base_noise, num_microbatches,
                             True, *args, **kwargs)
            # Untracked: neither slots nor checkpointed (see module doc).
            self._basis_variables = (None if basis is None else
                                     hybrid.BasisVariables(basis))
            self.gradient_accumulation_steps = gradient_accumulation_steps
            self._seed = seed
            if seed is None:
                generator = tf.random.Generator.from_non_deterministic_state()
            else:
                generator = tf.random.Generator.from_seed(seed)
            # Tracked so that the generator state checkpoints with the
            # optimizer (a restored run does not replay masks and noise).
            self._dp_generator = self._track_trackable(
                generator, name='dp_generator')

        @property
        def dp_params(self) -> aggregation.AggregationParams:
            """The validated clipping, sampling and noise parameters."""
            return self._params

        @property
        def dp_generator(self) -> tf.random.Generator:
            """The generator of the per-step mask and noise keys."""
            return self._dp_generator

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
                            or self._fallback_apply_state(var_device,
                                                          var_dtype))
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

        def _compute_gradients(self, loss, var_list, grad_loss=None,
                               tape=None):
            """Per-example gradients, then the twice-sampling aggregation."""
            self._was_dp_gradients_called = True
            if not callable(loss) and tape is None:
                raise ValueError(
                    '`tape` is required when a `Tensor` loss is passed.')
            tape = tape if tape is not None else tf.GradientTape()
            with tape:
                if callable(loss):
                    if not callable(var_list):
                        tape.watch(var_list)
                    loss = loss()
                loss = tf.convert_to_tensor(loss)
                _check_per_example_loss(loss)
                if self._num_microbatches is None:
                    num_records = tf.shape(loss)[0]
                else:
                    num_records = self._num_microbatches
                record_losses = tf.reduce_mean(
                    tf.reshape(loss, [num_records, -1]), axis=1)
                if callable(var_list):
                    var_list = var_list()
            var_list = tf.nest.flatten(var_list)

            with tf.keras.backend.name_scope(self._name + '/gradients'):
                per_record = tape.jacobian(
                    record_losses, var_list,
                    unconnected_gradients=tf.UnconnectedGradients.ZERO)
                params = self._params
                basis, matrices = self._basis_and_matrices(var_list)
                key = aggregation.draw_step_key(self._dp_generator)
                sums = hybrid.block_sums(per_record, params, basis=basis,
                                         matrices=matrices, key=key)
                grads = hybrid.noisy_update(sums, params, basis=basis,
                                            matrices=matrices, key=key)
                if self.gradient_accumulation_steps > 1:
                    grads = self._accumulate(grads, var_list)
            return list(zip(grads, var_list))

        def _basis_and_matrices(self, var_list):
            basis = self.basis
            if basis is None:
                return None, None
            hybrid.check_basis_matches_variables(basis, var_list)
            return basis, self._basis_variables.variables

        def _accumulate(self, noised_grads, var_list):
            """Sums released gradients; every k-th step returns their mean."""
            # The accumulators are slots, created here (before
            # apply_gradients would) because they are read now.
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
                acc.assign(
                    tf.where(update_now, tf.zeros_like(total), total))
            return grads

        def get_gradients(self, loss, params):
            raise NotImplementedError(
                f'{class_name} supports TF2 execution only (Model.fit or '
                'minimize with a GradientTape), not graph-mode get_gradients.')

        def apply_gradients(self, *args, **kwargs):
            if not self._was_dp_gradients_called:
                raise RuntimeError(
                    'apply_gradients was called before the DP gradients were '
                    'computed; the update would not be private. Use '
                    'minimize() or Model.fit().')
            return super().apply_gradients(*args, **kwargs)

        def get_config(self):
            config = super().get_config()
            config.update(self._params.to_dict())
            config.update({
                'num_microbatches': self._num_microbatches,
                'gradient_accumulation_steps':
                    self.gradient_accumulation_steps,
                'seed': self._seed,
            })
            return config

    TwiceSamplingOptimizer.__name__ = class_name
    TwiceSamplingOptimizer.__qualname__ = class_name
    return tf.keras.utils.register_keras_serializable(package='tf_twice')(
        TwiceSamplingOptimizer)


TwiceSamplingDPKerasSGDOptimizer = make_twice_sampling_optimizer_class(
    tf.keras.optimizers.legacy.SGD)
TwiceSamplingDPKerasAdamOptimizer = make_twice_sampling_optimizer_class(
    tf.keras.optimizers.legacy.Adam)
TwiceSamplingDPKerasAdagradOptimizer = make_twice_sampling_optimizer_class(
    tf.keras.optimizers.legacy.Adagrad)
