"""Would a per-example path with the examples in the channels pay off?

The grouped construction of per-example conv kernel gradients
(``tf_twice.keras.vectorized_backprop``) needs each conv's input and output
gradient with the examples moved into the channels, [e, h, w, c] ->
[1, h, w, e * c], and the reference CNN's DP step spends several CPU-ms per
step in those transposes. A path that kept the examples in the channels from
the first conv on would not transpose, but it would run every conv of the
per-example pass as a grouped convolution (the kernel repeated once per
example, groups = examples) instead of one batched convolution, in the
forward pass and in the gradient to the conv's input. This benchmark times
those pieces on the reference CNN's two convs (3x3 VALID, 32x32x3 -> 16 and
15x15x16 -> 32, ``tf_twice.models.small_cnn``), per chunk of examples:

  * ``forward``: conv, bias and ReLU, batched; ``forward grouped``: the same
    with the examples in the channels;
  * ``input gradient``: ``Conv2DBackpropInput``, batched and grouped (not
    needed for the first conv, whose input is the data);
  * ``transposes``: the two transposes that the grouped path would save.

Each grouped result is checked against the batched one first. CPU time,
paired rounds (``paired_rounds``). Usage:

  python benchmarks/examples_in_channels_benchmark.py [--batch-size 64]
"""

import argparse
import time

import numpy as np
import tensorflow as tf

import paired_rounds  # Beside this script.

# Side, channels in, channels out of the reference CNN's 3x3 VALID convs.
CONVS = ((32, 3, 16), (15, 16, 32))


def _into_channels(t: tf.Tensor) -> tf.Tensor:
    """[e, h, w, c] -> [1, h, w, e * c], example-major channels."""
    e, h, w, c = t.shape
    return tf.reshape(tf.transpose(t, [1, 2, 0, 3]), [1, h, w, e * c])


def _out_of_channels(t: tf.Tensor, examples: int) -> tf.Tensor:
    _, h, w, ec = t.shape
    return tf.transpose(tf.reshape(t, [h, w, examples, ec // examples]),
                        [2, 0, 1, 3])


def conv_functions(examples: int, side: int, channels: int, filters: int):
    """The timed functions of one conv, checked against each other."""
    x = tf.random.normal([examples, side, side, channels], seed=1)
    kernel = tf.random.normal([3, 3, channels, filters], seed=2)
    bias = tf.random.normal([filters], seed=3)
    dy = tf.random.normal([examples, side - 2, side - 2, filters], seed=4)
    x_in, dy_in = _into_channels(x), _into_channels(dy)
    kernels = tf.tile(kernel, [1, 1, 1, examples])  # Groups = examples.
    biases = tf.tile(bias, [examples])
    unit = [1, 1, 1, 1]

    def backprop_input(shape, k, g):
        return tf.raw_ops.Conv2DBackpropInput(
            input_sizes=shape, filter=k, out_backprop=g, strides=unit,
            padding='VALID')

    fns = {
        'forward': tf.function(lambda: tf.nn.relu(tf.nn.bias_add(
            tf.nn.conv2d(x, kernel, 1, 'VALID'), bias))),
        'forward grouped': tf.function(lambda: tf.nn.relu(tf.nn.bias_add(
            tf.nn.conv2d(x_in, kernels, 1, 'VALID'), biases))),
        'input gradient': tf.function(lambda: backprop_input(
            x.shape, kernel, dy)),
        'input gradient grouped': tf.function(lambda: backprop_input(
            x_in.shape, kernels, dy_in)),
        'transposes': tf.function(lambda: (_into_channels(x),
                                           _into_channels(dy))),
    }
    np.testing.assert_allclose(
        _out_of_channels(fns['forward grouped'](), examples),
        fns['forward'](), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(
        _out_of_channels(fns['input gradient grouped'](), examples),
        fns['input gradient'](), rtol=1e-4, atol=1e-3)
    return fns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--batch-size', type=int, default=64,
                        help='examples per chunk')
    parser.add_argument('--rounds', type=int, default=9)
    parser.add_argument('--calls', type=int, default=20)
    args = parser.parse_args()
    print(f'TensorFlow {tf.__version__}; chunks of {args.batch_size} '
          f'examples; CPU ms per call, median of {args.rounds} paired '
          'rounds; ratios: median of within-round ratios')
    for side, channels, filters in CONVS:
        fns = conv_functions(args.batch_size, side, channels, filters)
        seconds = paired_rounds.time_rounds(
            fns, rounds=args.rounds, calls=args.calls, clock=time.process_time)
        ms = {name: 1e3 * float(np.median(s)) for name, s in seconds.items()}
        print(f'  {side}x{side}x{channels} -> {filters}: ' + ', '.join(
            f'{name} {value:.2f}' for name, value in ms.items()))
        for name in ('forward', 'input gradient'):
            ratio = paired_rounds.median_ratio(seconds, f'{name} grouped',
                                               name)
            print(f'    {name}: grouped / batched {ratio:.2f}x')


if __name__ == '__main__':
    main()
