"""Per-example conv kernel gradients: six constructions against the batch's.

A DP step needs each example's kernel gradient of every conv layer; a
non-private step needs only their sum (one ``Conv2DBackpropFilter``). On
ResNet22 this is where the DP step loses most of its time. This benchmark
times, on ResNet22's conv shapes (or the reference CNN's, ``--model
small_cnn``, with SAME padding here where the model has VALID), the summed
gradient (the non-private floor) and six ways to get the per-example
gradients:

  * ``tf_twice``: what ``tf_twice.keras.per_example.gradients`` runs,
    ``tf.vectorized_map`` with ``tf_twice.keras.vectorized_backprop``'s
    conversion (on a CPU whose kernel takes groups, the grouped
    convolution below for at most ``GROUPED_MAX_CHANNELS`` input channels;
    otherwise one batched matrix product per kernel tap);
  * ``taps``: the same conversion held to the taps (``GROUPED_MAX_CHANNELS``
    set to 0 while it is traced);
  * ``vectorized_map``: ``tf.vectorized_map`` as TensorFlow converts
    ``Conv2DBackpropFilter``, a ``while_loop`` over the examples (the "uses
    a while_loop" warning);
  * ``depthwise``: each example's gradient as one depthwise convolution of
    the input (channels and batch swapped) with the output gradient;
  * ``grouped``: one grouped convolution gradient whose groups are the
    examples (what ``tf_twice`` runs for few channels on such a CPU);
  * ``patches``: ``extract_patches`` then one ``einsum`` per batch.

Each construction is checked against ``vectorized_map`` first. Timings are
paired, in CPU time: every round times every construction once (rotated
order), and a ratio is the median over rounds of the ratio within a round.
Usage:

  python benchmarks/conv_per_example_benchmark.py [--batch-size 32]
      [--model resnet22|small_cnn]
"""

import argparse
import statistics
import time
from unittest import mock

import numpy as np
import tensorflow as tf

from tf_twice.keras import vectorized_backprop

import paired_rounds  # Beside this script.

# 3x3 convs: input side, channels in, channels out; stride 1. ResNet22's
# (tf_twice.models.resnet22; the stride-2 convs are one per stage) and the
# reference CNN's (tf_twice.models.small_cnn: 32x32x3 -> 16, then 15x15x16
# -> 32 after pooling).
SHAPES = {'resnet22': ((32, 3, 16), (32, 16, 16), (16, 32, 32), (8, 64, 64)),
          'small_cnn': ((32, 3, 16), (15, 16, 32))}
KERNEL = 3


def constructions(x: tf.Tensor, dy: tf.Tensor):
    """The summed gradient and the per-example constructions."""
    batch, _, _, channels = x.shape
    filters = dy.shape[-1]
    sizes = [KERNEL, KERNEL, channels, filters]

    def summed():
        return tf.raw_ops.Conv2DBackpropFilter(
            input=x, filter_sizes=sizes, out_backprop=dy,
            strides=[1, 1, 1, 1], padding='SAME')

    def one(pair):
        xi, dyi = pair
        return tf.raw_ops.Conv2DBackpropFilter(
            input=xi[None], filter_sizes=sizes, out_backprop=dyi[None],
            strides=[1, 1, 1, 1], padding='SAME')

    def vectorized_map():
        return tf.vectorized_map(one, (x, dy))

    def tf_twice():
        def converted(pair):
            with vectorized_backprop.faster_conversions():
                return one(pair)
        return tf.vectorized_map(converted, (x, dy))

    def taps():
        with mock.patch.object(vectorized_backprop, 'GROUPED_MAX_CHANNELS',
                               0):
            return tf_twice()

    def depthwise():
        pad = KERNEL // 2
        padded = tf.pad(x, [[0, 0], [pad, pad], [pad, pad], [0, 0]])
        # Channels as the batch, examples as the depthwise channels: output
        # [channels, k, k, batch * filters], one depthwise filter per example.
        out = tf.nn.depthwise_conv2d(
            tf.transpose(padded, [3, 1, 2, 0]), tf.transpose(dy, [1, 2, 0, 3]),
            [1, 1, 1, 1], 'VALID')
        out = tf.reshape(out, [channels, KERNEL, KERNEL, batch, filters])
        return tf.transpose(out, [3, 1, 2, 0, 4])

    def grouped():
        # Examples as groups of one convolution: input [1, h, w, batch *
        # channels], output gradient [1, h, w, batch * filters].
        def stack(t):
            return tf.reshape(tf.transpose(t, [1, 2, 0, 3]),
                              [1] + t.shape[1:3].as_list() + [-1])
        out = tf.raw_ops.Conv2DBackpropFilter(
            input=stack(x), filter_sizes=[KERNEL, KERNEL, channels,
                                          batch * filters],
            out_backprop=stack(dy), strides=[1, 1, 1, 1], padding='SAME')
        out = tf.reshape(out, [KERNEL, KERNEL, channels, batch, filters])
        return tf.transpose(out, [3, 0, 1, 2, 4])

    def patches():
        p = tf.image.extract_patches(x, [1, KERNEL, KERNEL, 1], [1, 1, 1, 1],
                                     [1, 1, 1, 1], 'SAME')
        return tf.reshape(tf.einsum('bhwp,bhwk->bpk', p, dy),
                          [batch] + sizes)

    return {name: tf.function(fn) for name, fn in (
        ('summed', summed), ('tf_twice', tf_twice), ('taps', taps),
        ('vectorized_map', vectorized_map), ('depthwise', depthwise),
        ('grouped', grouped), ('patches', patches))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--batch-size', type=int, default=32)
    parser.add_argument('--rounds', type=int, default=9)
    parser.add_argument('--calls', type=int, default=10)
    parser.add_argument('--model', choices=sorted(SHAPES),
                        default='resnet22')
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f'{args.model}, batch {args.batch_size}; CPU seconds per call '
          'relative to the summed gradient (paired, median of rounds)')
    print('| input | summed CPU ms | tf_twice | taps | vectorized_map | '
          'depthwise | grouped | patches |')
    print('|---|---:|---:|---:|---:|---:|---:|---:|')
    for side, channels, filters in SHAPES[args.model]:
        x = tf.constant(rng.normal(size=(args.batch_size, side, side,
                                         channels)), tf.float32)
        dy = tf.constant(rng.normal(size=(args.batch_size, side, side,
                                          filters)), tf.float32)
        fns = constructions(x, dy)
        reference = fns['vectorized_map']().numpy()
        np.testing.assert_allclose(reference.sum(0), fns['summed']().numpy(),
                                   rtol=1e-3, atol=1e-2)
        for name in ('tf_twice', 'taps', 'depthwise', 'grouped', 'patches'):
            np.testing.assert_allclose(fns[name]().numpy(), reference,
                                       rtol=1e-3, atol=1e-2, err_msg=name)
        seconds = paired_rounds.time_rounds(
            fns, rounds=args.rounds, calls=args.calls, clock=time.process_time)
        ratios = ' | '.join(
            f'{paired_rounds.median_ratio(seconds, name, "summed"):.2f}x'
            for name in list(fns)[1:])  # The header's columns, in order.
        print(f'| {side}x{side}x{channels} -> {filters} | '
              f'{statistics.median(seconds["summed"]) * 1e3:.2f} | {ratios} |')


if __name__ == '__main__':
    main()
