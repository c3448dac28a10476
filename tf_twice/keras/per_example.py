"""Per-example losses, weights and gradients: the Keras layer's one adapter.

DP-SGD clips each example's gradient, so every training path needs the loss
of each example on its own and that example's gradient computed in
isolation (SPEC section 11: a batched backward pass leaks NaN/inf across
rows, 0 * NaN = NaN). This module is the one place that

* turns a Keras loss into per-example losses (`loss_fn`),
* adds the model's regularisation losses to each example (`losses`),
* runs one forward and backward pass per example under
  `tf.vectorized_map` (`gradients`, O(B) rather than the O(B^2) of
  `tape.jacobian`; conv kernel and max-pool gradients converted by
  `vectorized_backprop`),
* reads per-example weights in [0, 1] (`example_weights`,
  `check_weights`), and
* cuts a logical batch into physical chunks (`chunk_of`,
  `default_physical_batch_size`) for a model built beforehand (`build`).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_twice import config as config_lib
from tf_twice.keras import loss_state
from tf_twice.keras import vectorized_backprop

__all__ = ['ExampleLoss', 'PerExample', 'build', 'check_weights',
           'default_physical_batch_size', 'example_weights', 'gradients',
           'chunk_of', 'loss_fn', 'losses']

LossFn = Callable[[tf.Tensor, tf.Tensor], tf.Tensor]

# Weights scale an example's clipped contribution: above 1 it would exceed
# the clip bound the accountant assumes.
WEIGHT_RANGE = ('must be finite and in [0, 1] (1: a real example, 0: '
                'padding); a weight above 1 would scale an example\'s '
                'clipped gradient past the bound the accountant assumes')


def _are_class_indices(y_true: tf.Tensor, y_pred: tf.Tensor) -> bool:
    """Whether ``y_true`` holds class indices into ``y_pred``'s last axis:
    integer labels one rank below predictions over C > 1 classes (or with a
    trailing axis of 1), whatever the loss that reads them."""
    classes = y_pred.shape[-1] if y_pred.shape.rank else None
    if y_true.dtype.is_floating or classes is None or classes < 2:
        return False
    rank, pred_rank = y_true.shape.rank, y_pred.shape.rank
    return rank == pred_rank - 1 or (rank == pred_rank
                                     and y_true.shape[-1] == 1)


def loss_fn(loss: Any) -> 'ExampleLoss':
    """f(y_true, y_pred) -> per-example losses [B] (float32) for ``loss``.

    ``loss``: a Keras ``Loss`` (its unreduced ``call``: the reduction
    setting does not matter, every example is reduced on its own), a loss
    name, or a callable returning losses of shape [B, ...] (averaged over
    the trailing axes). A class index outside [0, classes) gives that
    example a NaN loss with zero gradient instead of an error that would
    abort the step, revealing that the record was sampled and listing the
    batch's labels (``ExampleLoss.valid_rows`` gives the metrics the same
    rows). A loss that writes a variable is refused at its first call,
    before any step runs (``loss_state``).
    """
    if loss is None:
        raise ValueError('DPModel.compile needs a loss, got loss=None.')
    if isinstance(loss, (dict, list, tuple)):
        raise ValueError(
            'DPModel supports a single loss (one model output), got '
            f'{type(loss).__name__}.')
    if not isinstance(loss, tf.keras.losses.Loss):
        loss = tf.keras.losses.get(loss)
    return ExampleLoss(loss)


def _all_per_row(valid: tf.Tensor) -> tf.Tensor:
    """[B] bool: whether every entry of each row of ``valid`` holds."""
    return tf.reduce_all(tf.reshape(valid, [tf.shape(valid)[0], -1]), axis=1)


def rows_where(keep: tf.Tensor):
    """t -> the rows of t where ``keep`` [B] is True, in order: one index
    for every tensor (as tf.boolean_mask each, in a fraction of its ops)."""
    index = tf.reshape(tf.where(keep), [-1])
    return lambda t: tf.gather(t, index)


class ExampleLoss:
    """The per-example loss of a Keras loss (see `loss_fn`)."""

    def __init__(self, loss: Any) -> None:
        self.sparse = (
            isinstance(loss, tf.keras.losses.SparseCategoricalCrossentropy)
            or loss is tf.keras.losses.sparse_categorical_crossentropy)
        # Entries labelled ignore_class (e.g. padding of a sequence) carry
        # no loss, and an example's loss is the mean over its other entries,
        # as Keras's reduction takes it. The mask is applied here: Keras's
        # own (a boolean_mask) does not vectorize over examples.
        kwargs = dict(getattr(loss, '_fn_kwargs', None) or {})
        self._ignore_class = kwargs.pop('ignore_class', None)
        if isinstance(loss, tf.keras.losses.Loss):
            self._fn = (loss.call if self._ignore_class is None
                        else functools.partial(loss.fn, **kwargs))
            self.name = f'{type(loss).__name__} {loss.name!r}'
        else:
            self._fn = loss
            self.name = getattr(loss, '__name__', type(loss).__name__)
        self._checked = False

    def _valid_labels(self, y_true: tf.Tensor,
                      y_pred: tf.Tensor) -> Optional[tf.Tensor]:
        """Whether each class index lies in [0, classes) (y_true's shape);
        None when y_true does not hold class indices."""
        if not ((self.sparse and y_pred.shape[-1] is not None)
                or _are_class_indices(y_true, y_pred)):
            return None
        labels = tf.cast(y_true, tf.int64)
        return tf.logical_and(labels >= 0, labels < y_pred.shape[-1])

    def valid_rows(self, y_true: Any, y_pred: Any) -> Optional[tf.Tensor]:
        """[B] bool, False where a row's class index is outside the classes
        (the rows whose loss is NaN); None when the labels are not class
        indices or the predictions are a nest.

        A compiled metric must skip those rows: it reads the raw labels,
        and e.g. a sparse cross-entropy aborts the step on such a label,
        revealing that the record was sampled. A label equal to the loss's
        ignore_class is outside too: the metrics do not ignore it.
        """
        if tf.nest.is_nested(y_true) or tf.nest.is_nested(y_pred):
            return None
        valid = self._valid_labels(tf.convert_to_tensor(y_true),
                                   tf.convert_to_tensor(y_pred))
        return None if valid is None else _all_per_row(valid)

    def __call__(self, y_true: tf.Tensor, y_pred: Any) -> tf.Tensor:
        y_pred = tf.convert_to_tensor(y_pred)
        y_true = tf.cast(y_true, y_pred.dtype) if y_true.dtype.is_floating \
            else y_true
        valid = self._valid_labels(y_true, y_pred)
        invalid = kept = None
        if valid is not None:
            if self._ignore_class is not None:
                kept = tf.cast(y_true, tf.int64) != self._ignore_class
                invalid = tf.logical_not(_all_per_row(
                    tf.logical_or(valid, tf.logical_not(kept))))
            else:
                invalid = tf.logical_not(_all_per_row(valid))
            y_true = tf.where(valid, y_true, tf.zeros_like(y_true))
        if not self._checked:  # Once: it traces the loss.
            loss_state.check_no_state_writes(self._fn, self.name, y_true,
                                             y_pred)
            self._checked = True
        values = tf.cast(tf.convert_to_tensor(self._fn(y_true, y_pred)),
                         tf.float32)
        count = None
        if kept is not None:
            kept = tf.reshape(kept, tf.shape(values))
            # A select, not a product: an ignored entry's loss may be inf.
            values = tf.where(kept, values, tf.zeros_like(values))
            count = tf.cast(kept, values.dtype)
        if invalid is not None:
            # The constant branch has zero gradient: no contribution.
            values = tf.where(
                tf.reshape(invalid, [-1] + [1] * (values.shape.rank - 1)),
                tf.fill(tf.shape(values), float('nan')), values)
        if values.shape.rank is not None and values.shape.rank > 1:
            axes = list(range(1, values.shape.rank))
            if count is None:
                values = tf.reduce_mean(values, axis=axes)
            else:  # An example with every entry ignored has loss 0.
                values = (tf.reduce_sum(values, axis=axes) / tf.maximum(
                    tf.reduce_sum(count, axis=axes), 1.0))
        return values


def losses(model: tf.keras.Model, loss: LossFn, y_true: Any,
           y_pred: Any) -> tf.Tensor:
    """Per-example losses [B] plus the model's regularisation losses (read
    after the forward pass that produced ``y_pred``)."""
    values = loss(y_true, y_pred)
    if model.losses:
        values += tf.cast(tf.add_n(model.losses), values.dtype)
    return values


class PerExample(NamedTuple):
    """What `gradients` returns for a chunk of P examples."""
    gradients: Sequence[tf.Tensor]  # One [P, *shape] per trainable variable.
    losses: tf.Tensor  # [P]
    predictions: Any  # The model's outputs, [P, ...] each.


def gradients(model: tf.keras.Model, loss: LossFn, x: Any, y: tf.Tensor, *,
              training: bool = True) -> PerExample:
    """Per-example gradients of ``losses`` w.r.t. the trainable variables.

    Each example runs its own forward and backward pass (vectorized), so its
    gradient depends on it alone: a NaN, inf or overflowing example cannot
    reach another example's row, as it would through the backward pass of
    one batched forward pass (0 * NaN = NaN). ``model`` must be built
    (`build`).
    """
    variables = model.trainable_variables

    def one_example(args):
        xi, yi = args
        xi = tf.nest.map_structure(lambda t: tf.expand_dims(t, 0), xi)
        with vectorized_backprop.faster_conversions():
            with tf.GradientTape() as tape:
                prediction = model(xi, training=training)
                example_loss = losses(model, loss, tf.expand_dims(yi, 0),
                                      prediction)[0]
            grads = tape.gradient(
                example_loss, variables,
                unconnected_gradients=tf.UnconnectedGradients.ZERO)
        grads = [tf.convert_to_tensor(g) for g in grads]
        prediction = tf.nest.map_structure(lambda t: t[0], prediction)
        return grads, example_loss, prediction

    with vectorized_backprop.ungrouped_convolutions(model):
        return PerExample(*tf.vectorized_map(one_example, (x, y)))


# --- weights ----------------------------------------------------------------


def check_weights(name: str, values: Any) -> None:
    """Refuses, before training, weights outside [0, 1] or non-finite.

    ``values``: an array of per-example weights (``sample_weight``) or a
    ``{class: weight}`` dict (``class_weight``); None passes.
    """
    if values is None:
        return
    if isinstance(values, dict):
        values = list(values.values())
    try:
        values = np.asarray(values, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        return  # Not an array; read in the graph by `example_weights`.
    bad = ~((values >= 0) & (values <= 1))  # NaN compares False.
    if bad.any():
        first = int(np.argmax(bad))
        raise ValueError(
            f'{name} {WEIGHT_RANGE}; got {int(bad.sum())} of {values.size} '
            f'outside, e.g. {values[first]} at index {first}.')


def with_checked_weights(*element: Any) -> Tuple[Any, ...]:
    """A dataset element ``(x, y[, sample_weight])``, its weights refused
    (InvalidArgumentError, when the element is read) outside [0, 1]: for a
    step compiled by XLA, which drops the step's own assertion."""
    if len(element) < 3 or element[2] is None:
        return element
    return element[:2] + (_asserted_in_range(
        tf.convert_to_tensor(element[2])),) + element[3:]


def _asserted_in_range(weights: tf.Tensor) -> tf.Tensor:
    """``weights``, refused at run time (InvalidArgumentError) outside
    [0, 1]."""
    check = tf.debugging.Assert(
        tf.reduce_all(tf.logical_and(weights >= 0, weights <= 1)),
        [f'sample_weight {WEIGHT_RANGE}. Got min/max:',
         tf.reduce_min(weights), tf.reduce_max(weights)])
    with tf.control_dependencies([check]):
        return tf.identity(weights)


def example_weights(sample_weight: Any, size: tf.Tensor, *,
                    bounded: bool) -> tf.Tensor:
    """Per-example weights [B] (ones when there are none).

    ``bounded``: assert them in [0, 1] in the graph, for a training step
    (weights that come from a dataset were not seen by `check_weights`);
    evaluation weights only weight metrics and may be any.
    """
    if sample_weight is None:
        return tf.ones([size], tf.float32)
    sample_weight = tf.convert_to_tensor(sample_weight)
    shape = sample_weight.shape
    if shape.rank is not None and not (
            shape.rank == 1 or (shape.rank == 2 and shape[1] == 1)):
        raise ValueError(
            'sample_weight must hold one weight per example (shape [B] or '
            f'[B, 1]), got shape {shape}.')
    weights = tf.reshape(tf.cast(sample_weight, tf.float32), [-1])
    return _asserted_in_range(weights) if bounded else weights


# --- physical chunks --------------------------------------------------------


def chunk_of(tensors: Any, index: tf.Tensor, chunk: int,
             size: tf.Tensor) -> Any:
    """Rows [index * chunk, min((index + 1) * chunk, size)) of each tensor
    of the nest [B, ...], the last chunk zero-padded to a multiple of
    ``padding_unit(chunk)`` (pad the weights with zeros too, so that padding
    rows contribute nothing).

    Why: padding a Poisson batch of k rows to a multiple of ``chunk``
    computed 1.48x the real rows at an expected batch of 256; a last chunk
    of any size k mod chunk made each new size a new shape for the kernels
    (per-shape set-up, about 2x slower on CPU). Multiples of chunk / 8 keep
    the padding below chunk / 8 rows per batch and the shapes to 8.
    """
    start = index * chunk
    stop = tf.minimum(start + chunk, size)
    unit = padding_unit(chunk)
    # Only the last, partial chunk is padded (a full chunk of a size that
    # is not a multiple of the unit stays as it is).
    pad = tf.where(stop - start < chunk, tf.math.floormod(start - stop, unit),
                   0)

    def one(t):
        if t.shape.rank is None or t.shape.rank == 0:
            raise ValueError(
                'every input, target and weight tensor needs a known rank '
                f'>= 1 (a leading batch dimension), got shape {t.shape}.')
        rows = t[start:stop]
        if unit == 1:
            return rows
        return tf.pad(rows, [[0, pad]] + [[0, 0]] * (t.shape.rank - 1))

    return tf.nest.map_structure(one, tensors)


def padded_to_chunks(tensors: Any, chunk: int) -> Any:
    """Each tensor of the nest [B, ...] zero-padded to a positive multiple
    of ``chunk`` rows (pad the weights with zeros too)."""
    rows = tf.shape(tf.nest.flatten(tensors)[0])[0]
    # An empty batch gets one chunk of padding: XLA compiles the slice.
    pad = tf.math.floormod(-rows, chunk) + chunk * tf.cast(
        tf.equal(rows, 0), tf.int32)
    return tf.nest.map_structure(
        lambda t: tf.pad(t, [[0, pad]] + [[0, 0]] * (t.shape.rank - 1)),
        tensors)


def fixed_chunk(tensors: Any, index: tf.Tensor, chunk: int) -> Any:
    """Rows [index * chunk, (index + 1) * chunk) of each tensor of the nest,
    a slice of static size (``padded_to_chunks``): XLA's dynamic slice."""
    def one(t):
        begin = tf.concat([[index * chunk],
                           tf.zeros([t.shape.rank - 1], tf.int32)], 0)
        return tf.slice(t, begin, [chunk] + [-1] * (t.shape.rank - 1))

    return tf.nest.map_structure(one, tensors)


def padding_unit(chunk: int) -> int:
    """The last chunk of a logical batch is padded to a multiple of this."""
    return max(1, chunk // 8)


def build(model: tf.keras.Model, x: Any) -> None:
    """Builds ``model`` on one all-zero example shaped like ``x``'s rows:
    variables cannot be created inside ``tf.vectorized_map``."""
    for t in tf.nest.flatten(x):
        if not t.shape[1:].is_fully_defined():
            raise ValueError(
                'Build the wrapped model before training (call it once or '
                f'give it an input shape); its input shape {t.shape} is not '
                'fully known.')
    model(tf.nest.map_structure(
        lambda t: tf.zeros([1] + t.shape[1:].as_list(), t.dtype), x),
        training=False)


# The per-example gradients of one physical batch, [P, d] floats, should stay
# in the last-level cache: DP throughput of the reference CNN (d = 79,530)
# fell 38 % from P = 64 (20 MB) to P = 256 (81 MB) when first measured, and
# 27 % on TensorFlow 2.21 after the one-pass clip-mask-sum (on 2.15 it rose
# 17 %), paired (`benchmarks/training_benchmark.py --compare-physical`).
_CACHE_BYTES = 32 * 2**20
# But chunks below 64 examples underuse the conv kernels: ResNet22
# (d = 291,898) trained 1.22-1.30x faster per CPU-second at P = 64 (75 MB)
# than at 16, the largest P in cache, and 1.16x / 1.04x at 32
# (`--model resnet22 --compare-physical`, TensorFlow 2.15 / 2.21). So P
# stays at 64 while [64, d] fit this budget.
_SMALLEST_FULL_CHUNK = 64
_MEMORY_BYTES = 128 * 2**20
# A GPU has no such cache to stay in, and small chunks leave it idle between
# kernel launches: on an NVIDIA H200 the reference CNN's twice-sampling step
# ran 2.08x (1.77-2.19x) faster at P = 256 than at 64, paired over six rounds
# (`--physical-batch-size 256 --compare-physical 64`, TensorFlow 2.21).
# There the chunk is bounded by memory alone: [P, d] within 1 GiB.
_GPU_MEMORY_BYTES = 2**30
_PHYSICAL_RANGE = (8, 256)
# A model of Dense layers writes little per example (its kernels' gradients
# stay factors): the ScatterNet linear model (d = 39,700; 3,989 floats)
# trained 1.03-1.07x (q2 = 1) and 1.13-1.23x (q2 = 0.5, l-infinity clip)
# faster at P = 256 than at 128, the [P, d] rule's, on two threads (about
# 0.95x on one), paired per-step timings (TensorFlow 2.21). On a CPU such a
# model's chunk may reach 512 rows: there its DP-SGD step took 1.08x its
# time at 256 rows and 1.06x at 1,024, twice sampling's 1.12x and 1.02x
# (`benchmarks/linear_model_benchmark.py --compare_physical 256 1024`, 2
# idle cores, TensorFlow 2.21, Keras 3, 2026-12-04). Not under hybrid
# clipping, which writes each example's gradient out for the projection:
# it took 1.14x at 512 its time at 256 (`--compare_physical 512`).
_FACTORED_DENSE_CPU_HIGH = 512


def _layers(model: Any):
    """Every layer of ``model``, nested models' included."""
    for layer in getattr(model, 'layers', ()):
        yield layer
        yield from _layers(layer)


def _factored_dense_floats(model: tf.keras.Model) -> Optional[int]:
    """Floats per example a chunk writes where every trainable variable
    belongs to a Dense layer on rank-2 inputs: such a kernel's per-example
    gradients stay factors, m + n floats for [m, n]
    (`mechanism.outer_products`), and nothing else per example is large.
    None for any other model, whose other layers' per-example gradients
    and intermediates the [P, d] rule was measured on (the reference CNN
    and ResNet22, above)."""
    floats, covered = 0, set()
    for layer in _layers(model):
        if not isinstance(layer, tf.keras.layers.Dense) or (
                not layer.trainable_weights):
            continue
        try:
            rank = len(layer.input.shape)
        except (AttributeError, ValueError, TypeError):
            return None
        if rank != 2:
            return None
        m, n = (int(k) for k in layer.kernel.shape)
        floats += m + n + (n if layer.use_bias else 0)
        covered.update(id(w) for w in layer.trainable_weights)
    if covered != {id(v) for v in model.trainable_variables}:
        return None
    return floats


def _largest_power_of_two_rows(budget_bytes: int, d: int) -> int:
    """The largest power of two P (at least 1) with 4 * P * d <= budget."""
    return 2**max(0, math.floor(math.log2(max(1, budget_bytes // (4 * d)))))


def default_physical_batch_size(
        model: tf.keras.Model,
        config: Optional[config_lib.TwiceSamplingConfig] = None,
        *, hybrid: bool = False) -> int:
    """The physical batch size DPModel uses when none is given.

    On a CPU, the largest power of two P in [8, 256] (in [8, 512] for a
    model of Dense layers without ``hybrid`` clipping) whose [P, d] float32
    per-example gradients fit in 32 MiB, but at least 64 where [64, d] fit
    in 128 MiB; where TensorFlow sees a GPU, the largest whose [P, d] fit in
    1 GiB (d: the model's trainable parameters; 64 for a model not built
    yet; for a model of Dense layers on rank-2 inputs, the floats of their
    gradients' factors, `_factored_dense_floats`). Never larger than the
    expected logical batch rounded up to a power of two (a larger chunk
    would never be filled). Speed and memory only: it never changes the
    released values' law.
    """
    low, high = _PHYSICAL_RANGE
    size = 64
    if model.built:
        factored = _factored_dense_floats(model)
        d = factored or max(1, sum(
            math.prod(v.shape) for v in model.trainable_variables))
        if vectorized_backprop.gpu_visible():
            size = _largest_power_of_two_rows(_GPU_MEMORY_BYTES, d)
        else:
            size = max(_largest_power_of_two_rows(_CACHE_BYTES, d),
                       min(_SMALLEST_FULL_CHUNK,
                           _largest_power_of_two_rows(_MEMORY_BYTES, d)))
            if factored and not hybrid:
                high = _FACTORED_DENSE_CPU_HIGH
    if config is not None:
        size = min(size, 2**math.ceil(math.log2(config.expected_batch_size)))
    return int(min(high, max(low, size)))
