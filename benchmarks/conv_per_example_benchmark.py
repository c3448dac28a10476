"""Per-example conv kernel gradients: seven constructions against the batch's.

A DP step needs each example's kernel gradient of every conv layer; a
non-private step needs only their sum (one ``Conv2DBackpropFilter``). On
ResNet22 this is where the DP step loses most of its time. This benchmark
times, on the conv shapes of ResNet22 (its 3x3 convs of stride 1 and the
stride-2 conv that enters its second stage), of the reference CNN
(``--model small_cnn``) or of wider nets (``--model wide``), the summed
gradient (the non-private floor) and seven ways to get the per-example
gradients:

  * ``tf_twice``: what ``tf_twice.keras.per_example.gradients`` runs,
    ``tf.vectorized_map`` with ``tf_twice.keras.vectorized_backprop``'s
    conversion, which picks one of the three below by the conv's shape;
  * ``columns``, ``grouped``, ``taps``: that conversion held to one of its
    constructions while it is traced: each example's input gathered into
    its columns times its output gradient in one matrix product; one
    grouped convolution whose groups are the examples; one matrix product
    per kernel tap;
  * ``vectorized_map``: ``tf.vectorized_map`` as TensorFlow converts
    ``Conv2DBackpropFilter``, a ``while_loop`` over the examples (the "uses
    a while_loop" warning);
  * ``depthwise``: each example's gradient as one depthwise convolution of
    the input (channels and batch swapped) with the output gradient (3x3
    SAME convs of stride 1 only);
  * ``patches``: ``extract_patches`` then one ``einsum`` per batch (3x3
    SAME convs of stride 1 only);

and ``product alone``, a floor for the constructions that end in matrix
products: the columns' matrix product given columns made beforehand. It
does the summed gradient's multiplications and writes the examples'
gradients, nothing more.

Each construction is checked against ``vectorized_map`` first. Timings are
paired, in CPU time: every round times every construction once (rotated
order), and a ratio is the median over rounds of the ratio within a round.
Usage:

  python benchmarks/conv_per_example_benchmark.py [--batch-size 32]
      [--model resnet22|small_cnn|wide]
"""

import argparse
import statistics
import time
from unittest import mock

import numpy as np
import tensorflow as tf

from tf_twice.keras import vectorized_backprop

import paired_rounds  # Beside this script.

# Input side, channels in, channels out, kernel side, stride, padding:
# ResNet22's convs (tf_twice.models.resnet22), the reference CNN's
# (tf_twice.models.small_cnn: 32x32x3 -> 16, then 15x15x16 -> 32 after
# pooling) and, for wider nets, the 3x3 convs of stages of 64 to 256
# channels at sides 16 to 4 (as in a wide ResNet on 32x32 images).
SHAPES = {'resnet22': ((32, 3, 16, 3, 1, 'SAME'), (32, 16, 16, 3, 1, 'SAME'),
                       (32, 16, 32, 3, 2, 'SAME'), (16, 32, 32, 3, 1, 'SAME'),
                       (8, 64, 64, 3, 1, 'SAME')),
          'small_cnn': ((32, 3, 16, 3, 1, 'VALID'),
                        (15, 16, 32, 3, 1, 'VALID')),
          'wide': ((16, 64, 64, 3, 1, 'SAME'), (8, 128, 128, 3, 1, 'SAME'),
                   (4, 256, 256, 3, 1, 'SAME'))}

# The converter's limits that hold it to one construction.
ONLY = {'columns': dict(COLUMNS_MAX_POSITIONS=10**9),
        'grouped': dict(vectorized_backprop.WITHOUT_COLUMNS,
                        GROUPED_MAX_CHANNELS=10**9),
        'taps': dict(vectorized_backprop.WITHOUT_COLUMNS,
                     GROUPED_MAX_CHANNELS=0)}


def constructions(x: tf.Tensor, dy: tf.Tensor, kernel: int, stride: int,
                  padding: str):
    """The summed gradient and the per-example constructions."""
    batch, _, _, channels = x.shape
    _, out_h, out_w, filters = dy.shape
    sizes = [kernel, kernel, channels, filters]
    options = dict(filter_sizes=sizes, strides=[1, stride, stride, 1],
                   padding=padding)

    def summed():
        return tf.raw_ops.Conv2DBackpropFilter(input=x, out_backprop=dy,
                                               **options)

    def one(pair):
        xi, dyi = pair
        return tf.raw_ops.Conv2DBackpropFilter(input=xi[None],
                                               out_backprop=dyi[None],
                                               **options)

    def vectorized_map():
        return tf.vectorized_map(one, (x, dy))

    def tf_twice():
        def converted(pair):
            with vectorized_backprop.faster_conversions():
                return one(pair)
        return tf.vectorized_map(converted, (x, dy))

    def only(name):
        def construction():
            with mock.patch.multiple(vectorized_backprop, **ONLY[name]):
                return tf_twice()
        return construction

    def depthwise():
        pad = kernel // 2
        padded = tf.pad(x, [[0, 0], [pad, pad], [pad, pad], [0, 0]])
        # Channels as the batch, examples as the depthwise channels: output
        # [channels, k, k, batch * filters], one depthwise filter per example.
        out = tf.nn.depthwise_conv2d(
            tf.transpose(padded, [3, 1, 2, 0]), tf.transpose(dy, [1, 2, 0, 3]),
            [1, 1, 1, 1], 'VALID')
        out = tf.reshape(out, [channels, kernel, kernel, batch, filters])
        return tf.transpose(out, [3, 1, 2, 0, 4])

    def patches():
        p = tf.image.extract_patches(x, [1, kernel, kernel, 1], [1, 1, 1, 1],
                                     [1, 1, 1, 1], 'SAME')
        return tf.reshape(tf.einsum('bhwp,bhwk->bpk', p, dy),
                          [batch] + sizes)

    # Made once, outside the timed function; their values do not matter.
    columns = tf.random.normal([batch, out_h * out_w,
                                kernel * kernel * channels])
    output_gradient = tf.reshape(dy, [batch, -1, filters])

    def product_alone():
        return tf.matmul(columns, output_gradient, transpose_a=True)

    fns = [('summed', summed), ('tf_twice', tf_twice)]
    fns += [(name, only(name)) for name in ONLY]
    fns += [('vectorized_map', vectorized_map)]
    if (kernel, stride, padding) == (3, 1, 'SAME'):
        fns += [('depthwise', depthwise), ('patches', patches)]
    fns += [('product alone', product_alone)]
    return {name: tf.function(fn) for name, fn in fns}


COLUMNS = ('tf_twice', 'columns', 'grouped', 'taps', 'vectorized_map',
           'depthwise', 'patches', 'product alone')


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
    print('| conv | summed CPU ms | ' + ' | '.join(COLUMNS) + ' |')
    print('|---|---:|' + '---:|' * len(COLUMNS))
    for side, channels, filters, kernel, stride, padding in SHAPES[
            args.model]:
        out = (-(-side // stride) if padding == 'SAME'
               else (side - kernel) // stride + 1)
        x = tf.constant(rng.normal(size=(args.batch_size, side, side,
                                         channels)), tf.float32)
        dy = tf.constant(rng.normal(size=(args.batch_size, out, out,
                                          filters)), tf.float32)
        fns = constructions(x, dy, kernel, stride, padding)
        reference = fns['vectorized_map']().numpy()
        np.testing.assert_allclose(reference.sum(0), fns['summed']().numpy(),
                                   rtol=1e-3, atol=1e-2)
        for name in set(fns) - {'summed', 'vectorized_map', 'product alone'}:
            np.testing.assert_allclose(fns[name]().numpy(), reference,
                                       rtol=1e-3, atol=1e-2, err_msg=name)
        seconds = paired_rounds.time_rounds(
            fns, rounds=args.rounds, calls=args.calls, clock=time.process_time)
        ratios = ' | '.join(
            f'{paired_rounds.median_ratio(seconds, name, "summed"):.2f}x'
            if name in fns else 'n/a' for name in COLUMNS)
        print(f'| {side}x{side}x{channels} -> {filters}, {kernel}x{kernel} '
              f'stride {stride} {padding} | '
              f'{statistics.median(seconds["summed"]) * 1e3:.2f} | {ratios} |')


if __name__ == '__main__':
    main()
