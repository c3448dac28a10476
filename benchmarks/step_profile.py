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
      [--steps 20] [--op-types 12]

``--op-types N`` prints, instead of the groups, the N op types (as the
profiler names oneDNN's kernels) that took the most CPU time per step.

``--device-profile`` profiles, on the GPU TensorFlow places the model on,
non-private ``fit`` with XLA and the twice-sampling DP step with and without
XLA: per step the wall-clock milliseconds, the milliseconds the GPU's
streams were busy in kernels and the costliest kernels. GPU-busy far below
the wall clock means the host bounds the step. Without a GPU it says so (and
GPU busy is 0).
"""

import argparse
import collections
import glob
import os
import tempfile
import time
from typing import Dict

import tensorflow as tf
from tensorflow.tsl.profiler.protobuf import xplane_pb2

import training_benchmark  # Beside this script.

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


def op_type_of(event: str) -> str:
    return event.rpartition(':')[2]


def _read_space(logdir: str) -> xplane_pb2.XSpace:
    """The profile the profiler wrote under ``logdir``."""
    path, = glob.glob(os.path.join(logdir, '**', '*.xplane.pb'),
                      recursive=True)
    space = xplane_pb2.XSpace()
    with open(path, 'rb') as f:
        space.ParseFromString(f.read())
    return space


def profile(train_function, iterator, steps: int,
            key=group_of) -> Dict[str, float]:
    """CPU ms per step in each group (or other ``key`` of an op-kernel
    event), over ``steps`` profiled steps."""
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        for _ in range(steps):
            train_function(iterator)
        tf.profiler.experimental.stop()
        space = _read_space(logdir)
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
                    ms[key(name)] += duration
    ms['outside op kernels'] = max(0.0, busy - sum(ms.values()))
    return ms


def device_profile(train_function, iterator, steps: int):
    """(wall ms, GPU-busy ms, Counter of GPU kernel ms) per step, over
    ``steps`` profiled steps: kernel events on the GPU planes' stream
    lines (each kernel once, on the stream it ran on)."""
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        start = time.perf_counter()
        for _ in range(steps):
            outputs = train_function(iterator)
        tf.nest.map_structure(lambda t: t.numpy(), outputs)  # Wait for it.
        wall = (time.perf_counter() - start) * 1e3 / steps
        tf.profiler.experimental.stop()
        space = _read_space(logdir)
    kernels = collections.Counter()
    for plane in space.planes:
        if not plane.name.startswith('/device:GPU:'):
            continue
        names = {k: v.name for k, v in plane.event_metadata.items()}
        for line in plane.lines:
            if not line.name.startswith('Stream'):
                continue
            for event in line.events:
                kernels[names.get(event.metadata_id, '?')[:60]] += (
                    event.duration_ps / 1e9 / steps)
    return wall, sum(kernels.values()), kernels


def run_device_profile(batch: int, steps: int) -> None:
    """Prints ``device_profile`` of the configurations it names."""
    if not tf.config.list_physical_devices('GPU'):
        print('--device-profile: TensorFlow sees no GPU (GPU busy is 0).')
    print(f'{training_benchmark.MODEL[0]}, batch {batch}, TensorFlow '
          f'{tf.__version__}: ms per step (mean of {steps} profiled steps)')
    for name in (training_benchmark.NON_PRIVATE_XLA, training_benchmark.TWICE,
                 training_benchmark.TWICE + training_benchmark.XLA):
        model = training_benchmark.build(name, batch, None)
        iterator = iter(training_benchmark.fixed_batches(batch, 1))
        train_function = model.make_train_function() or model.train_function
        for _ in range(3):  # Traced and compiled before profiling.
            train_function(iterator)
        wall, busy, kernels = device_profile(train_function, iterator, steps)
        top = ', '.join(f'{k} {t:.2f}' for k, t in kernels.most_common(5))
        print(f'  {name}: wall {wall:.2f}, GPU busy {busy:.2f} '
              f'({busy / wall:.0%} of wall); top kernels: {top}')


# The profiled configurations, built as `training_benchmark` builds them
# (same model, mechanism, optimizer and loss), under this script's labels.
CONFIGURATIONS = {'non-private': 'non-private fit',
                  'DP q2=1': 'fast path q2=1',
                  'DP q2=0.5 linf=0.1': training_benchmark.TWICE}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--model', choices=['small_cnn', 'resnet22'],
                        default='small_cnn')
    parser.add_argument('--batch-size', type=int, default=None,
                        help='default: 256 (small_cnn), 128 (resnet22)')
    parser.add_argument('--steps', type=int, default=20)
    parser.add_argument('--op-types', type=int, default=0, metavar='N',
                        help='print the N costliest op types instead')
    parser.add_argument('--device-profile', action='store_true',
                        help='GPU kernel time against wall time instead')
    args = parser.parse_args()
    batch = args.batch_size or (256 if args.model == 'small_cnn' else 128)
    training_benchmark.MODEL[0] = args.model
    if args.device_profile:
        run_device_profile(batch, args.steps)
        return
    table = {}
    for label, name in CONFIGURATIONS.items():
        model = training_benchmark.build(name, batch, None)
        iterator = iter(training_benchmark.fixed_batches(batch, 1))
        # Keras 2 returns the function; Keras 3 keeps it on the model.
        train_function = model.make_train_function() or model.train_function
        for _ in range(5):  # Traced and compiled before profiling.
            train_function(iterator)
        table[label] = profile(train_function, iterator, args.steps,
                               op_type_of if args.op_types else group_of)
    print(f'{args.model}, batch {batch}, TensorFlow {tf.__version__}: CPU '
          f'ms per step (profiled, mean of {args.steps} steps)')
    if args.op_types:
        for label, ms in table.items():
            top = ms.most_common(args.op_types)
            print(f'  {label}: ' + ', '.join(f'{op} {t:.2f}' for op, t in top))
        return
    print(f'  {"":24s}' + ''.join(f'{name:>20s}' for name in table))
    for group in GROUPS + ('total',):
        cells = [sum(ms.values()) if group == 'total' else ms[group]
                 for ms in table.values()]
        print(f'  {group:24s}' + ''.join(f'{c:20.1f}' for c in cells))


if __name__ == '__main__':
    main()
