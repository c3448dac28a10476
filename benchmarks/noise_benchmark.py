"""The cost of one step's Gaussian noise, against a batch's summed gradient.

A DP step draws one N(0, 1) number per trainable coordinate, once per logical
batch. tf_twice draws them by Box-Muller in float64 on uniforms that reach
8.57 standard deviations (``randomness.standard_normal_noise``), where
TensorFlow's own sampler stops at 5.68. For the benchmarked model (the
reference CNN, or ResNet22 with ``--model resnet22``; CPU), times:

  * ``summed gradient``: one batched backward pass of the summed loss of a
    batch of ``--batch-size`` examples (random data), what non-private
    training computes per step;
  * ``noise (tf_twice)``: ``standard_normal_noise`` for every trainable
    variable, in the dtype training draws it in (float32 for a float32
    model, ``PrivateAggregator.finish``);
  * ``noise (tf.random)``: TensorFlow's normal sampler for the same shapes.

Timings are paired (``paired_rounds``) in CPU time. Usage:

  python benchmarks/noise_benchmark.py [--model resnet22] [--batch-size 256]
      [--rounds 9]
"""

import argparse

import tensorflow as tf

from tf_twice.mechanism import precision
from tf_twice.mechanism import randomness

import paired_rounds  # Beside this script.
import reference_inputs  # Beside this script.


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--model', choices=['small_cnn', 'resnet22'],
                        default='small_cnn')
    parser.add_argument('--batch-size', type=int, default=256)
    parser.add_argument('--rounds', type=int, default=9)
    parser.add_argument('--calls', type=int, default=5)
    args = parser.parse_args()
    model = reference_inputs.build_model(args.model)
    x, y = (tf.constant(a) for a in
            reference_inputs.random_examples(args.batch_size))
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    shapes = [v.shape for v in model.trainable_variables]
    noise_dtype = precision.accumulation_dtype(
        *(v.dtype for v in model.trainable_variables))
    # A new key per call, as in training (constant inputs would let
    # TensorFlow fold a stateless sampler into a constant).
    generator = tf.random.Generator.from_seed(0)

    @tf.function
    def summed():
        with tf.GradientTape() as tape:
            total = loss(y, model(x, training=True))
        return tape.gradient(total, model.trainable_variables)

    @tf.function
    def noise_tf_twice():
        key = randomness.draw_step_key(generator)
        return randomness.standard_normal_noise(
            key, shapes, [noise_dtype] * len(shapes))

    @tf.function
    def noise_tf_random():
        key = randomness.draw_step_key(generator)
        return [tf.raw_ops.StatelessRandomNormalV2(
            shape=shape, key=key, counter=[0, v], alg=1, dtype=tf.float32)
                for v, shape in enumerate(shapes)]

    fns = {'summed gradient': summed, 'noise (tf_twice)': noise_tf_twice,
           'noise (tf.random)': noise_tf_random}
    paired_rounds.print_against_baseline(
        fns, baseline='summed gradient', rounds=args.rounds, calls=args.calls,
        digits=3,
        heading=(f'{args.model}, {model.count_params()} parameters, batch of '
                 f'{args.batch_size}, TensorFlow {tf.__version__}; CPU ms per '
                 'call and ratio to the summed gradient (paired, median of '
                 f'{args.rounds} rounds)'))

if __name__ == '__main__':
    main()
