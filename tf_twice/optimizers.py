"""Keras DP optimizers with twice sampling, derived from TensorFlow Privacy.

``make_twice_sampling_optimizer_class(cls)`` subclasses tf_privacy's
vectorized DP optimizer for ``cls``. The optimizer carries the mechanism
(per-example l2 clipping, optional l-infinity clipping, a Bernoulli(q2)
coordinate mask per example, Gaussian noise of std ``noise_multiplier *
l2_norm_clip``, division by ``expected_batch_size * q2``; per block with a
hybrid basis) in a ``PrivateAggregator``, and the update rule of ``cls``.

It runs through the per-example model path: wrap the model and compile the
wrapper with the optimizer,

```python
model = tf_twice.keras.DPModel(model, physical_batch_size=64)
model.compile(optimizer=TwiceSamplingDPKerasSGDOptimizer(config, ...),
              loss=...)
```

Why not ``model.compile`` of a plain Keras model: Keras hands an optimizer
only the loss of one batched forward pass. Per-example gradients taken from
it (tf_privacy's ``tape.jacobian``) are not isolated: in the backward pass
0 * NaN = NaN, so one record with a NaN, inf or overflowing feature makes
every other record's gradient non-finite, and one record could change the
released sum by up to B * c2 instead of c2. ``minimize`` and
``compute_gradients`` therefore refuse, naming the fix; ``DPModel`` computes
every example's gradient in its own forward and backward pass (and in O(B)
rather than O(B^2)).

Availability: these classes subclass tensorflow-privacy's, which subclass
Keras 2 (legacy) optimizers. ``from tf_twice import optimizers`` works on
every supported stack; the names are built at import where they can be
(so that saved models find them) and otherwise raise, on first access, an
``ImportError`` that names the fix where tensorflow-privacy is missing
(``pip install "tf_twice[tf-privacy]"``, Python < 3.12) or Keras is Keras 3
(TensorFlow 2.15, or ``tf-keras`` with ``TF_USE_LEGACY_KERAS=1``).
``tf_twice.keras.DPModel(model, config)`` and ``tf_twice.keras.make_private``
run the same mechanism without them.

Privacy: with Poisson sampling of examples at rate q1 (expected batch size
n * q1) and one optimizer update per logical batch, each update is the
(q1, q2)-twice-sampled Gaussian mechanism with l2 bound c2 and l-infinity
bound c_inf of the paper's "Privacy Amplification from Twice Sampling"
theorem. The step keys that determine masks and noise are never saved with
the optimizer (see ``tf_twice.mechanism.aggregator``).
"""

import importlib
import importlib.util
import math
import sys
from typing import Any, Optional, Type

import tensorflow as tf

from tf_twice import _keras
from tf_twice import _validate
from tf_twice import config as config_lib
from tf_twice.mechanism import aggregator as aggregator_lib
from tf_twice.mechanism import basis as basis_lib

__all__ = [
    'TwiceSamplingDPKerasAdagradOptimizer',
    'TwiceSamplingDPKerasAdamOptimizer',
    'TwiceSamplingDPKerasSGDOptimizer',
    'make_twice_sampling_optimizer_class',
]

# Every public name derives from tensorflow-privacy, which is optional and
# works only with Keras 2: the names are built by the module ``__getattr__``
# (at import by `_build_where_available`, where the stack allows), so that
# ``from tf_twice import optimizers`` works on every supported stack and the
# failure, where there is one, says what to do.
_CLASS_BASES = {
    'TwiceSamplingDPKerasSGDOptimizer': 'SGD',
    'TwiceSamplingDPKerasAdamOptimizer': 'Adam',
    'TwiceSamplingDPKerasAdagradOptimizer': 'Adagrad',
}

_WITHOUT_TF_PRIVACY = (
    'Without tensorflow-privacy and on Keras 3, train with '
    'tf_twice.keras.DPModel(model, config) or tf_twice.keras.make_private('
    'model, config, x, y, delta=...): the same mechanism and accounting, no '
    'optimizer class needed.')


def _tf_privacy_import_error(name: str) -> Optional[str]:
    """Why ``name`` cannot be built on this stack; None when it can."""
    problems = []
    if _keras.KERAS_MAJOR != 2:
        problems.append(
            f'it subclasses tensorflow-privacy\'s optimizers, which subclass '
            f'Keras 2 (legacy) optimizers, and this TensorFlow '
            f'{tf.__version__} runs Keras {_keras.KERAS_VERSION}. Use Keras '
            f'2: TensorFlow 2.15, or TensorFlow >= 2.16 with `pip install '
            f'tf-keras` and TF_USE_LEGACY_KERAS=1 set before TensorFlow is '
            f'imported')
    if not _keras.has_tf_privacy():
        problems.append(
            'tensorflow-privacy is not installed: `pip install '
            '"tf_twice[tf-privacy]"` (Python < 3.12 only: tensorflow-privacy '
            '0.9.0, its last release, does not install on Python 3.12+; the '
            'extra installs TensorFlow 2.15, i.e. Keras 2)')
    if not problems:
        return None
    return (f'tf_twice.optimizers.{name} is not available: '
            + '; and '.join(problems) + '. ' + _WITHOUT_TF_PRIVACY)


def _tf_privacy_vectorized():
    """tf_privacy's ``dp_optimizer_keras_vectorized`` module, imported now.

    tensorflow-privacy's package ``__init__`` imports its TF1 parts, which
    need tensorflow-estimator (gone since TensorFlow 2.16); where that is
    missing, ``sys.skip_tf_privacy_import`` skips the ``__init__`` (the
    optimizer modules do not need it).
    """
    problem = _tf_privacy_import_error('make_twice_sampling_optimizer_class')
    if problem is not None:
        raise ImportError(problem, name='tensorflow_privacy')
    if ('tensorflow_privacy' not in sys.modules
            and importlib.util.find_spec('tensorflow_estimator') is None):
        sys.skip_tf_privacy_import = True
    try:
        return importlib.import_module(
            'tensorflow_privacy.privacy.optimizers.'
            'dp_optimizer_keras_vectorized')
    except ImportError as e:
        raise ImportError(
            f'tf_twice.optimizers could not import tensorflow-privacy\'s '
            f'vectorized Keras optimizers ({e}). They need tensorflow-privacy '
            f'0.9.0 on Keras 2: `pip install "tf_twice[tf-privacy]"` on '
            f'Python < 3.12. ' + _WITHOUT_TF_PRIVACY,
            name='tensorflow_privacy') from e


def __getattr__(name: str) -> Any:
    """Builds the tf_privacy-derived names on first access (PEP 562)."""
    if name == 'make_twice_sampling_optimizer_class':
        problem = _tf_privacy_import_error(name)
        if problem is not None:
            raise ImportError(problem, name='tensorflow_privacy')
        value = _make_twice_sampling_optimizer_class
    elif name in _CLASS_BASES:
        problem = _tf_privacy_import_error(name)
        if problem is not None:
            raise ImportError(problem, name='tensorflow_privacy')
        value = _make_twice_sampling_optimizer_class(
            getattr(tf.keras.optimizers.legacy, _CLASS_BASES[name]))
    else:
        raise AttributeError(
            f'module {__name__!r} has no attribute {name!r}')
    globals()[name] = value
    return value


def __dir__():
    # The lazy names are listed only where they can be built, so that
    # dir()-driven introspection does not run into the ImportError.
    names = set(globals())
    if _tf_privacy_import_error('') is None:
        names.update(__all__)
    return sorted(names)


_ACC_SLOT = 'dp_clipped_sum'


_BATCHED_LOSS_REFUSAL = (
    '{name} cannot take per-example gradients from a loss that Keras '
    'computed on the whole batch: they would not be isolated (in the '
    'backward pass 0 * NaN = NaN, so one record with a NaN, inf or huge '
    'feature would erase every other record\'s gradient, a change of up to '
    'B * l2_norm_clip that the accountant does not cover). Wrap the model '
    'and compile the wrapper with this optimizer: '
    'model = tf_twice.keras.DPModel(model); '
    'model.compile(optimizer={name}(config, ...), loss=...).')


def _make_twice_sampling_optimizer_class(cls: Type[Any]) -> Type[Any]:
    """Returns a twice-sampling DP subclass of the Keras optimizer ``cls``.

    Args:
      cls: a ``tf.keras.optimizers.legacy.Optimizer`` subclass (tf_privacy's
        optimizers subclass Keras 2 legacy optimizers). The result subclasses
        tf_privacy's vectorized DP version of ``cls``.

    Returns:
      The class ``TwiceSamplingDPKeras<cls.__name__>Optimizer``.
    """
    tfp_vectorized = _tf_privacy_vectorized()
    legacy = tf.keras.optimizers.legacy
    if not (isinstance(cls, type) and issubclass(cls, legacy.Optimizer)):
        raise ValueError(
            'cls must be a subclass of tf.keras.optimizers.legacy.Optimizer '
            f'(e.g. tf.keras.optimizers.legacy.SGD), got {cls!r}.')
    # tf_privacy's own vectorized classes, reused so that isinstance checks
    # against them keep working.
    base = {
        legacy.SGD: tfp_vectorized.VectorizedDPKerasSGDOptimizer,
        legacy.Adam: tfp_vectorized.VectorizedDPKerasAdamOptimizer,
        legacy.Adagrad: tfp_vectorized.VectorizedDPKerasAdagradOptimizer,
    }.get(cls)
    if base is None:
        base = tfp_vectorized.make_vectorized_keras_optimizer_class(cls)
    class_name = f'TwiceSamplingDPKeras{cls.__name__}Optimizer'

    class TwiceSamplingOptimizer(base):  # pylint: disable=missing-docstring
        __doc__ = f"""DP-SGD with twice sampling on top of `{cls.__name__}`.

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
        opt = {class_name}(config, learning_rate=0.1)
        private = tf_twice.keras.DPModel(model, physical_batch_size=64)
        private.compile(optimizer=opt,
                        loss=tf.keras.losses.SparseCategoricalCrossentropy(
                            from_logits=True))
        ```
        """

        def __init__(
            self,
            config: config_lib.TwiceSamplingConfig,
            gradient_accumulation_steps: int = 1,
            seed: Optional[int] = None,
            *args,  # pylint: disable=keyword-arg-before-vararg
            basis: Optional[basis_lib.HybridBasis] = None,
            **kwargs,
        ) -> None:
            """Initialises the optimizer.

            Args:
              config: the mechanism (``tf_twice.TwiceSamplingConfig``),
                calibrated; with a basis, one Block per basis block.
              gradient_accumulation_steps: k >= 1. As in tf_privacy, every
                step releases its own noised gradient and the weights change
                every k-th step, by the mean of the last k released
                gradients. Each step is one DP step (one logical batch), so
                a privacy ledger that counts steps stays exact; the mean is
                post-processing.
              seed: of the step keys, for experiments; None (default) uses
                OS entropy. Never saved (not in get_config or checkpoints).
              *args: passed on to ``{cls.__name__}``.
              basis: None (one block) or a ``HybridBasis`` over the
                model's trainable variables, learned from public data only
                (keyword only).
              **kwargs: passed on to ``{cls.__name__}`` (learning_rate...).
            """
            if 'num_microbatches' in kwargs:
                raise ValueError(
                    'num_microbatches is not supported: microbatched '
                    'clipping is not covered by the twice-sampling analysis '
                    '(DPModel\'s physical_batch_size splits large batches '
                    'without changing the records).')
            # A dict comes from get_config, as Keras's loaders rebuild the
            # optimizer: a hybrid one then refuses to train until set_basis
            # (no artifact holds the basis).
            from_artifact = isinstance(config, dict)
            if from_artifact:
                config = config_lib.TwiceSamplingConfig.from_dict(config)
            aggregator = aggregator_lib.PrivateAggregator(
                config, basis, seed, awaiting_basis=from_artifact)
            gradient_accumulation_steps = _validate.integer(
                'gradient_accumulation_steps', gradient_accumulation_steps, 1)
            config = aggregator.config
            # tf_privacy's base only stores these (its query is unused): give
            # it numbers, the global l2 clip and the effective multiplier.
            base_clip = math.sqrt(sum(c * c for c in config.l2_norm_clips))
            base_noise = (0.0 if min(config.noise_multipliers) == 0 else
                          sum(z**-2 for z in config.noise_multipliers)**-0.5)
            super().__init__(base_clip, base_noise, None, True, *args,
                             **kwargs)
            # Not trackable: neither the step keys nor the basis are saved
            # with the optimizer.
            self._aggregator = aggregator
            self.gradient_accumulation_steps = gradient_accumulation_steps

        @property
        def aggregator(self) -> aggregator_lib.PrivateAggregator:
            """The mechanism a ``DPModel`` compiled with this optimizer
            runs."""
            return self._aggregator

        @property
        def config(self) -> config_lib.TwiceSamplingConfig:
            """The mechanism's config (with the basis's dimensions)."""
            return self._aggregator.config

        @property
        def basis(self) -> Optional[basis_lib.HybridBasis]:
            """The hybrid-clipping basis (None: one block)."""
            return self._aggregator.basis

        def set_basis(self, basis: basis_lib.HybridBasis) -> None:
            """Uses ``basis`` from the next step on, without retracing."""
            self._aggregator.set_basis(basis)

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
            raise ValueError(_BATCHED_LOSS_REFUSAL.format(name=class_name))

        def apply_private_update(self, noised_grads, var_list):
            """Applies the released (noised, normalised) update of one step.

            Called by ``DPModel.train_step`` with the output of this
            optimizer's aggregator; with gradient accumulation the weights
            change every k-th step by the mean of the last k updates.
            """
            var_list = list(var_list)
            if self.gradient_accumulation_steps > 1:
                noised_grads = self._accumulate(noised_grads, var_list)
            self._was_dp_gradients_called = True
            return super().apply_gradients(zip(noised_grads, var_list))

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
            raise ValueError(_BATCHED_LOSS_REFUSAL.format(name=class_name))

        def apply_gradients(self, *args, **kwargs):
            raise RuntimeError(
                f'{class_name}.apply_gradients would apply gradients that '
                'were not clipped, masked and noised. Compile a '
                'tf_twice.keras.DPModel(model) with this optimizer.')

        def get_config(self):
            """Public parameters only: no seed, no random state."""
            config = super().get_config()
            for name in ('l2_norm_clip', 'noise_multiplier',
                         'num_microbatches', 'use_xla', 'seed'):
                config.pop(name, None)
            config['config'] = self._aggregator.config.to_dict()
            config['gradient_accumulation_steps'] = (
                self.gradient_accumulation_steps)
            return config

    TwiceSamplingOptimizer.__name__ = class_name
    TwiceSamplingOptimizer.__qualname__ = class_name
    return tf.keras.utils.register_keras_serializable(package='tf_twice')(
        TwiceSamplingOptimizer)


def _build_where_available() -> None:
    """Builds the optimizer classes at import where this stack can (Keras 2
    with tensorflow-privacy). A model saved compiled with one finds its
    class by its registered name ('tf_twice>...', Keras 2's SavedModel) or
    in this module's namespace (a .keras file), and neither holds a class
    not built yet: such a model did not load in a new process. Elsewhere
    the names stay lazy and raise, when used, the error that names the
    fix."""
    if _tf_privacy_import_error('') is not None:
        return
    try:
        for name in _CLASS_BASES:
            __getattr__(name)
    except ImportError:
        pass  # A broken tensorflow-privacy: raised again when used.


_build_where_available()
