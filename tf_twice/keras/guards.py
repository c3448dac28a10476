"""Guard rails: refuse training setups that silently void the DP guarantee.

DP-SGD's guarantee (and `tf_twice.accounting`'s epsilon) rests on five
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
5. the accountant's event describes the mechanism that actually runs: the
   same noise multiplier, clip norms and sampling rates as the model (or
   its DP optimizer), per block with hybrid clipping, and the basis's block
   dimensions, so that the reported epsilon is for this training
   (`check_event_matches`; `model_dp_params`, `model_basis` and
   `model_dp_event` read a model's parameters and build its event, so none
   are copied by hand).

Every check raises ValueError naming what is wrong and what to use instead.
`check_poisson_input` is strict by default: a non-Poisson dataset is refused
(ValueError), because the epsilon reported for it would not be a valid bound.
`strict=False` downgrades that to a `NonPoissonInputWarning` for experiments
whose epsilon is not claimed; the warning says that the epsilon does not hold.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any, Iterator, Optional, Sequence, Tuple, Union

import dp_accounting
import numpy as np
import tensorflow as tf

from tf_twice import sampling
from tf_twice.accounting import TwiceSampledGaussianDpEvent
from tf_twice.mechanism import aggregation
from tf_twice.mechanism import basis as basis_lib

__all__ = [
    'NonPoissonInputWarning',
    'check_event_matches',
    'check_event_matches_model',
    'check_no_example_mixing',
    'check_per_example_loss',
    'check_poisson_input',
    'dp_event_from_params',
    'model_basis',
    'model_dp_event',
    'model_dp_params',
]

# Relative tolerance when comparing an event's parameters with the model's:
# only float round-off (e.g. of q1 = B / n) is forgiven.
_REL_TOL = 1e-9

class NonPoissonInputWarning(UserWarning):
    """Training data is not Poisson-sampled; the reported epsilon is void."""


def _walk_layers(layer: Any, path: str) -> Iterator[Tuple[str, Any]]:
    """Yields (path, layer) for `layer` and every layer nested in it."""
    yield path, layer
    children = getattr(layer, '_flatten_layers', None)
    if children is not None:
        nested = children(include_self=False, recursive=False)
    else:
        nested = getattr(layer, 'layers', [])
    for child in nested:
        yield from _walk_layers(child, f'{path}/{child.name}')


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
      ``TextVectorization``... after ``adapt``): its statistics or
      vocabulary are a function of the data it saw, released with the model
      and not accounted; if that data was private, the guarantee is void.
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
    if getattr(layer, 'is_adapted', False) is True:
        return ('was adapted on data: its statistics or vocabulary are '
                'released with the model and no accountant covers them. Give '
                'its parameters explicitly (e.g. Normalization(mean=..., '
                'variance=...), StringLookup(vocabulary=...)) computed from '
                'PUBLIC data.')
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
    for path, layer in _walk_layers(model, model.name):
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
        if reduction != tf.keras.losses.Reduction.NONE:
            raise ValueError(
                f'Loss {where} ({type(loss).__name__}) has reduction '
                f'{reduction!r}: it averages over the batch, so there are no '
                'per-example losses to clip. Construct it with '
                'reduction=tf.keras.losses.Reduction.NONE.')
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
            'reduction=tf.keras.losses.Reduction.NONE.')


def check_per_example_loss(loss: Any, y_true: Any = None,
                           y_pred: Any = None) -> None:
    """Refuses a loss that does not return one value per example.

    DP-SGD clips each example's gradient, so it needs per-example losses.
    Accepted: a Keras `Loss` with `reduction=Reduction.NONE`; a loss name
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
      strict: True (default) raises on non-Poisson input; False only warns
        (`NonPoissonInputWarning`), for runs that claim no epsilon.

    Returns:
      The dataset's `PoissonSamplingInfo`, or None (strict=False only).

    Raises:
      ValueError: non-Poisson input (strict), a q1 mismatch (always), or
        an argument outside its range.
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
            'cache it afterwards.')
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
    return info


# --- the accountant's event against the mechanism that runs ----------------


def model_dp_params(model: Any) -> Optional[aggregation.AggregationParams]:
    """The clipping, sampling and noise parameters of `model`'s DP steps.

    Recognises `tf_twice.keras.DPModel` (its `dp_params`, its own or those
    of the tf_twice DP optimizer it is compiled with).

    Returns:
      The `AggregationParams`, or None when `model` is not a DP model (a
      plain Keras model, or a DPModel not compiled yet).

    Raises:
      ValueError: a plain Keras model compiled with a tf_twice DP optimizer.
        Keras gives that optimizer only the loss of a batched forward pass,
        whose per-example gradients are not isolated (one NaN record turns
        every record's gradient into NaN), so its steps are not the
        accounted mechanism; it must be wrapped with `make_private`.
    """
    params = getattr(model, 'dp_params', None)
    if isinstance(params, aggregation.AggregationParams):
        return params
    optimizer = getattr(model, 'optimizer', None)
    if isinstance(getattr(optimizer, 'dp_params', None),
                  aggregation.AggregationParams):
        raise ValueError(
            f'{type(model).__name__} is compiled with the DP optimizer '
            f'{type(optimizer).__name__}, but Keras gives an optimizer only '
            'the loss of a batched forward pass, whose per-example '
            'gradients are not isolated. Wrap the model first: '
            'model = tf_twice.keras.make_private(model, '
            'physical_batch_size=...), then compile that with the optimizer.')
    return None


def model_basis(model: Any) -> Optional[basis_lib.HybridBasis]:
    """The hybrid-clipping basis of `model`'s DP steps, or None (one block).

    Reads `DPModel.basis` (its own, or its DP optimizer's).
    """
    basis = getattr(model, 'basis', None)
    return basis if isinstance(basis, basis_lib.HybridBasis) else None


def dp_event_from_params(
        params: aggregation.AggregationParams,
        num_examples: int,
        *,
        block_dimensions: Optional[Sequence[int]] = None
) -> TwiceSampledGaussianDpEvent:
    """The `TwiceSampledGaussianDpEvent` of one step with `params`.

    With Poisson sampling of `num_examples` examples at rate
    q1 = expected_batch_size / num_examples, one step with `params` is
    exactly this event (l2 clip c2, l-infinity clip c_inf, coordinate rate
    q2, noise multiplier z; per-block tuples for hybrid clipping), so
    accounting it gives the step's guarantee.

    Args:
      params: the step's `AggregationParams` (e.g. `DPModel.dp_params`).
      num_examples: n, an integer >= expected_batch_size.
      block_dimensions: optional coordinates per block, for hybrid clipping
        `basis.block_dimensions` (r_1..r_{m-1}, d); it can only tighten the
        bound, and must be the true dimensions (see `model_dp_event`).

    Raises:
      ValueError: num_examples is not an integer >= expected_batch_size
        (q1 would exceed 1), a noise multiplier is 0 (no DP at all), or
        block_dimensions does not have one entry per block.
    """
    if not isinstance(params, aggregation.AggregationParams):
        raise ValueError('params must be tf_twice AggregationParams; got '
                         f'{type(params).__name__}.')
    if (isinstance(num_examples, (bool, np.bool_))
            or not isinstance(num_examples, numbers.Integral)
            or num_examples < 1):
        raise ValueError('num_examples must be an integer >= 1 (the size of '
                         f'the private training set); got {num_examples!r}.')
    batch = params.expected_batch_size
    if batch > num_examples:
        raise ValueError(
            f'expected_batch_size ({batch:g}) must be <= num_examples '
            f'({num_examples}): the sampling rate q1 = expected_batch_size / '
            'num_examples must be in (0, 1].')
    for j, z in enumerate(params.noise_multipliers):
        if z <= 0:
            where = '' if params.num_blocks == 1 else f' (block {j})'
            raise ValueError(
                f'noise_multiplier must be > 0 for a DP guarantee{where}; '
                f'got {z:g}, which releases the clipped sum without noise '
                '(epsilon is infinite).')
    if block_dimensions is not None:
        dims = tuple(block_dimensions) if isinstance(
            block_dimensions, (list, tuple)) else (block_dimensions,)
        if len(dims) != params.num_blocks:
            raise ValueError(
                f'block_dimensions must have one entry per block '
                f'({params.num_blocks}); got {block_dimensions!r}.')
        block_dimensions = dims if params.num_blocks > 1 else dims[0]
    linf = params.linf_norm_clip
    if isinstance(linf, tuple) and all(c is None for c in linf):
        linf = None  # One canonical event for "no l-infinity clipping".
    return TwiceSampledGaussianDpEvent(
        example_sampling_rate=batch / num_examples,
        coordinate_sampling_rate=params.coordinate_sampling_rate,
        noise_multiplier=params.noise_multiplier,
        l2_norm_clip=params.l2_norm_clip,
        linf_norm_clip=linf,
        block_dimensions=block_dimensions)


def model_dp_event(model: Any,
                   num_examples: int) -> TwiceSampledGaussianDpEvent:
    """The `DpEvent` of one DP step of `model` on `num_examples` examples.

    `model` is a `DPModel` or a Keras model compiled with a tf_twice DP
    optimizer. With hybrid clipping the event has the per-block parameters
    and `block_dimensions = basis.block_dimensions` (principal ranks r_j,
    then d: the residual is released in all d natural coordinates).

    Raises:
      ValueError: `model` is not a tf_twice DP model, or as
        `model_dp_params` and `dp_event_from_params`.
    """
    params = model_dp_params(model)
    if params is None:
        raise ValueError(
            'model must be a tf_twice.keras.DPModel or a Keras model '
            'compiled with a tf_twice TwiceSamplingDPKeras*Optimizer; got '
            f'{type(model).__name__} with optimizer '
            f'{type(getattr(model, "optimizer", None)).__name__}.')
    basis = model_basis(model)
    return dp_event_from_params(
        params, num_examples,
        block_dimensions=None if basis is None else basis.block_dimensions)


def _mismatch(field: str, event_value: Any, model_value: Any,
              extra: str = '') -> ValueError:
    return ValueError(
        f'The privacy ledger\'s event has {field}={event_value!r} but the '
        f'model trains with {field}={model_value!r}{extra}: the reported '
        'epsilon would be for another mechanism. Build the ledger with '
        'PrivacyLedger.for_model(model, num_examples=..., delta=...) (or '
        'the event with DPModel.dp_event(num_examples)) instead of copying '
        'parameters by hand.')


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=_REL_TOL, abs_tol=0.0)


def _as_blocks(value: Any) -> Tuple[Any, ...]:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def check_event_matches(
        event: dp_accounting.DpEvent,
        *,
        l2_norm_clip: Union[float, Sequence[float]],
        linf_norm_clip: Union[None, float, Sequence[Optional[float]]],
        noise_multiplier: Union[float, Sequence[float]],
        coordinate_sampling_rate: float,
        expected_batch_size: float,
        num_examples: Optional[int] = None,
        num_parameters: Optional[int] = None,
        block_dimensions: Optional[Sequence[int]] = None) -> None:
    """Refuses an accountant event that does not describe the running step.

    A ledger composes its event once per step, so its epsilon bounds the
    training only if the event is the mechanism that runs: the same number
    of blocks and, per block, the same noise multiplier z, l2 clip c2 and
    l-infinity clip c_inf (None and any value >= c2 are the same bound),
    the same coordinate rate q2, and an example rate q1 with
    q1 * n = expected_batch_size. Equality is required up to float
    round-off, in both directions, so a hand-copied parameter cannot drift.

    Args:
      event: the ledger's event of one step; must be a
        `TwiceSampledGaussianDpEvent`.
      l2_norm_clip, linf_norm_clip, noise_multiplier: the model's (or its DP
        optimizer's) parameters: numbers for one block, per-block sequences
        for hybrid clipping (as in `AggregationParams`).
      coordinate_sampling_rate, expected_batch_size: as in
        `AggregationParams`.
      num_examples: n of the Poisson-sampled dataset, or None when it is not
        known (then q1 is not checked).
      num_parameters: one block: the number of trainable coordinates, or
        None when not known; needed only if the event has
        `block_dimensions`, which must then equal it (a smaller value would
        understate the sensitivity).
      block_dimensions: several blocks: the basis's `block_dimensions`
        (r_1..r_{m-1}, d). An event with `block_dimensions` must have
        exactly these; an event without them is accepted (its bound is
        sound, only looser).

    Raises:
      ValueError: naming the first field that does not match.
    """
    if not isinstance(event, TwiceSampledGaussianDpEvent):
        raise ValueError(
            'The privacy ledger of a tf_twice DP model must account a '
            'TwiceSampledGaussianDpEvent describing its step; got '
            f'{type(event).__name__}. Use PrivacyLedger.for_model(model, '
            'num_examples=..., delta=...).')
    blocks = event.blocks()
    zs = _as_blocks(noise_multiplier)
    clips = _as_blocks(l2_norm_clip)
    linfs = (_as_blocks(linf_norm_clip) if linf_norm_clip is not None
             else (None,) * len(clips))
    if not len(zs) == len(clips) == len(linfs):
        raise ValueError(
            'noise_multiplier, l2_norm_clip and linf_norm_clip must have the '
            f'same number of blocks; got {len(zs)}, {len(clips)} and '
            f'{len(linfs)}.')
    m = len(clips)
    if blocks.size != m:
        raise ValueError(
            f'The privacy ledger\'s event has {blocks.size} blocks, but the '
            f'model clips and noises its gradients as {m} block(s)'
            + (' (no hybrid-clipping basis); the event must have a single '
               'noise_multiplier, l2_norm_clip and linf_norm_clip.'
               if m == 1 else
               '; build the event with PrivacyLedger.for_model(model, ...) '
               'or DPModel.dp_event(num_examples).'))

    def shown(values):
        return values[0] if m == 1 else values

    for j in range(m):
        where = '' if m == 1 else f' (block {j})'
        z, c2 = float(zs[j]), float(clips[j])
        # The l-infinity bound that matters is min(c_inf, c2), as in the
        # event.
        c_inf = c2 if linfs[j] is None else min(float(linfs[j]), c2)
        if not _close(blocks.noise_multipliers[j], z):
            raise _mismatch('noise_multiplier', event.noise_multiplier,
                            shown(zs), where)
        if not _close(blocks.l2_norm_clips[j], c2):
            raise _mismatch('l2_norm_clip', event.l2_norm_clip, shown(clips),
                            where)
        if not _close(blocks.linf_norm_clips[j], c_inf):
            raise _mismatch('linf_norm_clip', event.linf_norm_clip,
                            shown(linfs),
                            f'{where} (after l2 clipping its bound is '
                            f'{blocks.linf_norm_clips[j]:g} vs {c_inf:g})')
    if not _close(float(event.coordinate_sampling_rate),
                  float(coordinate_sampling_rate)):
        raise _mismatch('coordinate_sampling_rate',
                        event.coordinate_sampling_rate,
                        coordinate_sampling_rate)
    if num_examples is not None:
        implied = float(event.example_sampling_rate) * int(num_examples)
        if not _close(implied, float(expected_batch_size)):
            raise _mismatch(
                'example_sampling_rate', event.example_sampling_rate,
                float(expected_batch_size) / int(num_examples),
                f' (expected_batch_size {float(expected_batch_size):g} / '
                f'num_examples {int(num_examples)})')
    if blocks.dimensions is None:
        return
    if m > 1:
        if block_dimensions is None:
            raise ValueError(
                'The privacy ledger\'s event sets block_dimensions='
                f'{event.block_dimensions!r}, which can only be checked '
                'against the model\'s basis; pass block_dimensions='
                'basis.block_dimensions or leave them unset in the event.')
        if tuple(int(r) for r in block_dimensions) != blocks.dimensions:
            raise _mismatch('block_dimensions', event.block_dimensions,
                            tuple(int(r) for r in block_dimensions),
                            ' (the basis\'s principal ranks, then d)')
        return
    if num_parameters is None:
        raise ValueError(
            'The privacy ledger\'s event sets block_dimensions='
            f'{event.block_dimensions!r}, which can only be checked '
            'against a built model; build the model first (call it '
            'once) or leave block_dimensions unset.')
    if blocks.dimensions[0] != int(num_parameters):
        raise _mismatch('block_dimensions', event.block_dimensions,
                        int(num_parameters),
                        ' (its number of trainable coordinates)')


def _num_trainable_parameters(model: Any) -> Optional[int]:
    """Coordinates the step clips (all trainable ones); None if unbuilt."""
    # A DPModel trains its wrapped model, which may be built before it is.
    model = getattr(model, 'inner_model', model)
    if not getattr(model, 'built', False):
        return None
    return int(sum(int(np.prod(v.shape.as_list()))
                   for v in model.trainable_variables))


def check_event_matches_model(event: dp_accounting.DpEvent, model: Any, *,
                              num_examples: Optional[int] = None) -> bool:
    """`check_event_matches` against `model_dp_params(model)`.

    Returns:
      True if `model` is a tf_twice DP model (DPModel, or compiled with a
      tf_twice DP optimizer) and `event` matches it; False, with nothing
      checked, for any other model.

    Raises:
      ValueError: as `check_event_matches` and `model_dp_params`.
    """
    params = model_dp_params(model)
    if params is None:
        return False
    basis = model_basis(model)
    check_event_matches(
        event,
        l2_norm_clip=params.l2_norm_clip,
        linf_norm_clip=params.linf_norm_clip,
        noise_multiplier=params.noise_multiplier,
        coordinate_sampling_rate=params.coordinate_sampling_rate,
        expected_batch_size=params.expected_batch_size,
        num_examples=num_examples,
        num_parameters=_num_trainable_parameters(model),
        block_dimensions=None if basis is None else basis.block_dimensions)
    return True
