"""Which examples join logical batch ``step``: the sampling random stream.

Step g of stream ``seed`` draws its examples from a stateless key,
fold_in([seed, _DOMAIN_TAG], g): the batch size k ~ Binomial(n, q1) from
fold_in(key, 0), then a uniformly random k-subset (``_uniform_subset``)
from fold_in(key, 1). That is the distribution of n independent coin flips
of probability q1, at O(k) cost instead of O(n). The layout of this stream
(the domain tag, the fold-in order) fixes which examples every seeded run
trains on: changing it changes every sample.

``sample_logical_batch_indices`` reads one step's examples on the host, as
``pipelines.poisson_batches`` draws them inside tf.data.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tf_twice import _keras  # noqa: F401  pylint: disable=unused-import
from tf_twice import _validate
from tf_twice.sampling.schedule import resolve_rate

__all__ = ['sample_logical_batch_indices']

# Domain separation: the sampling stream for (seed, step) differs from any
# other stateless stream (e.g. the noise) that happens to use the same seed.
_DOMAIN_TAG = 0x5477695053616D70  # 'TwiPSamp'
MAX_SEED = 2**63


def base_key(seed: int) -> tf.Tensor:
    return tf.constant([seed, _DOMAIN_TAG], dtype=tf.int64)


def fold_in(key: tf.Tensor, data) -> tf.Tensor:
    return tf.random.experimental.stateless_fold_in(
        key, tf.cast(data, tf.int64))


def _uniform_subset(n: int, k: tf.Tensor, key: tf.Tensor) -> tf.Tensor:
    """A uniformly random k-subset of range(n) in O(min(k, n - k)) expected.

    Draws indices with replacement and keeps the first m distinct ones,
    m = min(k, n - k). The procedure commutes with every relabelling of
    range(n), so the resulting m-subset is uniform (the symmetric group acts
    transitively on m-subsets); for k > n / 2 the m-subset is the excluded
    set, whose complement is then a uniform k-subset. Since m <= n / 2, the
    expected number of draws is below 2m.
    """
    m = tf.minimum(k, n - k)

    def cond(unused_round, chosen):
        return tf.size(chosen, out_type=tf.int64) < m

    def body(round_index, chosen):
        need = m - tf.size(chosen, out_type=tf.int64)
        draws = tf.random.stateless_uniform(
            tf.reshape(need, [1]), seed=fold_in(key, round_index),
            minval=0, maxval=n, dtype=tf.int64)
        # tf.unique keeps first occurrences in order: `chosen` stays a prefix.
        merged, _ = tf.unique(tf.concat([chosen, draws], axis=0))
        return round_index + 1, merged

    _, chosen = tf.while_loop(
        cond, body, (tf.constant(0, tf.int64), tf.zeros([0], tf.int64)),
        shape_invariants=(tf.TensorShape([]), tf.TensorShape([None])))

    def complement():
        excluded = tf.scatter_nd(chosen[:, None],
                                 tf.ones_like(chosen, dtype=tf.int32), [n])
        return tf.where(tf.equal(excluded, 0))[:, 0]

    return tf.cond(k > n - k, complement, lambda: chosen)


def sample_indices(n: int, q1: float, key: tf.Tensor) -> tf.Tensor:
    """Poisson sample of range(n) for one step; `key` is the step's key."""
    if q1 >= 1.0:
        return tf.range(n, dtype=tf.int64)
    k = tf.random.stateless_binomial(
        [], seed=fold_in(key, 0), counts=tf.constant(float(n), tf.float64),
        probs=tf.constant(q1, tf.float64), output_dtype=tf.int64)
    return _uniform_subset(n, k, fold_in(key, 1))


def sample_logical_batch_indices(num_examples: int, *,
                                 example_sampling_rate: float, seed: int,
                                 step: int) -> np.ndarray:
    """Indices of the examples in logical batch `step` of stream `seed`.

    These are exactly the examples that `poisson_batches(...,
    example_sampling_rate=q1, seed=seed)` puts in its batch with step index
    `step` (real examples, before padding). Each example is included with
    probability q1, independently of the others and of other steps.

    Raises:
      ValueError: for an argument outside its range.
    """
    n = _validate.integer('num_examples', num_examples, 1)
    q1 = resolve_rate(n, example_sampling_rate, None)
    seed = _validate.integer('seed', seed, 0, MAX_SEED - 1)
    step = _validate.integer('step', step, 0)
    key = fold_in(base_key(seed), step)
    return sample_indices(n, q1, key).numpy()

