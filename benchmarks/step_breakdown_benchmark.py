"""Where one chunk of a DP step goes, against the non-private backward pass.

For one physical chunk of P examples of the benchmarked model (the reference
CNN, or ResNet22 with ``--model resnet22``; random data, CPU), times:

  * ``summed gradient``: one batched backward pass of the chunk's summed
    loss, what non-private training computes;
  * ``per-example (tf_twice)``: ``tf_twice.keras.per_example.gradients``,
    what every DP path runs, with ``vectorized_backprop``'s conversions,
    every gradient written out;
  * ``per-example (TensorFlow)``: the same per-example pass as TensorFlow
    converts it alone (conv kernel gradients in a while_loop);
  * ``DP chunk q2=1``: the per-example gradients and their
    ``clipped_masked_sum`` in one function, as the DP step runs them
    (a dense kernel's gradients are then read from their factors and never
    written out, ``tf_twice.mechanism.outer_products``), standard DP-SGD;
  * ``DP chunk q2=0.5 linf=0.1``: the same with twice sampling and an
    l-infinity clip (its excess over ``DP chunk q2=1`` is the
    twice-sampling overhead);
  * ``the same without columns``: that chunk with the conv kernel
    gradients built without ``vectorized_backprop``'s columns (by the
    grouped convolution or the taps instead).

Timings are paired: every round times every part once (rotated order) in
CPU time, and a ratio is the median over rounds of the ratio to the summed
gradient within a round. Usage:

  python benchmarks/step_breakdown_benchmark.py [--model resnet22]
      [--physical-batch-size 64] [--rounds 9]
"""

import argparse
from unittest import mock

import numpy as np
import tensorflow as tf

from tf_twice import models
from tf_twice.keras import default_physical_batch_size
from tf_twice.keras import per_example
from tf_twice.keras import vectorized_backprop
from tf_twice.mechanism import aggregation
from tf_twice.mechanism import randomness

import paired_rounds  # Beside this script.

L2_CLIP, LINF_CLIP = 1.0, 0.1


def parts(model: tf.keras.Model, x: tf.Tensor, y: tf.Tensor):
    """The timed parts, each a traced function of no argument."""
    loss = per_example.loss_fn(
        tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    def summed():
        with tf.GradientTape() as tape:
            total = tf.reduce_sum(loss(y, model(x, training=True)))
        return tape.gradient(total, model.trainable_variables)

    def per_example_gradients():
        return per_example.gradients(model, loss, x, y).gradients

    with mock.patch.dict(vectorized_backprop.CONVERTERS, clear=True):
        tensorflow_only = tf.function(per_example_gradients)
        tensorflow_only.get_concrete_function()  # Traced without them.
    with_conversions = tf.function(per_example_gradients)
    key = randomness.draw_step_key(tf.random.Generator.from_seed(0))

    def dp_chunk(twice):
        return lambda: aggregation.clipped_masked_sum(
            per_example_gradients(), l2_norm_clip=L2_CLIP,
            linf_norm_clip=LINF_CLIP if twice else None,
            coordinate_sampling_rate=0.5 if twice else 1.0, key=key)

    without_columns = tf.function(dp_chunk(True))
    with mock.patch.multiple(vectorized_backprop,
                             **vectorized_backprop.WITHOUT_COLUMNS):
        without_columns.get_concrete_function()  # Traced without them.
    return {'summed gradient': tf.function(summed),
            'per-example (tf_twice)': with_conversions,
            'per-example (TensorFlow)': tensorflow_only,
            'DP chunk q2=1': tf.function(dp_chunk(False)),
            'DP chunk q2=0.5 linf=0.1': tf.function(dp_chunk(True)),
            'the same without columns': without_columns}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--model', choices=['small_cnn', 'resnet22'],
                        default='small_cnn')
    parser.add_argument('--physical-batch-size', type=int, default=None,
                        help='P (default: default_physical_batch_size)')
    parser.add_argument('--rounds', type=int, default=9)
    parser.add_argument('--calls', type=int, default=5)
    args = parser.parse_args()
    model = models.build_model(args.model, input_shape=(32, 32, 3),
                               num_classes=10)
    size = args.physical_batch_size or default_physical_batch_size(model)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(size, 32, 32, 3)), tf.float32)
    y = tf.constant(rng.integers(0, 10, size), tf.int32)
    fns = parts(model, x, y)
    fast, stock = fns['per-example (tf_twice)'](), fns[
        'per-example (TensorFlow)']()
    for a, b in zip(fast, stock):  # The same gradients, both ways.
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4,
                                   atol=1e-5)
    paired_rounds.print_against_baseline(
        fns, baseline='summed gradient', rounds=args.rounds, calls=args.calls,
        heading=(f'{args.model}, {model.count_params()} parameters, chunk of '
                 f'{size} examples, TensorFlow {tf.__version__}; CPU ms per '
                 'call and ratio to the summed gradient (paired, median of '
                 f'{args.rounds} rounds)'))


if __name__ == '__main__':
    main()
