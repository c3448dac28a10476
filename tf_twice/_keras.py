"""Which Keras ``tf.keras`` is, and the few places where Keras 2 and 3 differ.

``tf.keras`` is one of
  * Keras 2: the ``keras`` 2.x package of TensorFlow <= 2.15, or the
    ``tf_keras`` package when ``TF_USE_LEGACY_KERAS=1`` (TensorFlow >= 2.15);
  * Keras 3: the ``keras`` 3.x package, TensorFlow's default from 2.16 on.
Its package is that of ``tf.keras.Model.__module__``; the package has the
version.

tf_twice runs on both with the TensorFlow backend. Importing this module
checks that ``tf.keras`` is usable and raises ImportError naming the fix
otherwise (a Keras 3 backend other than TensorFlow, ``TF_USE_LEGACY_KERAS=1``
without ``tf-keras``, a Keras that does not match TensorFlow), instead of an
error deep inside TensorFlow later. Every tf_twice module that uses
TensorFlow imports it first; ``import tf_twice`` itself does not.

The helpers below are the only places where tf_twice branches on the Keras
version.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

__all__ = ['KERAS_PACKAGE', 'KERAS_VERSION', 'KERAS_MAJOR', 'IS_KERAS_3',
           'NO_REDUCTION', 'problem', 'has_tf_privacy', 'is_no_reduction',
           'steps_per_execution', 'record_call_inputs',
           'export_input_signature',
           'restored_from_config_only', 'is_legacy_optimizer',
           'build_optimizer', 'save_legacy_optimizer', 'split_legacy_optimizer',
           'load_legacy_optimizer', 'compiled_metrics',
           'update_compiled_metrics', 'metric_results', 'state_from_adapt',
           'stop_gradient_of_added_losses']

_TRUE = ('true', 'True', '1')  # TensorFlow's reading of TF_USE_LEGACY_KERAS.


def _major_minor(version: str) -> Tuple[int, int]:
    parts = (version.split('.') + ['0', '0'])[:2]
    return tuple(int(''.join(c for c in p if c.isdigit()) or 0)
                 for p in parts)


def configured_backend(environ=None) -> str:
    """The backend Keras 3 would load: ``KERAS_BACKEND``, else the
    ``backend`` of ``keras.json`` in ``KERAS_HOME`` (default ``~/.keras``),
    else 'tensorflow'."""
    environ = os.environ if environ is None else environ
    if environ.get('KERAS_BACKEND'):
        return environ['KERAS_BACKEND']
    home = environ.get('KERAS_HOME') or os.path.join(
        os.path.expanduser('~'), '.keras')
    try:
        with open(os.path.join(home, 'keras.json')) as f:
            return str(json.load(f).get('backend', 'tensorflow'))
    except (OSError, ValueError, AttributeError):
        return 'tensorflow'


def problem(*, tf_version: str, legacy_requested: bool,
            keras_version: Optional[str], backend: Optional[str],
            tf_keras_installed: bool,
            error: Optional[BaseException] = None) -> Optional[str]:
    """Why tf_twice cannot use ``tf.keras``, with the fix; None if it can.

    Args:
      tf_version: ``tf.__version__``.
      legacy_requested: whether ``TF_USE_LEGACY_KERAS`` asks for tf_keras.
      keras_version: the version of ``tf.keras``'s package (None: it did
        not import).
      backend: Keras 3's backend (the configured one when Keras did not
        import).
      tf_keras_installed: whether the ``tf_keras`` package is installed.
      error: the error resolving ``tf.keras`` raised, if any.
    """
    tf_mm = '.'.join(map(str, _major_minor(tf_version)))
    tf_keras_pin = f'pip install "tf-keras=={tf_mm}.*"'
    if legacy_requested and not tf_keras_installed:
        return (f'TF_USE_LEGACY_KERAS is set, so TensorFlow {tf_version} '
                'looks for Keras 2 in the tf-keras package, which is not '
                f'installed: {tf_keras_pin}, or unset TF_USE_LEGACY_KERAS '
                f'to use the Keras of TensorFlow {tf_mm} '
                f'(Keras {3 if _major_minor(tf_version) >= (2, 16) else 2}).')
    if backend is not None and backend != 'tensorflow' and (
            keras_version is None or _major_minor(keras_version)[0] >= 3) \
            and not legacy_requested:
        return (f'Keras 3 is configured for the {backend!r} backend; '
                'tf_twice needs the TensorFlow backend: set the environment '
                'variable KERAS_BACKEND=tensorflow before importing '
                'TensorFlow (or "backend": "tensorflow" in keras.json).')
    if keras_version is None:
        return (f'tf.keras cannot be imported with TensorFlow {tf_version} '
                f'({type(error).__name__}: {error}). Install a Keras that '
                f'matches it: pip install "keras>=3" (TensorFlow >= 2.16), '
                f'or {tf_keras_pin} and set TF_USE_LEGACY_KERAS=1.')
    keras_mm = _major_minor(keras_version)
    if keras_mm[0] >= 3:
        if _major_minor(tf_version) < (2, 16):
            return (f'tf.keras is Keras {keras_version}, but TensorFlow '
                    f'{tf_version} needs Keras {tf_mm}: pip install '
                    f'"keras=={tf_mm}.*", or TensorFlow >= 2.16 for Keras 3.')
        return None
    if keras_mm[0] == 2:
        if keras_mm != _major_minor(tf_version):
            return (f'tf.keras is Keras {keras_version}, which does not match '
                    f'TensorFlow {tf_version}: {tf_keras_pin} and set '
                    'TF_USE_LEGACY_KERAS=1 for Keras 2, or pip install '
                    '"keras>=3" (TensorFlow >= 2.16) and unset it.')
        return None
    return (f'tf.keras is Keras {keras_version}; tf_twice needs Keras 2 '
            f'({tf_keras_pin}, TF_USE_LEGACY_KERAS=1) or Keras 3 with the '
            'TensorFlow backend.')


def _installed_tensorflow_version() -> str:
    for name in ('tensorflow', 'tensorflow-cpu', 'tf-nightly'):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return 'unknown'


def _inspect() -> Tuple[str, str]:
    """(package, version) of ``tf.keras``; ImportError naming the fix."""
    legacy = os.environ.get('TF_USE_LEGACY_KERAS') in _TRUE
    tf_keras_installed = importlib.util.find_spec('tf_keras') is not None
    facts = dict(legacy_requested=legacy,
                 tf_keras_installed=tf_keras_installed)
    try:
        import tensorflow as tf  # pylint: disable=g-import-not-at-top
    except ImportError:
        raise
    except Exception as error:  # pylint: disable=broad-except
        # TensorFlow loads Keras while it is imported: Keras's own error,
        # e.g. for an unknown backend, surfaces here.
        raise ImportError(problem(
            tf_version=_installed_tensorflow_version(), keras_version=None,
            backend=configured_backend(), error=error, **facts)) from error
    facts['tf_version'] = tf.__version__
    try:
        package = tf.keras.Model.__module__.split('.')[0]
        module = importlib.import_module(package)
        version = str(module.__version__)
    except Exception as error:  # pylint: disable=broad-except
        # ImportError, or e.g. the ValueError of an unknown Keras backend.
        message = problem(keras_version=None,
                          backend=configured_backend(), error=error, **facts)
        raise ImportError(message) from error
    backend = None
    if _major_minor(version)[0] >= 3:
        backend = str(module.backend.backend())
    message = problem(keras_version=version, backend=backend, **facts)
    if message is not None:
        raise ImportError(message)
    return package, version


KERAS_PACKAGE, KERAS_VERSION = _inspect()
KERAS_MAJOR = _major_minor(KERAS_VERSION)[0]
IS_KERAS_3 = KERAS_MAJOR >= 3

def has_tf_privacy() -> bool:
    """Whether tensorflow-privacy is installed (or already imported); with
    Keras 2 it makes the DP optimizer classes (``tf_twice.optimizers``)."""
    if sys.modules.get('tensorflow_privacy') is not None:
        return True
    try:
        return importlib.util.find_spec('tensorflow_privacy') is not None
    except (ImportError, ValueError):  # A finder refused it.
        return False


# A Keras loss reduction that keeps one value per example: Keras 2's
# ``Reduction.NONE`` is this string, Keras 3 takes it (or None).
NO_REDUCTION = 'none'


def is_no_reduction(reduction: Any) -> bool:
    """Whether a Keras loss ``reduction`` keeps per-example values."""
    return reduction is None or reduction == NO_REDUCTION


def steps_per_execution(model: Any) -> int:
    """Train steps per call of ``model.train_function`` (>= 1)."""
    value = getattr(model, 'steps_per_execution', None)  # Keras 3.
    if value is None:
        value = getattr(model, '_steps_per_execution', None)  # Keras 2.
    if value is None:
        return 1
    if hasattr(value, 'numpy'):
        value = value.numpy()
    return max(1, int(value))


def record_call_inputs(model: Any, specs: Any) -> None:
    """Records the input specs (``tf.TensorSpec``) of the batches a train
    step saw as the inputs that a SavedModel traces ``call`` with: Keras 2's
    ``model.save(path, save_format='tf')`` reads them from its save spec
    (unless some are recorded already), Keras 3's ``model.export`` from
    `export_input_signature`. Keras records them on the first
    ``model(inputs)`` only; a train step that calls only a wrapped model
    must record them itself."""
    if IS_KERAS_3:
        # Not an attribute Keras tracks (it would land in the model's
        # saved state).
        object.__setattr__(model, '_tf_twice_trained_input_specs', specs)
        return
    set_spec = getattr(model, '_set_save_spec', None)
    if set_spec is not None:
        set_spec(specs)


def export_input_signature(model: Any, inner_model: Any) -> Optional[list]:
    """Keras 3: the ``input_signature`` for ``model.export`` of a model
    whose ``call`` takes the inputs of ``inner_model``: the specs
    `record_call_inputs` recorded, else those of a functional or sequential
    ``inner_model``'s inputs (any batch size); None where neither is known
    (``export`` then asks for one)."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    specs = getattr(model, '_tf_twice_trained_input_specs', None)
    if specs is None:
        try:
            inputs = inner_model.input
        except (AttributeError, ValueError):
            inputs = getattr(inner_model, 'inputs', None)
            if not inputs or len(inputs) != 1:
                return None
            inputs = inputs[0]
        specs = tf.nest.map_structure(
            lambda t: tf.TensorSpec([None, *t.shape[1:]], t.dtype), inputs)
    return [specs]


_SAVERS_RESTORING_FROM_CONFIG: Dict[type, type] = {}


def restored_from_config_only(saver: Any) -> Any:
    """Keras 2: ``saver``, a model's SavedModel saver, with the model marked
    as one that loading must rebuild from its config (Keras's
    ``must_restore_from_config``), else fail; without the mark a failed
    rebuild silently gives Keras's generic revived model. Unlike a model's
    own ``_must_restore_from_config`` this keeps its traced functions, and
    so the serving signature."""
    base = type(saver)
    cls = _SAVERS_RESTORING_FROM_CONFIG.get(base)
    if cls is None:

        class Saver(base):  # pylint: disable=missing-class-docstring

            def _python_properties_internal(self):
                metadata = super()._python_properties_internal()
                metadata['must_restore_from_config'] = True
                return metadata

        cls = _SAVERS_RESTORING_FROM_CONFIG[base] = Saver
    return cls(saver.obj)


def is_legacy_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a Keras 2 legacy optimizer (the base class of
    TensorFlow Privacy's and of tf_twice's DP optimizers)."""
    if IS_KERAS_3:
        return False
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    return isinstance(optimizer, tf.keras.optimizers.legacy.Optimizer)


def without_loss_scaling(optimizer: Any) -> Any:
    """The optimizer that a LossScaleOptimizer wraps, else ``optimizer``.

    Keras wraps a model's optimizer in a LossScaleOptimizer under the
    'mixed_float16' policy. A DPModel's update comes from per-example
    gradients of the unscaled loss, so it goes to the wrapped optimizer:
    Keras 3's wrapper divides what it is given by its loss scale (2**15 at
    first: the model would hardly train), and Keras 2's hides a tf_twice DP
    optimizer's mechanism. The wrapper's step count is the wrapped
    optimizer's.
    """
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    if isinstance(optimizer, tf.keras.mixed_precision.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


def build_optimizer(optimizer: Any, variables: List[Any]) -> None:
    """Creates ``optimizer``'s variables (step count, slots) for
    ``variables``: Keras skips restoring the state of an optimizer that has
    none yet."""
    if is_legacy_optimizer(optimizer):
        optimizer._create_all_weights(variables)  # pylint: disable=protected-access
    else:
        optimizer.build(variables)


# Keras's .keras format saves only non-legacy optimizers; DPModel saves the
# variables of a legacy one (the tf_twice DP optimizers, Keras 2) in its own
# entry under these keys.
_LEGACY_OPTIMIZER_KEY = 'legacy_optimizer_'


def save_legacy_optimizer(optimizer: Any, store: Any) -> None:
    """Adds a legacy ``optimizer``'s variables to a model's ``store``."""
    if is_legacy_optimizer(optimizer):
        for i, variable in enumerate(optimizer.weights):
            store[f'{_LEGACY_OPTIMIZER_KEY}{i}'] = variable.numpy()


def split_legacy_optimizer(store: Any) -> Tuple[Dict[str, Any], List[Any]]:
    """(the model's own entries, the saved optimizer values in order)."""
    saved = sorted((k for k in store.keys()
                    if k.startswith(_LEGACY_OPTIMIZER_KEY)),
                   key=lambda k: int(k[len(_LEGACY_OPTIMIZER_KEY):]))
    own = {k: store[k] for k in store.keys()
           if not k.startswith(_LEGACY_OPTIMIZER_KEY)}
    return own, [store[k] for k in saved]


def load_legacy_optimizer(optimizer: Any, saved: List[Any],
                          model: Any) -> None:
    """Restores ``split_legacy_optimizer``'s values into ``optimizer``,
    creating its state for ``model``'s weights if no step has yet.

    Raises:
      ValueError: the file holds another number of optimizer variables.
    """
    weights = list(optimizer.weights) if is_legacy_optimizer(
        optimizer) else []
    if saved and not weights and is_legacy_optimizer(optimizer) \
            and model.built:
        build_optimizer(optimizer, model.trainable_variables)
        weights = list(optimizer.weights)
    if len(saved) != len(weights):
        raise ValueError(
            f'The file holds {len(saved)} optimizer variables, the '
            f'reloaded optimizer has {len(weights)}: it cannot resume '
            'the saved optimizer state. Load the weights into a model '
            'compiled as the saved one was.')
    for value, variable in zip(saved, weights):
        variable.assign(value)


def compiled_metrics(model: Any) -> List[Any]:
    """The metric objects ``compile(metrics=...)`` gave ``model`` (Keras 3:
    one object whose result is a dict of them)."""
    if IS_KERAS_3:
        metrics = getattr(model, '_compile_metrics', None)
        return [] if metrics is None else [metrics]
    metrics = getattr(model, 'compiled_metrics', None)
    return [] if metrics is None else list(metrics.metrics)


def update_compiled_metrics(model: Any, y: Any, y_pred: Any,
                            sample_weight: Any = None) -> None:
    """Updates the metrics of ``compile(metrics=...)`` (not the loss), also
    inside a ``tf.while_loop`` under a distribution strategy.

    Keras 3: ``model.compute_metrics``. Keras 2's ``compute_metrics`` also
    reads every result, a cross-replica synchronisation that a loop body
    cannot hold under a strategy: there only ``compiled_metrics`` are
    updated.
    """
    if IS_KERAS_3:
        model.compute_metrics(None, y, y_pred, sample_weight)
    else:
        model.compiled_metrics.update_state(y, y_pred, sample_weight)


def metric_results(model: Any) -> Dict[str, Any]:
    """``model.get_metrics_result()`` without the metrics that no step has
    built yet (Keras 3 builds the compiled metrics at the first step; until
    then they have no result)."""
    results = {}
    for metric in model.metrics:
        if getattr(metric, 'built', True) is False:
            continue
        result = metric.result()
        if isinstance(result, dict):
            results.update(result)
        else:
            results[metric.name] = result
    return results


def state_from_adapt(layer: Any) -> bool:
    """Whether ``layer`` holds statistics or a vocabulary from ``adapt()``.

    Keras 2's preprocessing layers say so (``is_adapted``). Keras 3's keep no
    record of ``adapt()``: there a layer that has ``adapt`` takes its state
    from it unless its parameters were given to the constructor
    (``Normalization(mean=..., variance=...)``, ``IntegerLookup`` /
    ``StringLookup(vocabulary=...)``, ``Discretization(bin_boundaries=...)``;
    ``TextVectorization`` is judged by its lookup layer), and a layer with
    ``adapt`` that is none of these counts as adapted (its state cannot be
    told apart from data).
    """
    if not IS_KERAS_3:
        return getattr(layer, 'is_adapted', False) is True
    if not callable(getattr(layer, 'adapt', None)):
        return False
    if hasattr(layer, 'input_mean'):  # Normalization.
        return layer.input_mean is None
    if hasattr(layer, '_has_input_vocabulary'):  # The lookup layers.
        return not layer._has_input_vocabulary  # pylint: disable=protected-access
    if hasattr(layer, 'num_bins') and hasattr(layer, 'bin_boundaries'):
        return layer.num_bins is not None  # Discretization: quantiles.
    if hasattr(layer, '_lookup_layer'):  # TextVectorization.
        return state_from_adapt(layer._lookup_layer)  # pylint: disable=protected-access
    return True


def stop_gradient_of_added_losses(model: Any) -> None:
    """Replaces every loss that ``model``'s layers hold from ``add_loss``
    (an ``activity_regularizer``, a custom layer's loss) by its
    ``tf.stop_gradient``. A model that contains ``model`` reads those losses
    from the layers' lists, beside ``model``'s outputs; stopping the
    outputs' gradient alone leaves them a path to the weights. Weight
    regularisers are computed when read, not held, and stay as they are."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    def stopped(losses):
        return [tf.stop_gradient(x) if tf.is_tensor(x) else x for x in losses]

    layers = list(model._flatten_layers())  # pylint: disable=protected-access
    if not IS_KERAS_3:
        # Losses added inside a call (eagerly or in a tf.function); the
        # symbolic ones of a functional construction are rebuilt when the
        # model runs.
        for layer in layers:
            if layer._eager_losses:  # pylint: disable=protected-access
                layer._eager_losses = stopped(layer._eager_losses)  # pylint: disable=protected-access
        return
    backend = importlib.import_module(KERAS_PACKAGE + '.src.backend')
    scope = (backend.get_stateless_scope()
             if backend.in_stateless_scope() else None)
    for layer in layers:
        layer._losses[:] = stopped(layer._losses)  # pylint: disable=protected-access
        if scope is not None and scope.collect_losses:
            # Inside stateless_call the losses live in the scope, found by
            # the adding layer through their ids.
            ids = layer._loss_ids  # pylint: disable=protected-access
            for i, x in enumerate(scope.losses):
                if id(x) in ids and tf.is_tensor(x):
                    scope.losses[i] = tf.stop_gradient(x)
                    ids.discard(id(x))
                    ids.add(id(scope.losses[i]))
