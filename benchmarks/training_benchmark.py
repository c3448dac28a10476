"""Training throughput and memory of the DP training paths, in one run.

Reference model: Conv2D(16,3,relu)-MaxPool-Conv2D(32,3,relu)-MaxPool-Flatten-
Dense(64,relu)-Dense(10) on 32x32x3 inputs (79,530 parameters), or with
``--model=resnet22`` the paper's ResNet22 (291,898 parameters), random data,
on the CPU or the GPU TensorFlow places it on. Prints examples/second for

  * non-private Keras ``fit`` on fixed batches of B (what a non-private user
    runs), without XLA, and with ``--compare-xla`` also with
    ``jit_compile=True`` (Keras 3's default on a GPU);
  * tf_privacy's ``VectorizedDPKerasSGDOptimizer`` (O(B^2) Jacobian)*;
  * ``DPModel`` with its config (per-example vectorized_map), q2 = 1, and
    q2 = 0.5 with an l-infinity clip;
  * the optimizer path: a ``DPModel`` without a config compiled with
    ``TwiceSamplingDPKerasSGDOptimizer`` (the same per-example step), with
    the same q2 = 0.5 and l-infinity clip*;

(*: needs tensorflow-privacy on Keras 2, the ``tf_twice[tf-privacy]`` extra;
elsewhere the row is skipped and the reason printed).

The DP rows train on real Poisson logical batches (``poisson_batches``,
expected size B, unpadded: DPModel runs the last chunk of a batch at its own
size), and their examples/second count the expected real examples, n q1 = B
per step. One more row runs the q2 = 0.5 DPModel on fixed batches of B: the
Poisson overhead (fixed / Poisson examples per second, paired) is what
variable batch sizes cost. The fast configurations are timed in
rounds, each timing every configuration once in a rotated order; a ratio is
the median over rounds of the ratio within a round (paired), so load that
drifts between rounds cancels; the lowest and highest round's ratios are
printed beside it, and the wall-clock and CPU ratios are each judged
against the target. The tf_privacy row is timed once (it is two
orders of magnitude apart). Also printed: the peak memory of a 4,096-example
logical batch in microbatches against one microbatch (each in its own
subprocess). Targets: DPModel q2 = 0.5 + l-infinity >= 0.5x non-private fit;
twice sampling <= 10 % over q2 = 1; fast path >= 30x tf_privacy vectorized;
Poisson overhead <= 1.1x; memory <= 1.2x. Usage:

  python benchmarks/training_benchmark.py            # full run
  python benchmarks/training_benchmark.py --quick    # a smoke run, not figures
  python benchmarks/training_benchmark.py --model=resnet22 --batch-size=128 \
      --skip-slow --skip-memory                       # the ResNet22 ratio
  python benchmarks/training_benchmark.py --compare-physical=32,128 \
      --skip-slow --skip-memory        # other chunk sizes, same rounds
  python benchmarks/training_benchmark.py --compare-without=fusion,columns \
      --skip-slow --skip-memory        # the step without pieces of it
  python benchmarks/training_benchmark.py --compare-xla --skip-slow \
      --skip-memory                    # against non-private fit with XLA too

  python benchmarks/training_benchmark.py --compare-xla --compare-dp-xla \
      --skip-slow --skip-memory        # and the DP step compiled by XLA

Without ``--compare-dp-xla`` the DP rows run without ``jit_compile`` (their
clip-mask-sum kernels are XLA-compiled on their own); with it, the q2 = 1 and
twice-sampling rows run again with ``jit_compile=True`` (the whole DP step
compiled by XLA) on Poisson batches padded to whole physical batches by the
pipeline (``poisson_batches(physical_batch_size=...)``), since XLA compiles
the step once per batch shape.
"""

import argparse
import contextlib
import importlib
import os
import resource
import statistics
import subprocess
import sys
import textwrap
import time
from typing import Dict, List, Optional, Tuple
from unittest import mock

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))

from tf_twice import optimizers  # noqa: E402
from tf_twice import sampling  # noqa: E402
from tf_twice.config import TwiceSamplingConfig  # noqa: E402
from tf_twice.keras import DPModel  # noqa: E402
from tf_twice.keras import default_physical_batch_size  # noqa: E402
from tf_twice.keras import per_example  # noqa: E402
from tf_twice.keras import vectorized_backprop  # noqa: E402

import reference_inputs  # noqa: E402  Beside this script.
from reference_inputs import IMAGE_SHAPE, NUM_CLASSES  # noqa: E402

L2_CLIP, LINF_CLIP, NOISE = 1.0, 0.1, 1.0


# --model: the reference CNN (79,530 parameters) or ResNet22 (291,898).
MODEL = ['small_cnn']


def reference_model() -> tf.keras.Model:
    """The benchmarked model on 32x32x3 inputs (``--model``)."""
    return reference_inputs.build_model(MODEL[0])


def _config(batch: int, twice: bool,
            num_examples: int = 60_000) -> TwiceSamplingConfig:
    """The benchmarked mechanism: q2 = 0.5 with an l-infinity clip, or
    standard DP-SGD (q2 = 1). n only sets q1 (nothing is accounted here)."""
    return TwiceSamplingConfig.single(
        num_examples=max(num_examples, batch), expected_batch_size=batch,
        l2_norm_clip=L2_CLIP, noise_multiplier=NOISE,
        linf_norm_clip=LINF_CLIP if twice else None,
        coordinate_sampling_rate=0.5 if twice else 1.0)


# The configurations that need tensorflow-privacy's optimizers (Keras 2).
NEEDS_TF_PRIVACY = ('tf_privacy vectorized',
                    'optimizer path q2=0.5 linf=0.1')


def _tf_privacy_vectorized():
    """tf_privacy's vectorized optimizers module, imported on first use.

    Goes through tf_twice.optimizers, which imports tensorflow-privacy where
    it can work and otherwise raises an ImportError naming the fix.
    """
    optimizers.TwiceSamplingDPKerasSGDOptimizer  # pylint: disable=pointless-statement
    return importlib.import_module(
        'tensorflow_privacy.privacy.optimizers.dp_optimizer_keras_vectorized')


def unavailable(name: str) -> Optional[str]:
    """Why configuration ``name`` cannot run here; None when it can."""
    if name not in NEEDS_TF_PRIVACY:
        return None
    try:
        _tf_privacy_vectorized()
    except ImportError as e:
        return str(e)
    return None


def _loss(per_example: bool):
    # Reduction names that Keras 2 and Keras 3 both accept.
    kwargs = {'reduction': 'none'} if per_example else {}
    return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                         **kwargs)


# Examples the Poisson pipeline samples from: n = 16 B (q1 = 1/16).
POISSON_POOL_FACTOR = 16


def fixed_batches(batch: int, num_batches: int) -> tf.data.Dataset:
    """Fixed-size batches, as non-private training reads them."""
    x, y = reference_inputs.random_examples(batch * num_batches)
    return (tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).cache()
            .repeat())


def poisson_dataset(batch: int, seed: int = 0) -> tf.data.Dataset:
    """Real Poisson logical batches of expected size `batch` (unpadded)
    from n = POISSON_POOL_FACTOR * batch examples."""
    x, y = reference_inputs.random_examples(POISSON_POOL_FACTOR * batch)
    return sampling.poisson_batches(x, y, expected_batch_size=batch,
                                    repeat=True, seed=seed)


def padded_poisson_dataset(batch: int, physical: int,
                           seed: int = 0) -> tf.data.Dataset:
    """``poisson_dataset``'s batches padded to whole physical batches (rows
    of weight 0), for the XLA rows."""
    x, y = reference_inputs.random_examples(POISSON_POOL_FACTOR * batch)
    return sampling.poisson_batches(x, y, expected_batch_size=batch,
                                    physical_batch_size=physical,
                                    repeat=True, seed=seed)


def every_padded_size(model: DPModel, batch: int) -> tf.data.Dataset:
    """Batches of every multiple of the physical batch P that a Poisson batch
    of expected size B pads to with probability above about 1e-9 (B +- 6
    sqrt(B)): the XLA step compiles once for each."""
    chunk = model.physical_batch_size
    low = max(1, int(np.ceil(max(0.0, batch - 6 * batch**0.5) / chunk)))
    high = int(np.ceil((batch + 6 * batch**0.5) / chunk))
    x, y = (tf.constant(a)
            for a in reference_inputs.random_examples(high * chunk))
    sizes = np.arange(low, high + 1, dtype=np.int32) * chunk
    return tf.data.Dataset.from_tensor_slices(sizes).map(
        lambda k: (x[:k], y[:k], tf.ones([k], tf.float32)))


def every_last_chunk_size(model: DPModel) -> tf.data.Dataset:
    """Batches of P + u, P + 2u, ..., 2P rows (P the physical batch size,
    u its padding unit): their last chunks take every size that a Poisson
    batch's last chunk is padded to (`per_example.chunk_of`)."""
    chunk = model.physical_batch_size
    unit = per_example.padding_unit(chunk)
    x, y = (tf.constant(a)
            for a in reference_inputs.random_examples(2 * chunk))
    sizes = np.arange(chunk + unit, 2 * chunk + 1, unit, dtype=np.int32)
    return tf.data.Dataset.from_tensor_slices(sizes).map(
        lambda k: (x[:k], y[:k], tf.ones([k], tf.float32)))


def build(name: str, batch: int, physical: Optional[int]
          ) -> tf.keras.Model:
    """Builds and compiles the model of one benchmark configuration."""
    tf.keras.utils.set_random_seed(0)
    model = reference_model()
    n = POISSON_POOL_FACTOR * batch
    if name in (NON_PRIVATE, NON_PRIVATE_XLA):
        # Explicit: Keras 3's default ('auto') turns XLA on where there is a
        # GPU, which would make the baseline differ between machines.
        model.compile(optimizer=tf.keras.optimizers.SGD(0.05),
                      loss=_loss(False),
                      jit_compile=name == NON_PRIVATE_XLA)
        return model
    if name == 'tf_privacy vectorized':
        model.compile(
            optimizer=_tf_privacy_vectorized().VectorizedDPKerasSGDOptimizer(
                l2_norm_clip=L2_CLIP, noise_multiplier=NOISE,
                learning_rate=0.05),
            loss=_loss(True))
        return model
    if name.startswith('optimizer path'):
        private = DPModel(model, physical_batch_size=physical)
        private.compile(
            optimizer=optimizers.TwiceSamplingDPKerasSGDOptimizer(
                _config(batch, twice=True, num_examples=n),
                learning_rate=0.05),
            loss=_loss(False))
        return private
    if name.startswith('fast path'):
        twice = 'q2=0.5' in name
        if PHYSICAL_TAG in name:  # A --compare-physical row.
            physical = int(name.split(PHYSICAL_TAG)[1])
        private = DPModel(model, _config(batch, twice, num_examples=n),
                          physical_batch_size=physical, seed=0)
        private.compile(optimizer=tf.keras.optimizers.SGD(0.05),
                        loss=_loss(False), jit_compile=name.endswith(XLA))
        return private
    raise ValueError(f'unknown configuration {name!r}')


def time_fit(model: tf.keras.Model, dataset: tf.data.Dataset,
             steps: int, batch: int) -> tuple:
    """Examples per wall-clock second and per CPU second (all threads)."""
    wall, cpu = time.perf_counter(), time.process_time()
    model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return steps * batch / wall, steps * batch / cpu


NON_PRIVATE = 'non-private fit'
XLA = ' XLA'  # A row compiled with jit_compile=True.
NON_PRIVATE_XLA = NON_PRIVATE + XLA  # --compare-xla.
# The twice-sampling step's speed target against non-private fit, per model.
TWICE_TARGET = {'small_cnn': 0.5, 'resnet22': 0.9}
# Steps that warm up what the first one did not trace.
WARM_UP_STEPS = 12
TWICE = 'fast path q2=0.5 linf=0.1'
TWICE_FIXED = TWICE + ' fixed B'  # The same model on fixed batches of B.
PHYSICAL_TAG = ' physical='  # TWICE with another chunk size.
# TWICE_FIXED traced without one piece of vectorized_backprop (fixed
# batches: paired without the Poisson batches' scatter), for --compare-without:
# the converters that apply a conv's bias and ReLU to its own output, where
# oneDNN fuses them into it; or the columns construction of conv kernel
# gradients (the grouped convolution or the taps instead).
WITHOUT = {'fusion': TWICE + ' unfused fixed B',
           'columns': TWICE + ' without columns fixed B'}
FUSING_CONVERTERS = ('BiasAdd', 'Relu')


@contextlib.contextmanager
def _traced_without(name: str):
    """While ``name`` is a WITHOUT row, traces of its steps run without
    that row's piece of vectorized_backprop."""
    with contextlib.ExitStack() as stack:
        if name == WITHOUT['fusion']:
            # Restored on exit: TensorFlow's own conversions meanwhile.
            stack.enter_context(
                mock.patch.dict(vectorized_backprop.CONVERTERS))
            for op in FUSING_CONVERTERS:
                del vectorized_backprop.CONVERTERS[op]
        if name == WITHOUT['columns']:
            stack.enter_context(mock.patch.multiple(
                vectorized_backprop, **vectorized_backprop.WITHOUT_COLUMNS))
        yield


FAST = (NON_PRIVATE, 'fast path q2=1', TWICE, TWICE_FIXED,
        'optimizer path q2=0.5 linf=0.1')
DP_XLA = ('fast path q2=1' + XLA, TWICE + XLA)  # --compare-dp-xla.
ON_FIXED_BATCHES = (NON_PRIVATE, NON_PRIVATE_XLA, 'tf_privacy vectorized',
                    TWICE_FIXED) + tuple(WITHOUT.values())


def throughput(args) -> Dict[str, List[tuple]]:
    """Per configuration, one (examples/s, examples/CPU-s) per round."""
    batch, physical = args.batch_size, args.physical_batch_size
    fixed = fixed_batches(batch, 4)
    poisson = poisson_dataset(batch)
    slow = [] if args.skip_slow else ['tf_privacy vectorized']
    for name in FAST + tuple(slow):
        reason = unavailable(name)
        if reason is not None:
            print(textwrap.fill(f'  skipped {name}: {reason}', width=79,
                                subsequent_indent='    '), flush=True)
    fast = [name for name in FAST if unavailable(name) is None] + [
        f'{TWICE}{PHYSICAL_TAG}{p}' for p in args.compare_physical] + (
            [WITHOUT[piece] for piece in args.compare_without]) + (
            [NON_PRIVATE_XLA] if args.compare_xla else []) + (
            list(DP_XLA) if args.compare_dp_xla else [])
    slow = [name for name in slow if unavailable(name) is None]
    padded = padded_poisson_dataset(batch, physical)
    data = {name: fixed if name in ON_FIXED_BATCHES else
            padded if name in DP_XLA else poisson for name in fast + slow}
    results: Dict[str, List[tuple]] = {}
    models = {}
    for name in fast + slow:
        models[name] = build(name, batch, physical)
        # The first fit traces (and compiles) the train function; a second
        # one warms up the rest. Then every size a Poisson batch's last
        # chunk can have, for which XLA compiles the twice-sampling kernels
        # once each (a one-time cost: 8 compiles of 0.3-0.5 CPU-seconds at
        # physical batch 64). Twelve Poisson steps had left some sizes
        # unseen: three compiles fell in the first eleven timed steps,
        # about 5 CPU-ms per step over 200 steps.
        with _traced_without(name):  # Every trace of the model's steps.
            models[name].fit(data[name], steps_per_epoch=1, epochs=1,
                             verbose=0)
            if name in fast:
                models[name].fit(data[name], steps_per_epoch=WARM_UP_STEPS,
                                 epochs=1, verbose=0)
            if data[name] is poisson and isinstance(models[name], DPModel):
                models[name].fit(every_last_chunk_size(models[name]),
                                 verbose=0)
            if data[name] is padded:
                models[name].fit(every_padded_size(models[name], batch),
                                 verbose=0)
    for name in slow:
        results[name] = [time_fit(models[name], data[name], args.slow_steps,
                                  batch)]
        print(f'  {name}: {results[name][0][0]:.1f} ex/s', flush=True)
    for r in range(args.rounds):
        # Rotate the order so no configuration always runs first or last.
        order = fast[r % len(fast):] + fast[:r % len(fast)]
        for name in order:
            with _traced_without(name):
                results.setdefault(name, []).append(
                    time_fit(models[name], data[name], args.steps, batch))
        print(f'  round {r + 1}: ' + ', '.join(
            f'{n} {results[n][-1][0]:.0f}' for n in fast), flush=True)
    return results


def paired_ratio(results: Dict[str, List[tuple]], a: str, b: str,
                 clock: int) -> Optional[Tuple[float, float, float]]:
    """(median, lowest, highest) over rounds of speed(a) / speed(b) within
    each round; for a configuration timed once, its one timing against b's
    median (all three the same)."""
    if a not in results or b not in results:
        return None
    ra, rb = results[a], results[b]
    if len(ra) == len(rb):
        ratios = [x[clock] / y[clock] for x, y in zip(ra, rb)]
        return statistics.median(ratios), min(ratios), max(ratios)
    one = (statistics.median(x[clock] for x in ra)
           / statistics.median(y[clock] for y in rb))
    return one, one, one


def _with_range(values: Tuple[float, float, float], scale: float = 1.0,
                shift: float = 0.0, form: str = '.3f') -> str:
    """'median (lowest-highest)' of within-round values."""
    median, low, high = ((v - shift) * scale for v in values)
    return f'{median:{form}} ({low:{form}} to {high:{form}})'


def _rss_mb(field: str) -> float:
    with open('/proc/self/status', encoding='ascii') as status:
        for line in status:
            if line.startswith(field + ':'):
                return int(line.split()[1]) / 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def memory_child(logical: int, physical: int, steps: int) -> None:
    """Trains on random logical batches; prints baseline and peak RSS (MB)."""
    tf.keras.utils.set_random_seed(0)
    private = DPModel(reference_model(), _config(logical, twice=True),
                      physical_batch_size=physical, seed=0)
    private.compile(optimizer=tf.keras.optimizers.SGD(0.05),
                    loss=_loss(False))
    dataset = tf.data.Dataset.range(steps).map(lambda _: (
        tf.random.uniform((logical,) + IMAGE_SHAPE),
        tf.random.uniform((logical,), 0, NUM_CLASSES, tf.int64)))
    baseline = _rss_mb('VmRSS')
    private.fit(dataset, epochs=1, verbose=0)
    print(f'MEMORY {baseline:.1f} {_rss_mb("VmHWM"):.1f}')


def measure_memory(logical: int, physical: int, steps: int) -> tuple:
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), '--memory-child',
         '--logical', str(logical), '--physical', str(physical),
         '--steps', str(steps), '--model', MODEL[0]],
        check=True, capture_output=True, text=True).stdout
    line = [row for row in out.splitlines() if row.startswith('MEMORY')][-1]
    baseline, peak = (float(v) for v in line.split()[1:])
    return baseline, peak


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--model', choices=('small_cnn', 'resnet22'),
                        default='small_cnn')
    parser.add_argument('--batch-size', type=int, default=256,
                        help='expected (logical) batch size B')
    parser.add_argument('--physical-batch-size', type=int, default=None,
                        help='DPModel chunk size (default: the library\'s, '
                        'default_physical_batch_size)')
    parser.add_argument(
        '--compare-physical', type=lambda v: [int(p) for p in v.split(',')],
        default=[], help='comma-separated chunk sizes: adds a twice-sampling '
        'row for each, timed in the same rounds')
    parser.add_argument(
        '--compare-without', type=lambda v: v.split(','), default=[],
        metavar='fusion,columns',
        help='adds, for each piece named, the twice-sampling row on fixed '
        'batches traced without it: "fusion", the converters that let oneDNN '
        'fuse a conv with its bias and ReLU; "columns", the columns '
        'construction of conv kernel gradients')
    parser.add_argument(
        '--compare-xla', action='store_true',
        help='adds non-private fit with jit_compile=True, timed in the same '
        'rounds, and the DP rows\' ratios against it')
    parser.add_argument(
        '--compare-dp-xla', action='store_true',
        help='adds the q2 = 1 and twice-sampling DP rows compiled whole by '
        'XLA (jit_compile=True), timed in the same rounds')
    parser.add_argument('--steps', type=int, default=10,
                        help='timed steps per round of the fast configs')
    parser.add_argument('--rounds', type=int, default=6)
    parser.add_argument('--slow-steps', type=int, default=2,
                        help='timed steps of the O(B^2) Jacobian paths')
    parser.add_argument('--skip-slow', action='store_true',
                        help="skip tf_privacy's Jacobian-based optimizer")
    parser.add_argument('--skip-memory', action='store_true')
    parser.add_argument('--memory-logical', type=int, default=4096)
    parser.add_argument('--memory-physical', type=int, default=256)
    parser.add_argument('--quick', action='store_true',
                        help='steps=8, rounds=2, slow-steps=1: checks that '
                        'every configuration runs; too few rounds for '
                        'figures')
    parser.add_argument('--memory-child', action='store_true',
                        help=argparse.SUPPRESS)
    parser.add_argument('--logical', type=int, help=argparse.SUPPRESS)
    parser.add_argument('--physical', type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    MODEL[0] = args.model
    if args.memory_child:
        memory_child(args.logical, args.physical, args.steps)
        return
    if args.quick:
        args.steps, args.rounds, args.slow_steps = 8, 2, 1

    physical = args.physical_batch_size = (
        args.physical_batch_size or default_physical_batch_size(
            reference_model(), _config(args.batch_size, twice=True)))
    gpus = [tf.config.experimental.get_device_details(g).get(
        'device_name', g.name) for g in tf.config.list_physical_devices('GPU')]
    print(f'TensorFlow {tf.__version__}, {os.cpu_count()} CPUs, '
          f'GPUs: {", ".join(gpus) or "none"}, '
          f'{args.model}, expected '
          f'batch {args.batch_size}, physical batch {physical}, parameters '
          f'{reference_model().count_params()}. Rounds time every '
          'configuration once; ratios are medians of within-round ratios.')
    results = throughput(args)
    print('\nmedian examples/second (wall clock; per CPU-second in brackets;'
          ' DP rows: expected real examples of Poisson batches)')
    for name, rounds in results.items():
        print(f'  {name:32s} {statistics.median(r[0] for r in rounds):9.1f}'
              f'  ({statistics.median(r[1] for r in rounds):.1f})')

    def ratio(a: str, b: str, low: Optional[float], target: str) -> None:
        values = [paired_ratio(results, a, b, clock) for clock in (0, 1)]
        if values[0] is None:
            return
        verdicts = '' if low is None else ': ' + ', '.join(
            f'{label} {"ok" if v[0] >= low else "MISSED"}'
            for label, v in zip(('wall', 'CPU'), values))
        print(f'  {a} / {b}: wall {_with_range(values[0])}, CPU '
              f'{_with_range(values[1])}  (target {target}{verdicts})')

    print('\nratios: median of within-round ratios (lowest to highest round);'
          ' targets judged on each clock')
    one, twice = 'fast path q2=1', TWICE
    for fast in (one, twice):
        ratio(fast, 'tf_privacy vectorized', 30.0, '>= 30')
    ratio(one, NON_PRIVATE, None, 'informative')
    target = TWICE_TARGET[args.model]
    ratio(twice, NON_PRIVATE, target, f'>= {target}')
    ratio(NON_PRIVATE_XLA, NON_PRIVATE, None, 'informative: XLA against none')
    for fast in (one, twice):
        ratio(fast, NON_PRIVATE_XLA, None,
              'informative: against non-private fit with XLA')
    for fast in DP_XLA:
        ratio(fast, NON_PRIVATE_XLA, target if fast == twice + XLA else None,
              f'>= {target} against non-private fit with XLA'
              if fast == twice + XLA else 'informative')
        ratio(fast, fast[:-len(XLA)], None, 'informative: XLA against none')
    for p in args.compare_physical:
        ratio(f'{twice}{PHYSICAL_TAG}{p}', NON_PRIVATE, None,
              'informative')
        ratio(f'{twice}{PHYSICAL_TAG}{p}', twice, None,
              f'informative: physical batch {p} against {physical}')
    for piece, name in WITHOUT.items():
        ratio(TWICE_FIXED, name, None,
              f'informative: with {piece} against without')
    ratio('optimizer path q2=0.5 linf=0.1', twice, None,
          'informative: the same per-example step')
    for clock, label in ((0, 'wall'), (1, 'CPU')):
        speedup = paired_ratio(results, one, twice, clock)
        if speedup is not None:
            verdict = 'ok' if speedup[0] - 1 <= 0.10 else 'MISSED'
            print(f'  twice-sampling overhead (q2=0.5, linf on, vs q2=1), '
                  f'{label} time: '
                  f'{_with_range(speedup, 100, 1, "+.1f")} %'
                  f'  (target <= 10%: {verdict})')

    for clock, label in ((0, 'wall'), (1, 'CPU')):
        cost = paired_ratio(results, TWICE_FIXED, twice, clock)
        if cost is not None:
            verdict = 'ok' if cost[0] <= 1.1 else 'MISSED'
            print(f'  Poisson overhead (fixed batches of B / Poisson batches '
                  f'of expected size B), {label} time: '
                  f'{_with_range(cost)}x  (target <= 1.1: {verdict})')

    if not args.skip_memory:
        big = measure_memory(args.memory_logical, args.memory_physical, 2)
        small = measure_memory(args.memory_physical, args.memory_physical,
                               2)
        print('\npeak memory (RSS, MB; baseline = after building the model)')
        print(f'  logical {args.memory_logical} in microbatches of '
              f'{args.memory_physical}: peak {big[1]:.0f} (baseline '
              f'{big[0]:.0f})')
        print(f'  single batch of {args.memory_physical}: peak '
              f'{small[1]:.0f} (baseline {small[0]:.0f})')
        ratio_total = big[1] / small[1]
        ratio_growth = (big[1] - big[0]) / max(small[1] - small[0], 1.0)
        verdict = 'ok' if ratio_total <= 1.2 else 'MISSED'
        print(f'  peak ratio {ratio_total:.2f}  (target <= 1.2: {verdict}); '
              f'growth-over-baseline ratio {ratio_growth:.2f}')


if __name__ == '__main__':
    main()
