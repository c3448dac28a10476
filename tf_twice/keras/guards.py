"""Guard rails: refuse training setups that silently void the DP guarantee.

DP-SGD's guarantee (and `tf_twice.accounting`'s epsilon) rests on five
assumptions the code cannot enforce by itself:

1. each example's gradient depends on that example only: no layer may mix
   examples of a batch (BatchNormalization does, through batch statistics);
2. the loss is per example, so per-example gradients exist (a loss reduced
   to a scalar over the batch has none);
3. batches are Poisson samples (`tf_twice.sampling`), not fixed-size
   shuffled batches;
4. the noisy sum is divided by the *expected* number of contributions
   n * q1 * q2, never by the realised batch size, which depends on who is in
   the batch and is not covered by the accountant;
5. the accountant's event describes the mechanism that actually runs: the
   same noise multiplier, clip norms and sampling rates as the model (or
   its DP optimizer), so that the reported epsilon is for this training
   (`check_event_matches`; `model_dp_params` and `dp_event_from_params`
   read a model's parameters and build its event, so none are copied by
   hand).

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
from typing import Any, Iterator, Optional, Tuple

import dp_accounting
import numpy as np
import tensorflow as tf

from tf_twice import sampling
from tf_twice.accounting import TwiceSampledGaussianDpEvent
from tf_twice.mechanism import aggregation

__all__ = [
    'ALLOWED_NORMALIZATIONS',
    'NonPoissonInputWarning',
    'check_event_matches',
    'check_event_matches_model',
    'check_normalization',
    'check_no_batch_norm',
    'check_per_example_loss',
    'check_poisson_input',
    'dp_event_from_params',
    'model_dp_params',
]

# Relative tolerance when comparing an event's parameters with the model's:
# only float round-off (e.g. of q1 = B / n) is forgiven.
_REL_TOL = 1e-9

# Values of a "normalize by" setting that keep the guarantee: the expected
# number of contributions per coordinate, n * q1 * q2 (SPEC section 4).
ALLOWED_NORMALIZATIONS = ('expected', 'expected_batch_size')
_REALISED = ('realized', 'realised', 'realized_batch_size',
             'realised_batch_size', 'actual', 'actual_batch_size',
             'batch_size', 'batch', 'mean', 'num_examples', 'sampled')


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


def _is_batch_norm(layer: Any) -> bool:
    if isinstance(layer, tf.keras.layers.BatchNormalization):
        return True
    # Also catches SyncBatchNormalization, tf.compat.v1 and other Keras
    # copies of the layer, which need not share the class above.
    return any('BatchNorm' in cls.__name__ for cls in type(layer).__mro__)


def check_no_batch_norm(model: tf.keras.layers.Layer) -> None:
    """Refuses a model with BatchNormalization anywhere (nested models too).

    BatchNormalization normalises each example with statistics of the whole
    batch, so one example's gradient depends on every other example and
    per-example clipping no longer bounds any single example's influence.
    GroupNormalization (what the paper uses) and LayerNormalization
    normalise within an example and are safe.

    Raises:
      ValueError: naming the first BatchNormalization layer found.
    """
    if not isinstance(model, tf.keras.layers.Layer):
        raise ValueError('model must be a tf.keras Model or Layer; got '
                         f'{type(model).__name__}.')
    for path, layer in _walk_layers(model, model.name):
        if _is_batch_norm(layer):
            raise ValueError(
                f'Layer {path!r} ({type(layer).__name__}) normalises with '
                'batch statistics, which mixes examples: per-example '
                'gradients, and so DP-SGD\'s guarantee, do not exist with it. '
                'Use tf.keras.layers.GroupNormalization (as the paper does) '
                'or tf.keras.layers.LayerNormalization instead.')


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


def check_normalization(normalization: str) -> str:
    """Refuses normalising the noisy sum by the realised batch size.

    The update must be the noisy sum divided by the expected number of
    contributions per coordinate, n * q1 * q2 (an unbiased estimate of the
    mean clipped gradient). Dividing by the realised batch size publishes a
    data-dependent quantity (how many examples were sampled) that the
    accountant does not charge for.

    Args:
      normalization: one of `ALLOWED_NORMALIZATIONS` ('expected',
        'expected_batch_size').

    Returns:
      The accepted value.

    Raises:
      ValueError: for realised-size normalisation or any other value.
    """
    value = normalization.lower() if isinstance(normalization, str) else None
    if value in ALLOWED_NORMALIZATIONS:
        return normalization
    if value in _REALISED:
        raise ValueError(
            f'normalization={normalization!r} divides by the realised batch '
            'size, which depends on which examples were sampled and is not '
            'covered by the privacy accounting. Use one of '
            f'{ALLOWED_NORMALIZATIONS} (divide by n * q1 * q2).')
    raise ValueError(f'normalization must be one of {ALLOWED_NORMALIZATIONS}; '
                     f'got {normalization!r}.')


# --- the accountant's event against the mechanism that runs ----------------


def model_dp_params(model: Any) -> Optional[aggregation.AggregationParams]:
    """The clipping, sampling and noise parameters of `model`'s DP steps.

    Recognises `tf_twice.keras.DPModel` (its `dp_params`) and a Keras model
    compiled with a tf_twice `TwiceSamplingDPKeras*Optimizer` (the
    optimizer's `dp_params`).

    Returns:
      The `AggregationParams`, or None when `model` is neither (a plain
      Keras model, or one not compiled yet).

    Raises:
      ValueError: the optimizer uses `num_microbatches`. Its records are
        then microbatches of a variable-size Poisson batch: their number is
        fixed, they are present at every step (so their sampling rate is not
        expected_batch_size / n) and adding one example can shift the
        membership of several of them, so neither the event of examples at
        rate q1 nor tf_privacy's halved noise multiplier (sensitivity 2 * c2
        for ONE changed record) bounds such a step.
    """
    params = getattr(model, 'dp_params', None)
    if isinstance(params, aggregation.AggregationParams):
        return params
    optimizer = getattr(model, 'optimizer', None)
    params = getattr(optimizer, 'dp_params', None)
    if not isinstance(params, aggregation.AggregationParams):
        return None
    num_microbatches = getattr(optimizer, '_num_microbatches', None)
    if num_microbatches is not None:
        raise ValueError(
            f'The DP optimizer {type(optimizer).__name__} uses '
            f'num_microbatches={num_microbatches}: its records are '
            'microbatches of a variable-size Poisson batch, present at every '
            'step, and one added example can shift several of them, so no '
            'twice-sampling event (with or without tf_privacy\'s halved '
            'noise multiplier) bounds its steps. Use num_microbatches=None, '
            'or tf_twice.keras.DPModel, whose physical_batch_size splits '
            'large batches without changing the records.')
    return params


def dp_event_from_params(params: aggregation.AggregationParams,
                         num_examples: int) -> TwiceSampledGaussianDpEvent:
    """The `TwiceSampledGaussianDpEvent` of one step with `params`.

    With Poisson sampling of `num_examples` examples at rate
    q1 = expected_batch_size / num_examples, one step with `params` is
    exactly this event (l2 clip c2, l-infinity clip c_inf, coordinate rate
    q2, noise multiplier z), so accounting it gives the step's guarantee.

    Args:
      params: the step's `AggregationParams` (e.g. `DPModel.dp_params`).
      num_examples: n, an integer >= expected_batch_size.

    Raises:
      ValueError: num_examples is not an integer >= expected_batch_size
        (q1 would exceed 1), or the noise multiplier is 0 (no DP at all).
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
    if params.noise_multiplier <= 0:
        raise ValueError(
            'noise_multiplier must be > 0 for a DP guarantee; got '
            f'{params.noise_multiplier:g}, which releases the clipped sum '
            'without noise (epsilon is infinite).')
    return TwiceSampledGaussianDpEvent(
        example_sampling_rate=batch / num_examples,
        coordinate_sampling_rate=params.coordinate_sampling_rate,
        noise_multiplier=params.noise_multiplier,
        l2_norm_clip=params.l2_norm_clip,
        linf_norm_clip=params.linf_norm_clip)


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


def check_event_matches(event: dp_accounting.DpEvent,
                        *,
                        l2_norm_clip: float,
                        linf_norm_clip: Optional[float],
                        noise_multiplier: float,
                        coordinate_sampling_rate: float,
                        expected_batch_size: float,
                        num_examples: Optional[int] = None,
                        num_parameters: Optional[int] = None) -> None:
    """Refuses an accountant event that does not describe the running step.

    A ledger composes its event once per step, so its epsilon bounds the
    training only if the event is the mechanism that runs: the same noise
    multiplier z, l2 clip c2, l-infinity clip c_inf (None and any value
    >= c2 are the same bound) and coordinate rate q2, and an example rate
    q1 with q1 * n = expected_batch_size. Equality is required up to float
    round-off, in both directions, so a hand-copied parameter cannot drift.

    Args:
      event: the ledger's event of one step; must be a single-block
        `TwiceSampledGaussianDpEvent`.
      l2_norm_clip, linf_norm_clip, noise_multiplier,
      coordinate_sampling_rate, expected_batch_size: the model's (or its DP
        optimizer's) parameters, as in `AggregationParams`.
      num_examples: n of the Poisson-sampled dataset, or None when it is not
        known (then q1 is not checked).
      num_parameters: the number of trainable coordinates, or None when not
        known; needed only if the event has `block_dimensions`, which must
        then equal it (a smaller value would understate the sensitivity).

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
    if blocks.size != 1:
        raise ValueError(
            f'The privacy ledger\'s event has {blocks.size} blocks, but the '
            'model clips and noises all its gradients as one block; the '
            'event must have a single noise_multiplier, l2_norm_clip and '
            'linf_norm_clip.')
    z = float(noise_multiplier)
    c2 = float(l2_norm_clip)
    # The l-infinity bound that matters is min(c_inf, c2), as in the event.
    c_inf = c2 if linf_norm_clip is None else min(float(linf_norm_clip), c2)
    if not _close(blocks.noise_multipliers[0], z):
        raise _mismatch('noise_multiplier', event.noise_multiplier, z)
    if not _close(blocks.l2_norm_clips[0], c2):
        raise _mismatch('l2_norm_clip', event.l2_norm_clip, c2)
    if not _close(blocks.linf_norm_clips[0], c_inf):
        raise _mismatch('linf_norm_clip', event.linf_norm_clip,
                        linf_norm_clip,
                        ' (after l2 clipping its bound is '
                        f'{blocks.linf_norm_clips[0]:g} vs {c_inf:g})')
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
    if blocks.dimensions is not None:
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
    check_event_matches(
        event,
        l2_norm_clip=params.l2_norm_clip,
        linf_norm_clip=params.linf_norm_clip,
        noise_multiplier=params.noise_multiplier,
        coordinate_sampling_rate=params.coordinate_sampling_rate,
        expected_batch_size=params.expected_batch_size,
        num_examples=num_examples,
        num_parameters=_num_trainable_parameters(model))
    return True
