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
released sum by up to B * c2 instead of c2. So an optimizer that no
``DPModel`` compiled refuses to build (Keras 3: at the start of ``fit``,
before any trace) and to take gradients (``minimize``,
``apply_gradients``), naming the recipe that works; ``DPModel`` computes
every example's gradient in its own forward and backward pass (and in O(B)
rather than O(B^2)).

Availability: on every supported stack. With tensorflow-privacy on Keras 2
(TensorFlow 2.15, the ``tf-privacy`` extra) the classes subclass its
vectorized DP optimizers (Keras 2 legacy optimizers), and
``make_twice_sampling_optimizer_class`` builds one for any legacy
optimizer; elsewhere (Keras 3, or tf-keras without tensorflow-privacy) they
subclass Keras's own ``SGD``, ``Adam`` and ``Adagrad`` (native). Both take
the same arguments and run the same mechanism; ``gradient_accumulation_steps``
> 1 needs the tensorflow-privacy classes or Keras 3. The names are built at
import, so that saved models find them.

Privacy: with Poisson sampling of examples at rate q1 (expected batch size
n * q1) and one optimizer update per logical batch, each update is the
(q1, q2)-twice-sampled Gaussian mechanism with l2 bound c2 and l-infinity
bound c_inf of the paper's "Privacy Amplification from Twice Sampling"
theorem. The step keys that determine masks and noise are never saved with
the optimizer (see ``tf_twice.mechanism.aggregator``).
"""

import importlib
import importlib.util
import sys
from typing import Any, Optional, Type

import tensorflow as tf

from tf_twice import _keras
from tf_twice import optimizer_mechanisms as mechanisms

__all__ = [
    'TwiceSamplingDPKerasAdagradOptimizer',
    'TwiceSamplingDPKerasAdamOptimizer',
    'TwiceSamplingDPKerasSGDOptimizer',
    'make_twice_sampling_optimizer_class',
]

# The classes are built by the module ``__getattr__`` (at import by
# `_build_classes`): from tensorflow-privacy's, which is optional and works
# only with Keras 2, where the stack allows, else from Keras's own.
# ``make_twice_sampling_optimizer_class`` exists only with tensorflow-privacy
# and elsewhere raises an ImportError that says what to do.
_CLASS_BASES = {
    'TwiceSamplingDPKerasSGDOptimizer': 'SGD',
    'TwiceSamplingDPKerasAdamOptimizer': 'Adam',
    'TwiceSamplingDPKerasAdagradOptimizer': 'Adagrad',
}

_WITHOUT_TF_PRIVACY = (
    'Without tensorflow-privacy and on Keras 3, the optimizer classes of '
    'tf_twice.optimizers subclass Keras\'s own; or train with '
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
    """Builds the optimizer classes on first access (PEP 562): derived from
    tensorflow-privacy where the stack allows, else native."""
    if name == 'make_twice_sampling_optimizer_class':
        problem = _tf_privacy_import_error(name)
        if problem is not None:
            raise ImportError(problem, name='tensorflow_privacy')
        value = _make_twice_sampling_optimizer_class
    elif name in _CLASS_BASES:
        if _tf_privacy_import_error(name) is None:
            value = _make_twice_sampling_optimizer_class(
                getattr(tf.keras.optimizers.legacy, _CLASS_BASES[name]))
        else:
            value = _make_native_optimizer_class(
                getattr(tf.keras.optimizers, _CLASS_BASES[name]))
    else:
        raise AttributeError(
            f'module {__name__!r} has no attribute {name!r}')
    globals()[name] = value
    return value


def __dir__():
    # The tensorflow-privacy factory is listed only where it can be built,
    # so that dir()-driven introspection does not run into its ImportError.
    names = set(globals()) | set(_CLASS_BASES)
    if _tf_privacy_import_error('') is None:
        names.update(__all__)
    return sorted(names)


def _optimizer_class(mechanism: Type[Any], base: Type[Any],
                     keras_name: str) -> Type[Any]:
    """``TwiceSamplingDPKeras<keras_name>Optimizer``: ``mechanism`` on top of
    ``base``, registered for Keras's loaders ('tf_twice>...')."""
    name = f'TwiceSamplingDPKeras{keras_name}Optimizer'
    bases = (mechanism, base)
    if mechanism is mechanisms.NativeMechanism and hasattr(base, 'apply'):
        bases = (mechanisms.Keras3Apply,) + bases
    cls = type(name, bases, {'__module__': __name__, '__qualname__': name,
                             '__doc__': mechanism.__doc__})
    return tf.keras.utils.register_keras_serializable(package='tf_twice')(cls)


def _make_native_optimizer_class(base: Type[Any]) -> Type[Any]:
    """The twice-sampling DP optimizer on Keras's own ``base``."""
    return _optimizer_class(mechanisms.NativeMechanism, base, base.__name__)


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
    return _optimizer_class(mechanisms.TfPrivacyMechanism, base, cls.__name__)


def _build_classes() -> None:
    """Builds the optimizer classes at import. A model saved compiled with
    one finds its class by its registered name ('tf_twice>...') or in this
    module's namespace (a .keras file), and neither holds a class not built
    yet: such a model did not load in a new process."""
    try:
        for name in _CLASS_BASES:
            __getattr__(name)
    except ImportError:
        pass  # A broken tensorflow-privacy: raised again when used.


_build_classes()
