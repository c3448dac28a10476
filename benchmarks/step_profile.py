"""Where the CPU time of one training step goes, op by op.

Profiles a few training steps (``tf.profiler``) of non-private Keras
training and of ``DPModel`` (standard DP-SGD, q2 = 1, and twice sampling,
q2 = 0.5 with an l-infinity clip) on the reference CNN (or ResNet22 with
``--model resnet22``), fixed batches of random data, and prints the CPU
milliseconds per step that the op kernels took, in groups:

  * conv forward, conv input gradients, conv kernel gradients (the
    per-example kernel gradients of a DP step, with the transposes and
    matrix products that build them), matrix products, pooling;
  * random bits and noise (the Philox words of the coordinate masks, the
    Gaussian noise);
  * other ops (elementwise, reductions, slicing, variable updates);
  * outside op kernels: time the executor threads were busy but in no op
    kernel that the profiler names, mainly XLA-compiled kernels (the
    twice-sampling clip-mask-sum, `tf_twice.mechanism.kernels`) and the
    executor's own work.

A map for where to look, not a speed figure: the profiler slows every op
a little (more for graphs of many small ops), so ratios come from
``training_benchmark.py`` and ``step_breakdown_benchmark.py``. Usage:

  python benchmarks/step_profile.py [--model resnet22] [--batch-size 256]
      [--steps 20]
"""

import argparse
import collections
import glob
import os
import tempfile
from typing import Dict

import numpy as np
import tensorflow as tf
from tensorflow.tsl.profiler.protobuf import xplane_pb2

from tf_twice import models
from tf_twice.config import TwiceSamplingConfig
from tf_twice.keras import DPModel

GROUPS = ('conv forward', 'conv input gradients', 'conv kernel gradients',
          'matrix products', 'pooling', 'random bits and noise', 'other ops',
          'outside op kernels')


def group_of(event: str) -> str:
    """The group of one op-kernel event, named 'node name:op type'."""
    node, _, op = event.rpartition(':')
    if 'Conv2DBackpropFilter' in node or 'Conv2DBackpropFilter' in op:
        return 'conv kernel gradients'
    if 'Conv2DBackpropInput' in op:
        return 'conv input gradients'
    if 'Conv2D' in op:
        return 'conv forward'
    if 'MatMul' in op:
        return 'matrix products'
    if 'Pool' in op:
        return 'pooling'
    if op.startswith('StatelessRandom'):
        return 'random bits and noise'
    return 'other ops'


def _is_op_kernel(event: str) -> bool:
    # Op kernels are named 'node name:OpType' (a node name holds no colon);
    # the executor's and the runtime's own events are not.
    node, _, op = event.partition(':')
    return bool(node) and op.isidentifier()


def profile(train_function, iterator, steps: int) -> Dict[str, float]:
    """CPU ms per step in each group, over ``steps`` profiled steps."""
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        for _ in range(steps):
            train_function(iterator)
        tf.profiler.experimental.stop()
        path, = glob.glob(os.path.join(logdir, '**', '*.xplane.pb'),
                          recursive=True)
        space = xplane_pb2.XSpace()
        with open(path, 'rb') as f:
            space.ParseFromString(f.read())
    ms = collections.Counter()
    busy = 0.0
    for plane in space.planes:
        names = {k: v.name for k, v in plane.event_metadata.items()}
        for line in plane.lines:
            for event in line.events:
                name = names.get(event.metadata_id, '')
                duration = event.duration_ps / 1e9 / steps
                if name == 'ExecutorState::Process':
                    busy += duration
                elif _is_op_kernel(name):
                    ms[group_of(name)] += duration
    ms['outside op kernels'] = max(0.0, busy - sum(ms.values()))
    return ms


def configurations(model_name: str, batch: int):
    """(name, compiled model) of each profiled configuration."""
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def reference():
        tf.keras.utils.set_random_seed(0)
        return models.build_model(model_name, input_shape=(32, 32, 3),
                                  num_classes=10)

    plain = reference()
    plain.compile(optimizer=tf.keras.optimizers.SGD(0.05), loss=loss)
    yield 'non-private', plain
    for name, q2, linf in (('DP q2=1', 1.0, None),
                           ('DP q2=0.5 linf=0.1', 0.5, 0.1)):
        config = TwiceSamplingConfig.single(
            num_examples=16 * batch, expected_batch_size=batch,
            l2_norm_clip=1.0, noise_multiplier=1.0, linf_norm_clip=linf,
            coordinate_sampling_rate=q2)
        private = DPModel(reference(), config, seed=0)
        private.compile(optimizer=tf.keras.optimizers.SGD(0.05), loss=loss)
        yield name, private


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--model', choices=['small_cnn', 'resnet22'],
                        default='small_cnn')
    parser.add_argument('--batch-size', type=int, default=None,
                        help='default: 256 (small_cnn), 128 (resnet22)')
    parser.add_argument('--steps', type=int, default=20)
    args = parser.parse_args()
    batch = args.batch_size or (256 if args.model == 'small_cnn' else 128)
    rng = np.random.default_rng(0)
    x = rng.random((batch, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, batch)
    table = {}
    for name, model in configurations(args.model, batch):
        iterator = iter(tf.data.Dataset.from_tensors((x, y)).repeat())
        # Keras 2 returns the function; Keras 3 keeps it on the model.
        train_function = model.make_train_function() or model.train_function
        for _ in range(5):  # Traced and compiled before profiling.
            train_function(iterator)
        table[name] = profile(train_function, iterator, args.steps)
    print(f'{args.model}, batch {batch}, TensorFlow {tf.__version__}: CPU '
          f'ms per step (profiled, mean of {args.steps} steps)')
    print(f'  {"":24s}' + ''.join(f'{name:>20s}' for name in table))
    for group in GROUPS + ('total',):
        cells = [sum(ms.values()) if group == 'total' else ms[group]
                 for ms in table.values()]
        print(f'  {group:24s}' + ''.join(f'{c:20.1f}' for c in cells))


if __name__ == '__main__':
    main()
