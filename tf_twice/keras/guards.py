"""Guard rails: refuse training setups that silently void the DP guarantee.

DP-SGD's guarantee (and `tf_twice.accounting`'s epsilon) rests on six
assumptions the code cannot enforce by itself:

1. each example's gradient depends on that example only: no layer may mix
   examples of a batch (BatchNormalization does, through batch statistics;
   custom layers that do declare ``mixes_examples = True``), and no layer
   may hold statistics adapted on private data;
2. the loss is per example, so per-example gradients exist (a loss reduced
   to a scalar over the batch has none);
3. batches are Poisson samples (`tf_twice.sampling`), not fixed-size
   shuffled batches;
4. the noisy sum is divided by the *expected* number of contributions
   n * q1 * q2, never by the realised batch size, which depends on who is in
   the batch and is not covered by the accountant;
5. the accountant's event is the step that runs: a DP model's event is
   derived from its config (``DPModel.dp_event``), and a ledger with any
   other event is refused (`check_ledger_event`), as is a config whose
   block dimensions are not the model's (`check_mechanism_fits_variables`);
6. under a multi-worker strategy every worker takes its own share of the
   same logical batch, so each example is summed once (`check_sharding`).

Every check raises ValueError naming what is wrong and what to use instead.
`check_poisson_input` is strict by default: a non-Poisson dataset is refused
(ValueError), because the epsilon reported for it would not be a valid bound.
`strict=False` downgrades that to a `NonPoissonInputWarning` for experiments
whose epsilon is not claimed; the warning says that the epsilon does not hold.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Iterator, Optional, Tuple

import dp_accounting
import numpy as np
import tensorflow as tf

from tf_twice import _keras
from tf_twice import sampling
from tf_twice.keras.distribution_guards import check_sharding
from tf_twice.mechanism import aggregator as aggregator_lib

__all__ = [
    'NonPoissonInputWarning',
    'check_ledger_event',
    'check_mechanism_fits_variables',
    'check_no_example_mixing',
    'check_per_example_loss',
    'check_poisson_input',
    'check_sharding',
    'is_poisson_input',
]


# Why a DPModel cannot train or be accounted yet, and the fix.
NO_MECHANISM = (
    'has no DP mechanism yet: give it a TwiceSamplingConfig, '
    'DPModel(model, config), or compile it with a tf_twice DP optimizer '
    '(tf_twice.optimizers).')


class NonPoissonInputWarning(UserWarning):
    """Training data is not Poisson-sampled; the reported epsilon is void."""


def walk_layers(layer: Any, path: str) -> Iterator[Tuple[str, Any]]:
    """Yields (path, layer) for `layer` and every layer nested in it."""
    yield path, layer
    children = getattr(layer, '_flatten_layers', None)
    if children is not None:
        nested = children(include_self=False, recursive=False)
    else:
        nested = getattr(layer, 'layers', [])
    for child in nested:
        yield from walk_layers(child, f'{path}/{child.name}')


def _why_not_per_example(layer: Any) -> Optional[str]:
    """Why ``layer`` voids per-example sensitivity, or None if it does not.

    * Batch statistics in training mode (BatchNormalization and every
      copy or subclass of it, SyncBatchNormalization...) mix the examples of
      a batch, so one example changes every other example's gradient.
    * A layer that declares ``mixes_examples = True`` (the convention for
      custom layers that normalise or attend across the batch axis).
    * A stateful layer (``stateful=True``, e.g. a stateful RNN): its state
      carries one example's data into other examples and later steps.
    * A preprocessing layer adapted on data (``Normalization``,
      ``Discretization``, ``IntegerLookup``, ``StringLookup``,
      ``TextVectorization``... after ``adapt``; on Keras 3, which keeps no
      record of ``adapt``, any such layer whose parameters were not given
      explicitly): its statistics or vocabulary are a function of the data
      it saw, released with the model and not accounted; if that data was
      private, the guarantee is void.
    """
    names = [cls.__name__ for cls in type(layer).__mro__]
    if isinstance(layer, tf.keras.layers.BatchNormalization) or any(
            'BatchNorm' in name for name in names):
        return ('normalises with batch statistics, which mixes examples: '
                'per-example gradients, and so DP-SGD\'s guarantee, do not '
                'exist with it. Use tf.keras.layers.GroupNormalization (as '
                'the paper does) or tf.keras.layers.LayerNormalization.')
    if getattr(layer, 'mixes_examples', False) is True:
        return ('declares mixes_examples = True: its output for one example '
                'depends on other examples of the batch, so per-example '
                'clipping does not bound any example\'s influence.')
    # A Model is stateful when one of its layers is: name that layer.
    if getattr(layer, 'stateful', False) is True and not isinstance(
            layer, tf.keras.Model):
        return ('is stateful: its state carries one example\'s data into '
                'other examples and later steps. Use stateful=False.')
    if _keras.state_from_adapt(layer):
        return ('was adapted on data (or takes its state from adapt()): its '
                'statistics or vocabulary are released with the model and no '
                'accountant covers them. Give its parameters explicitly (e.g. '
                'Normalization(mean=..., variance=...), '
                'StringLookup(vocabulary=...)) computed from PUBLIC data.')
    return None


def check_no_example_mixing(model: tf.keras.layers.Layer) -> None:
    """Refuses a model with a layer that breaks per-example sensitivity.

    Checks ``model`` and every layer nested in it (nested models, custom
    layers, wrappers) for batch statistics, a declared ``mixes_examples =
    True`` and normalisation adapted on data (see ``_why_not_per_example``).
    GroupNormalization and LayerNormalization normalise within one example
    and are safe.

    Raises:
      ValueError: naming the first such layer (its path) and why.
    """
    if not isinstance(model, tf.keras.layers.Layer):
        raise ValueError('model must be a tf.keras Model or Layer; got '
                         f'{type(model).__name__}.')
    for path, layer in walk_layers(model, model.name):
        why = _why_not_per_example(layer)
        if why is not None:
            raise ValueError(
                f'Layer {path!r} ({type(layer).__name__}) {why}')


def _default_probes():
    """Example batches (3 examples, 4 classes) for the common loss shapes."""
    probs = tf.fill([3, 4], 0.25)
    yield tf.one_hot([0, 1, 2], 4), probs  # Dense targets, categorical.
    yield tf.constant([0.0, 1.0, 2.0]), probs  # Sparse labels.
    yield tf.constant([[0.0], [1.0], [2.0]]), probs  # Sparse, [batch, 1].


def _probe(loss, y_true, y_pred, where: str) -> Tuple[np.ndarray, int]:
    """The loss values on a probe batch, and that batch's size."""
    if (y_true is None) != (y_pred is None):
        raise ValueError('Give both y_true and y_pred (example batches to '
                         'probe the loss with), or neither.')
    probes = ([(y_true, y_pred)] if y_true is not None else
              list(_default_probes()))
    error = None
    for true, pred in probes:
        try:
            values = np.asarray(loss(true, pred))
        except Exception as e:  # pylint: disable=broad-except
            error = e
            continue
        return values, int(tf.nest.flatten(pred)[0].shape[0])
    raise ValueError(
        f'Could not evaluate loss {where} on a probe batch ({error}); pass '
        'y_true=... and y_pred=... example batches to '
        'check_per_example_loss.') from error


def _describe(loss: Any) -> str:
    if isinstance(loss, str):
        return repr(loss)
    if isinstance(loss, tf.keras.losses.Loss):
        return repr(loss.name)
    return getattr(loss, '__name__', type(loss).__name__)


def _check_one_loss(loss: Any, y_true, y_pred, where: str) -> None:
    if isinstance(loss, str):
        try:
            loss = tf.keras.losses.get(loss)
        except ValueError as e:
            raise ValueError(f'Loss {where} is not a known Keras loss name: '
                             f'{e}') from e
    if isinstance(loss, tf.keras.losses.Loss):
        reduction = loss.reduction
        if not _keras.is_no_reduction(reduction):
            raise ValueError(
                f'Loss {where} ({type(loss).__name__}) has reduction '
                f'{reduction!r}: it averages over the batch, so there are no '
                'per-example losses to clip. Construct it with '
                f'reduction={_keras.NO_REDUCTION!r}.')
        stock = type(loss).__module__.startswith(
            ('keras.', 'tf_keras.', 'tensorflow.'))
        if stock and y_true is None and y_pred is None:
            return  # A stock Keras loss with reduction NONE is per example.
    elif not callable(loss):
        raise ValueError(f'Loss {where} must be a Keras Loss, a loss name or '
                         'a callable (y_true, y_pred) -> per-example losses; '
                         f'got {loss!r}.')
    values, batch = _probe(loss, y_true, y_pred, where)
    if values.ndim == 0 or values.shape[0] != batch:
        raise ValueError(
            f'Loss {where} returned shape {values.shape} for a batch of '
            f'{batch} examples: it is reduced over the batch, so there are no '
            'per-example losses to clip. It must return one loss per example '
            '(shape [batch, ...]); for Keras losses use '
            f'reduction={_keras.NO_REDUCTION!r}.')


def check_per_example_loss(loss: Any, y_true: Any = None,
                           y_pred: Any = None) -> None:
    """Refuses a loss that does not return one value per example.

    DP-SGD clips each example's gradient, so it needs per-example losses.
    Accepted: a Keras `Loss` with `reduction='none'`; a loss name
    ('sparse_categorical_crossentropy', ...) that resolves to a per-example
    function; a callable returning shape [batch, ...]. Callables and custom
    `Loss` subclasses are probed: with `y_true`/`y_pred` when given, else
    with a small default batch (3 examples, 4 classes). Nests (lists, dicts)
    of losses, as for multi-output models, are checked one by one.

    Raises:
      ValueError: the loss is reduced over the batch, or could not be
        probed (then pass example `y_true` and `y_pred`).
    """
    if isinstance(loss, dict):
        for key, value in loss.items():
            _check_one_loss(value, y_true, y_pred,
                            f'[{key!r}] {_describe(value)}')
        return
    if isinstance(loss, (list, tuple)):
        for i, value in enumerate(loss):
            _check_one_loss(value, y_true, y_pred, f'[{i}] {_describe(value)}')
        return
    _check_one_loss(loss, y_true, y_pred, _describe(loss))


def check_poisson_input(dataset: Any, *,
                        example_sampling_rate: Optional[float] = None,
                        num_examples: Optional[int] = None,
                        strict: bool = True
                        ) -> Optional[sampling.PoissonSamplingInfo]:
    """Checks that training data is Poisson-sampled, as the accountant assumes.

    Accepts datasets built by `tf_twice.sampling.poisson_batches[_from_
    dataset]` (also after `prefetch`/`take`/`skip`/`repeat`/`with_options`).
    Anything else (numpy arrays that Keras batches itself, `shuffle().batch()`
    pipelines, generators, Sequences, a mapped or re-batched Poisson dataset)
    is not Poisson sampling: the steps' batches are fixed-size and dependent,
    and the accountant's epsilon is not a bound for them.

    Args:
      dataset: what will be passed to `fit`.
      example_sampling_rate: if given, the q1 the accountant uses; it must
        match the dataset's (else the epsilon is for another mechanism).
      num_examples: if given, the n the accountant uses; it must match the
        dataset's.
      strict: True (default) raises on non-Poisson input; False only warns
        (`NonPoissonInputWarning`), for runs that claim no epsilon.

    Returns:
      The dataset's `PoissonSamplingInfo`, or None (strict=False only).

    Raises:
      ValueError: non-Poisson input (strict), a q1 or n mismatch (always),
        or an argument outside its range.
    """
    if not isinstance(strict, bool):
        raise ValueError(f'strict must be True or False; got {strict!r}.')
    if example_sampling_rate is not None:
        q1 = float(example_sampling_rate)
        if not 0.0 < q1 <= 1.0:
            raise ValueError('example_sampling_rate must be in (0, 1]; got '
                             f'{example_sampling_rate!r}.')
    info = sampling.get_poisson_sampling_info(dataset)
    if info is None:
        message = (
            f'Training input ({type(dataset).__name__}) is not recognised as '
            'Poisson-sampled logical batches. Fixed-size shuffled batches '
            '(ds.shuffle().batch(), numpy arrays batched by fit) are not '
            'Poisson sampling, so the accountant\'s epsilon is not a valid '
            'bound for them. Build the input with '
            'tf_twice.sampling.poisson_batches(...) and do not map, batch or '
            'cache it afterwards (its elements are (x, y, sample_weight) '
            'triples; per-example preprocessing goes in its preprocess_fn).')
        if strict:
            raise ValueError(message)
        warnings.warn(message + ' Continuing (strict=False): THE REPORTED '
                      'EPSILON DOES NOT HOLD FOR THIS RUN.',
                      NonPoissonInputWarning, stacklevel=2)
        return None
    if example_sampling_rate is not None and not math.isclose(
            info.example_sampling_rate, q1, rel_tol=1e-9, abs_tol=0.0):
        raise ValueError(
            f'The dataset samples with example_sampling_rate '
            f'{info.example_sampling_rate!r} but the accountant uses '
            f'{example_sampling_rate!r}; they must be equal.')
    if num_examples is not None and info.num_examples != num_examples:
        raise ValueError(
            f'The dataset samples from {info.num_examples} examples but the '
            f'accountant uses num_examples={num_examples}: the accounted q1 '
            'and n would not be those of the training.')
    return info


def is_poisson_input(dataset: Any, *, example_sampling_rate: float,
                     num_examples: int) -> bool:
    """Whether ``check_poisson_input`` would accept ``dataset`` for this q1
    and n (no warning, no error)."""
    info = sampling.get_poisson_sampling_info(dataset)
    return info is not None and info.num_examples == num_examples and (
        math.isclose(info.example_sampling_rate, example_sampling_rate,
                     rel_tol=1e-9, abs_tol=0.0))


def check_mechanism_fits_variables(model: Any) -> None:
    """Refuses a DP model whose config's block dimensions are not its
    trainable variables' (``PrivateAggregator.check_variables``): an event
    that claims fewer coordinates than the model has under-reports epsilon.
    Models not built yet are checked when their first step is traced."""
    aggregator = getattr(model, 'aggregator', None)
    if not isinstance(aggregator, aggregator_lib.PrivateAggregator):
        return
    if getattr(model, 'built', False):
        aggregator.check_variables(model.trainable_variables)


# --- the optimizer DPModel is compiled with ---------------------------------


def is_dp_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a tf_twice DP optimizer (it carries a
    ``PrivateAggregator``, the mechanism a DPModel then runs)."""
    return isinstance(getattr(optimizer, 'aggregator', None),
                      aggregator_lib.PrivateAggregator)


def check_dp_optimizer(optimizer: Any, *, has_config: bool) -> None:
    """Refuses an optimizer for ``DPModel.compile`` whose steps would not be
    the one twice-sampled mechanism the model accounts.

    ``has_config``: whether the DPModel has its own config (then the
    optimizer must be a plain Keras one; without, a tf_twice DP one).

    Raises:
      ValueError: naming the fix.
    """
    optimizer = _keras.without_loss_scaling(optimizer)
    name = type(optimizer).__name__
    if is_dp_optimizer(optimizer):
        if has_config:
            raise ValueError(
                'This DPModel already has its DP mechanism (its config); '
                'compile it with a plain Keras optimizer, not the DP '
                f'optimizer {name}, or build it without a config.')
        microbatches = getattr(optimizer, '_num_microbatches', None)
        if microbatches is not None:
            raise ValueError(
                f'{name} uses num_microbatches={microbatches}: microbatched '
                'clipping is not covered by the twice-sampling analysis; use '
                'num_microbatches=None (physical_batch_size splits large '
                'batches without changing the records).')
    elif getattr(optimizer, '_was_dp_gradients_called', None) is not None:
        # tf_privacy's own DP optimizers: another mechanism.
        raise ValueError(
            f'{name} is a DP optimizer whose mechanism DPModel cannot run; '
            'compile with a plain Keras optimizer or a tf_twice DP '
            'optimizer.')
    elif not has_config:
        raise ValueError(f'This DPModel {NO_MECHANISM}')


def check_jit_compile(jit_compile: Any) -> bool:
    """``DPModel.compile``'s ``jit_compile``: True or False (None: False).

    Keras 3's 'auto' is refused rather than resolved, so that whether the
    DP step runs under XLA never depends on the machine.

    Raises:
      ValueError: naming the argument.
    """
    if jit_compile is None:
        return False
    if not isinstance(jit_compile, bool):
        raise ValueError(
            f'jit_compile must be True or False for a DPModel; got '
            f'{jit_compile!r}.')
    return jit_compile


# --- the ledger's event against the mechanism that runs ---------------------


def check_ledger_event(event: dp_accounting.DpEvent, model: Any) -> None:
    """Refuses a ledger whose event is not the step that ``model`` runs.

    A tf_twice ``DPModel`` derives its event from its config
    (``model.dp_event()``), so the ledger's event must be exactly that one
    (``PrivacyLedger.for_model`` builds it so), and its trainable variables
    must be the ones the event describes (``check_mechanism_fits_variables``)
    before it runs more steps. A plain Keras model compiled with a tf_twice
    DP optimizer is refused: Keras gives that optimizer only the loss of a
    batched forward pass, whose per-example gradients are not isolated (one
    NaN record turns every record's gradient into NaN). Any other model's
    steps are counted as ``event``, which the caller vouches for.

    Raises:
      ValueError: naming the fix.
    """
    check_mechanism_fits_variables(model)
    dp_event = getattr(model, 'dp_event', None)
    if callable(dp_event) and hasattr(model, 'aggregator'):
        if model.aggregator is None:
            raise ValueError(f'{model.name} {NO_MECHANISM}')
        try:
            expected = dp_event()
        except ValueError as e:  # E.g. a non_private config: no event.
            raise ValueError(f'{model.name} runs no DP event: {e}') from e
        if event != expected:
            raise ValueError(
                f'The ledger accounts {event}, but {model.name} runs '
                f'{expected}. Build the ledger from the model: '
                'PrivacyLedger.for_model(model, delta=...).')
        return
    optimizer = _keras.without_loss_scaling(getattr(model, 'optimizer', None))
    if getattr(optimizer, 'aggregator', None) is not None:
        raise ValueError(
            f'{type(model).__name__} is compiled with the DP optimizer '
            f'{type(optimizer).__name__}, but Keras gives an optimizer only '
            'the loss of a batched forward pass, whose per-example '
            'gradients are not isolated. Wrap the model first: '
            'model = tf_twice.keras.DPModel(model), then compile that with '
            'the optimizer.')


def fit_callbacks(callbacks: Any) -> list:
    """`fit`'s ``callbacks`` argument (None, a list, a nest or a
    ``CallbackList``) as a flat list of callbacks."""
    if callbacks is None:
        return []
    if isinstance(callbacks, tf.keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    return tf.nest.flatten(callbacks)


def check_no_nonprivate_monitor(callbacks: Any, prefix: str) -> None:
    """Refuses callbacks that act on the noise-free training logs.

    ``EarlyStopping``, ``ReduceLROnPlateau``, ``ModelCheckpoint(
    save_best_only=True)`` and any callback with a ``monitor`` act on the
    value they monitor: on a log named ``prefix...`` (the loss and metrics
    of the private batch without noise) the number of steps, the learning
    rate or the checkpoint released would be a noise-free function of the
    private data, which no accountant covers.
    """
    for callback in fit_callbacks(callbacks):
        monitor = getattr(callback, 'monitor', None)
        if not (isinstance(monitor, str) and monitor.startswith(prefix)):
            continue
        if isinstance(callback, tf.keras.callbacks.ModelCheckpoint) and (
                not getattr(callback, 'save_best_only', False)):
            continue  # Saves every time: the monitored value is not used.
        raise ValueError(
            f'{type(callback).__name__} monitors {monitor!r}, a loss or '
            'metric of the private batch without noise: its decisions (when '
            'to stop, the learning rate, which checkpoint to keep) would '
            'release private information that the PrivacyLedger does not '
            "account. Monitor 'epsilon' or a metric of PUBLIC validation "
            'data (validation_data=...), or remove the callback.')
