"""One logical batch to its private update: the loop of ``DPModel.train_step``.

Input contract: a logical batch ``(x, y)`` with per-example ``weights`` in
[0, 1] (1 real, 0 padding) whose size may change between steps, 0 included
(an empty logical batch is a valid DP step whose update is pure noise).
``private_update`` cuts it into physical microbatches of
``physical_batch_size`` rows, the last one zero-padded to a multiple of
``max(1, physical_batch_size // 8)`` rows of weight 0 (at most 8 chunk
shapes; ``per_example.chunk_of``), runs them in a ``tf.while_loop`` that
takes each chunk's per-example gradients (``per_example.gradients``) and
accumulates their clipped masked sums (``PrivateAggregator.accumulate``),
and adds noise once (``PrivateAggregator.finish``). ``DPModel`` reads the
batch, applies the update with the compiled optimizer and keeps the
metrics.
"""

from typing import Any, Callable, List, Sequence

import tensorflow as tf

from tf_twice.keras import per_example
from tf_twice.mechanism import aggregator as aggregator_lib
from tf_twice.mechanism import precision

__all__ = ['private_update']


def private_update(aggregator: aggregator_lib.PrivateAggregator,
                   model: tf.keras.Model, example_loss: Any, x: Any,
                   y: tf.Tensor, weights: tf.Tensor, size: tf.Tensor,
                   variables: Sequence[tf.Variable], *,
                   physical_batch_size: int, step: tf.Tensor,
                   on_chunk: Callable[..., None]) -> List[tf.Tensor]:
    """The noisy update of one logical batch, one tensor per variable.

    Args:
      aggregator: the ``PrivateAggregator`` that runs the mechanism.
      model: the built Keras model whose per-example gradients are taken.
      example_loss: the per-example loss (``per_example.loss_fn``).
      x, y: the logical batch, ``size`` rows on this replica.
      weights: [size] per-example weights.
      size: the rows of the batch on this replica.
      variables: the trainable variables of ``model``.
      physical_batch_size: rows per chunk.
      step: the DP steps the weights hold (positions a seeded key stream).
      on_chunk: called with ``(y, predictions, losses, weights)`` of every
        chunk, for the metrics.
    """
    chunk = physical_batch_size
    key = aggregator.begin(variables, step)
    # Masks are keyed by an example's position in the whole logical
    # batch, also when replicas share it.
    first_row = aggregator_lib.global_offset(size)
    if precision.in_xla_context():
        # XLA needs every chunk's shape at compile time: the batch is padded
        # once to whole chunks (rows of weight 0; XLA compiles per batch
        # size, and the amount is a constant of it), then cut in equal ones.
        x, y, weights = per_example.padded_to_chunks((x, y, weights), chunk)
        size = tf.shape(weights)[0]

        def chunk_of(i):
            return per_example.fixed_chunk((x, y, weights), i, chunk)
    else:
        def chunk_of(i):
            return per_example.chunk_of((x, y, weights), i, chunk, size)
    num_chunks = (size + chunk - 1) // chunk

    def body(i, sums):
        xc, yc, wc = chunk_of(i)
        grads, losses, predictions = per_example.gradients(
            model, example_loss, xc, yc)
        sums = aggregator.accumulate(
            sums, grads, variables, weights=wc, key=key,
            example_offset=first_row + i * chunk)
        on_chunk(yc, predictions, losses, wc)
        return i + 1, sums

    _, sums = tf.while_loop(
        lambda i, _: i < num_chunks, body,
        (tf.constant(0), aggregator.zero_sums(variables)),
        parallel_iterations=1)
    return aggregator.finish(sums, key, variables)
