"""The tf.data pipelines of Poisson-sampled logical batches.

``poisson_batches`` samples in-memory arrays; ``poisson_batches_from_dataset``
reads a finite tf.data source into memory once and samples that. Every
element is one logical batch (one DP step) whose examples are those that
``indices.sample_indices`` draws for its step index; each new iterator
continues with fresh step indices. The dataset carries a
``markers.PoissonSamplingInfo``.
"""

from __future__ import annotations

import secrets
from typing import Any, Callable, Optional, Tuple

import numpy as np
import tensorflow as tf

from tf_twice import _keras  # noqa: F401  pylint: disable=unused-import
from tf_twice import _validate
from tf_twice.sampling import indices as indices_lib
from tf_twice.sampling.markers import MARKER_ATTR
from tf_twice.sampling.markers import PoissonSamplingInfo
from tf_twice.sampling.schedule import poisson_schedule

__all__ = [
    'DEFAULT_MAX_BYTES',
    'poisson_batches',
    'poisson_batches_from_dataset',
]

# Host memory a tf.data source may be materialised into by default.
DEFAULT_MAX_BYTES = 4 * 2**30
# Step-index stride between iterations of an infinite dataset.
_INFINITE_STRIDE = 2**40


def _num_examples_of(x, y) -> int:
    leading = set()
    for t in tf.nest.flatten((x, y)):
        if t.shape.rank is None or t.shape.rank == 0:
            raise ValueError('x and y must be arrays with a leading example '
                             f'dimension; got shape {t.shape}.')
        leading.add(int(t.shape[0]))
    if len(leading) != 1:
        raise ValueError('x and y must have the same number of examples '
                         f'(leading dimension); got {sorted(leading)}.')
    return leading.pop()


def _pad(t: tf.Tensor, pad: tf.Tensor) -> tf.Tensor:
    zeros = tf.zeros(tf.concat([tf.reshape(pad, [1]),
                                tf.shape(t, out_type=tf.int64)[1:]], 0),
                     dtype=t.dtype)
    return tf.concat([t, zeros], axis=0)


def _per_example(preprocess_fn, xb, yb):
    """``preprocess_fn`` on each example alone (a batch of one), so that it
    cannot mix examples (batch statistics, mixup): every output row is a
    function of its own example only, as per-example sensitivity needs."""

    @tf.autograph.experimental.do_not_convert
    def one(example):
        xi, yi = tf.nest.map_structure(lambda t: t[None], example)
        xo, yo = preprocess_fn(xi, yi)
        return tf.nest.map_structure(lambda t: tf.convert_to_tensor(t)[0],
                                     (xo, yo))

    return tf.vectorized_map(one, (xb, yb))


def poisson_batches(
        x: Any,
        y: Any,
        *,
        physical_batch_size: Optional[int] = None,
        example_sampling_rate: Optional[float] = None,
        expected_batch_size: Optional[float] = None,
        steps: Optional[int] = None,
        repeat: bool = False,
        seed: Optional[int] = None,
        start_step: int = 0,
        preprocess_fn: Optional[Callable[[Any, Any], Tuple[Any, Any]]] = None,
) -> tf.data.Dataset:
    """A dataset of Poisson-sampled logical batches from in-memory arrays.

    Guarantee: the examples of every element are a Poisson sample of the n
    examples with rate q1 (each included independently with probability q1),
    independent across elements, as `TwiceSampledGaussianDpEvent` and
    dp_accounting's `PoissonSampledDpEvent` assume. An element is one DP step;
    empty batches are emitted.

    Args:
      x: the inputs, an array or a nest of arrays with leading dimension n.
      y: the targets, likewise.
      physical_batch_size: None (default): batches keep their size k, which
        `DPModel` needs (it computes no padding rows). An int >= 1 pads each
        logical batch with zero rows (weight 0) to a multiple of it, for
        code that needs fixed shapes; padding rows cost compute.
      example_sampling_rate: q1 in (0, 1]; or
      expected_batch_size: n * q1 in (0, n] (exactly one of the two).
      steps: logical batches per iteration, >= 1. Default: one epoch,
        round(1 / q1). Each new iterator continues with fresh steps, so
        `fit(ds, epochs=E)` trains E * steps distinct Poisson steps.
      repeat: if True the dataset is infinite (`steps` must be None); pass
        `steps_per_epoch` to `fit`.
      seed: in [0, 2**63). None draws one from the OS (recorded in
        `get_poisson_sampling_info(ds).seed`). Do not reuse a seed for a
        resumed run (see the module docstring).
      start_step: step index of the first element (>= 0).
      preprocess_fn: optional `(x_batch, y_batch) -> (x_batch, y_batch)`
        for per-example preprocessing (normalisation by constants,
        augmentation) of the sampled examples before padding. It is run on
        each example alone, as a batch of one (under `tf.vectorized_map`),
        so it cannot mix examples: batch statistics are those of the one
        example.

    Returns:
      A `tf.data.Dataset` of `(x, y, sample_weight)`, leading dimension k
      (or k padded to a multiple of `physical_batch_size`), `sample_weight`
      float32. It carries
      a `PoissonSamplingInfo` marker (`get_poisson_sampling_info`).

    Raises:
      ValueError: for an argument outside its range.
    """
    x = tf.nest.map_structure(tf.convert_to_tensor, x)
    y = tf.nest.map_structure(tf.convert_to_tensor, y)
    n = _num_examples_of(x, y)
    if n < 1:
        raise ValueError('x and y must hold at least one example '
                         '(num_examples >= 1); got 0.')
    return _build(x, y, n, physical_batch_size=physical_batch_size,
                  example_sampling_rate=example_sampling_rate,
                  expected_batch_size=expected_batch_size, steps=steps,
                  repeat=repeat, seed=seed, start_step=start_step,
                  preprocess_fn=preprocess_fn)


def _build(x, y, n: int, *, physical_batch_size, example_sampling_rate,
           expected_batch_size, steps, repeat, seed, start_step,
           preprocess_fn) -> tf.data.Dataset:
    schedule = poisson_schedule(n, example_sampling_rate=example_sampling_rate,
                                expected_batch_size=expected_batch_size)
    q1 = schedule.example_sampling_rate
    p = (1 if physical_batch_size is None else
         _validate.integer('physical_batch_size', physical_batch_size, 1))
    if not isinstance(repeat, bool):
        raise ValueError(f'repeat must be True or False; got {repeat!r}.')
    if repeat and steps is not None:
        raise ValueError('steps must be None when repeat=True (the dataset '
                         f'is infinite); got steps={steps!r}.')
    if not repeat:
        steps = (schedule.steps_per_epoch if steps is None
                 else _validate.integer('steps', steps, 1))
    if seed is None:
        seed = secrets.randbelow(indices_lib.MAX_SEED)
    seed = _validate.integer('seed', seed, 0, indices_lib.MAX_SEED - 1)
    start_step = _validate.integer('start_step', start_step, 0)
    if preprocess_fn is not None and not callable(preprocess_fn):
        raise ValueError('preprocess_fn must be None or a callable '
                         f'(x_batch, y_batch) -> (x_batch, y_batch); got '
                         f'{preprocess_fn!r}.')
    base_key = indices_lib.base_key(seed)

    # Each new iterator takes the next iteration index, so re-iterating never
    # replays step indices (and hence never replays a sample).
    with tf.init_scope():
        iterations = tf.Variable(0, dtype=tf.int64, trainable=False,
                                 name='poisson_iterations')
    stride = _INFINITE_STRIDE if repeat else steps

    @tf.autograph.experimental.do_not_convert
    def next_iteration(unused):
        return iterations.assign_add(1) - 1

    @tf.autograph.experimental.do_not_convert
    def step_indices(iteration):
        ds = (tf.data.Dataset.counter(0, dtype=tf.int64) if repeat else
              tf.data.Dataset.range(steps, output_type=tf.int64))
        offset = start_step + iteration * stride

        @tf.autograph.experimental.do_not_convert
        def shift(i):
            return offset + i

        return ds.map(shift)

    @tf.autograph.experimental.do_not_convert
    def logical_batch(step):
        indices = indices_lib.sample_indices(
            n, q1, indices_lib.fold_in(base_key, step))
        k = tf.size(indices, out_type=tf.int64)
        xb = tf.nest.map_structure(lambda t: tf.gather(t, indices), x)
        yb = tf.nest.map_structure(lambda t: tf.gather(t, indices), y)
        if preprocess_fn is not None:
            xb, yb = _per_example(preprocess_fn, xb, yb)
        weights = tf.ones([k], tf.float32)
        if p > 1:  # Only on request: padding rows cost compute.
            pad = tf.math.floormod(-k, p)  # Empty batches stay empty.
            xb = tf.nest.map_structure(lambda t: _pad(t, pad), xb)
            yb = tf.nest.map_structure(lambda t: _pad(t, pad), yb)
            weights = _pad(weights, pad)
        return xb, yb, weights

    ds = tf.data.Dataset.from_tensors(tf.constant(0, tf.int64))
    ds = ds.map(next_iteration).flat_map(step_indices)
    ds = ds.apply(tf.data.experimental.assert_cardinality(
        tf.data.INFINITE_CARDINALITY if repeat else steps))
    ds = ds.map(logical_batch, num_parallel_calls=tf.data.AUTOTUNE,
                deterministic=True)
    ds = ds.prefetch(tf.data.AUTOTUNE)
    info = PoissonSamplingInfo(
        num_examples=n, example_sampling_rate=q1,
        expected_batch_size=schedule.expected_batch_size,
        physical_batch_size=None if p == 1 else p,
        steps=None if repeat else steps,
        steps_per_epoch=schedule.steps_per_epoch, seed=seed,
        start_step=start_step)
    setattr(ds, MARKER_ATTR, info)
    # Keep the counter alive as long as the dataset object.
    setattr(ds, '_tf_twice_iterations', iterations)
    return ds


def _spec_bytes(spec: tf.TensorSpec) -> Optional[int]:
    if spec.dtype == tf.string or not spec.shape.is_fully_defined():
        return None
    return int(np.prod(spec.shape.as_list(), dtype=np.int64)) * spec.dtype.size


def poisson_batches_from_dataset(
        source: tf.data.Dataset,
        *,
        physical_batch_size: Optional[int] = None,
        example_sampling_rate: Optional[float] = None,
        expected_batch_size: Optional[float] = None,
        steps: Optional[int] = None,
        repeat: bool = False,
        seed: Optional[int] = None,
        start_step: int = 0,
        preprocess_fn: Optional[Callable[[Any, Any], Tuple[Any, Any]]] = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
) -> tf.data.Dataset:
    """`poisson_batches` from a finite tf.data/tfds source of `(x, y)` pairs.

    Poisson sampling needs random access to all n examples at every step; a
    stream can only be read in order (one full pass per step would cost O(n)
    reads). So the source is read once into in-memory tensors and sampled
    from there, which is fine for datasets up to a few GB (CIFAR-10 as uint8
    is 150 MB). A source that would need more than `max_bytes` is refused
    with a ValueError before (or, for unknown sizes, while) reading it;
    raise `max_bytes` if the host has the memory.

    Args:
      source: a finite `tf.data.Dataset` whose elements are `(x, y)` pairs of
        fixed-shape tensors (e.g. `tfds.load(..., as_supervised=True)`; map
        dict elements to pairs and resize variable-size images first).
      physical_batch_size, example_sampling_rate, expected_batch_size, steps,
      repeat, seed, start_step, preprocess_fn: as in `poisson_batches`.
      max_bytes: >= 1, the most host memory the examples may take.

    Returns:
      As `poisson_batches`.

    Raises:
      ValueError: the source is infinite, not made of `(x, y)` pairs with
        fixed shapes, empty, or larger than `max_bytes`; or an argument is
        outside its range.
    """
    if not isinstance(source, tf.data.Dataset):
        raise ValueError('source must be a tf.data.Dataset of (x, y) pairs; '
                         f'got {type(source).__name__}.')
    max_bytes = _validate.integer('max_bytes', max_bytes, 1)
    spec = source.element_spec
    if not (isinstance(spec, tuple) and len(spec) == 2):
        raise ValueError('source elements must be (x, y) pairs (e.g. tfds '
                         "as_supervised=True, or map(lambda d: (d['image'], "
                         f"d['label']))); got element_spec {spec}.")
    flat_spec = tf.nest.flatten(spec)
    for s in flat_spec:
        if not isinstance(s, tf.TensorSpec) or not s.shape.is_fully_defined():
            raise ValueError('source examples must be dense tensors of fixed '
                             f'shape (resize or pad them first); got {s}.')
    cardinality = int(source.cardinality())
    if cardinality == tf.data.INFINITE_CARDINALITY:
        raise ValueError('source must be finite (Poisson sampling needs the '
                         'dataset size n); got an infinite dataset (drop '
                         '.repeat()).')
    sizes = [_spec_bytes(s) for s in flat_spec]
    per_example = None if None in sizes else sum(sizes)
    if cardinality >= 0 and per_example is not None and (
            cardinality * per_example > max_bytes):
        raise ValueError(
            f'source needs {cardinality * per_example} bytes in memory '
            f'({cardinality} examples), more than max_bytes={max_bytes}. '
            'Poisson sampling needs random access to every example; raise '
            'max_bytes if the host has the memory.')

    chunks = [[] for _ in flat_spec]
    total = 0
    for batch in source.batch(4096).as_numpy_iterator():
        for store, part in zip(chunks, tf.nest.flatten(batch)):
            store.append(part)
            total += part.nbytes
        if total > max_bytes:
            raise ValueError(
                f'source needs more than max_bytes={max_bytes} bytes in '
                'memory. Poisson sampling needs random access to every '
                'example; raise max_bytes if the host has the memory.')
    if not chunks[0]:
        raise ValueError('source must hold at least one example '
                         '(num_examples >= 1); it is empty.')
    arrays = [np.concatenate(store, axis=0) for store in chunks]
    x, y = tf.nest.pack_sequence_as(spec, arrays)
    return poisson_batches(
        x, y, physical_batch_size=physical_batch_size,
        example_sampling_rate=example_sampling_rate,
        expected_batch_size=expected_batch_size, steps=steps, repeat=repeat,
        seed=seed, start_step=start_step, preprocess_fn=preprocess_fn)
