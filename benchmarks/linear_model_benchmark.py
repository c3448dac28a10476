"""DP training speed of the ScatterNet linear model against Keras's own fit.

The model is ``tf_twice.models.linear()`` (features [7, 7, 81] ->
GroupNormalization(27 groups, no parameters) -> Flatten -> Dense(10):
39,700 parameters), the mechanism Tramer & Boneh's Fashion-MNIST recipe
(n = 58,000, expected batch 8,192, SGD lr 16 momentum 0.9, c2 = 0.1, noise
multiplier 3.6), on random features (speed does not depend on the data).
Rows, timed side by side in one process, alternating (the order rotates by
one each round) for several rounds of ``--steps`` steps each:

  * ``non-private fit``: Keras ``fit`` on the plain model (no XLA);
  * ``DP-SGD``: ``DPModel``, q2 = 1, no l-infinity clip;
  * ``twice``: ``DPModel``, q2 = 0.5, c_inf = c2 / 10;
  * ``hybrid``: ``DPModel`` with hybrid clipping as the training script's
    ``--mode=hybrid --ranks=16 --d0=100`` runs it: one principal block of
    rank 16 (unmasked) and the residual (q2 = 0.5, c_inf = c2_res / 10),
    a basis learned from random gradients (its values do not change the
    cost). Its residual is dense per example, so its per-example
    gradients are materialised and projected (4 B d k flops a chunk); no
    target, the ratio to DP-SGD is printed;
  * with ``--compare_physical P ...``: each DP row again in chunks of P
    rows (``DP-SGD q2=1 at P``, ...); no target, its ratio to the same row
    at the default (or ``--physical_batch_size``) chunk is printed.

Every row trains on the same fixed batches of ``--batch_size`` rows (the DP
step is the same computation on a Poisson batch of that size). Prints, per
row, examples per wall-clock second and per CPU second (median and range
over rounds), then the paired ratios, each round's and their median and
range, against the targets: DP-SGD >= 0.8x non-private fit, and twice
sampling <= 1.5x DP-SGD's time per example (and hybrid's ratio, for
information). Usage:

  python benchmarks/linear_model_benchmark.py                # 7 rounds
  python benchmarks/linear_model_benchmark.py --quick        # < 1 minute
  python benchmarks/linear_model_benchmark.py --physical_batch_size 512
  python benchmarks/linear_model_benchmark.py --compare_physical 256 1024
  TF_USE_LEGACY_KERAS=1 python benchmarks/linear_model_benchmark.py  # Keras 2

Wall-clock figures on a shared host move with its load; the CPU-second
ratios move less.
"""

import argparse
import os
import statistics
import sys
import time
import warnings
from typing import Dict, List, Tuple

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))

from tf_twice import _keras  # noqa: E402
from tf_twice import models  # noqa: E402
from tf_twice.config import Block, TwiceSamplingConfig  # noqa: E402
from tf_twice.hybrid import learning  # noqa: E402
from tf_twice.keras import DPModel  # noqa: E402

NUM_EXAMPLES, L2_CLIP, NOISE, LR = 58_000, 0.1, 3.6, 16.0
FIT, DP_SGD, TWICE = 'non-private fit', 'DP-SGD q2=1', 'twice q2=0.5'
HYBRID = 'hybrid rank 16'
# (row, against, bound): examples/s of row over against's at least bound,
# or, for a negative bound, time per example at most -bound times; a bound
# of None prints the ratio of times per example with no target.
TARGETS = ((DP_SGD, FIT, 0.8), (TWICE, DP_SGD, -1.5), (HYBRID, DP_SGD, None))


def _optimizer():
    return tf.keras.optimizers.SGD(LR, momentum=0.9)


def _loss():
    return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def build(name: str, batch: int, physical) -> tf.keras.Model:
    tf.keras.utils.set_random_seed(0)
    model = models.linear()
    if name == FIT:
        model.compile(optimizer=_optimizer(), loss=_loss(),
                      jit_compile=False)
        return model
    if name == HYBRID:
        return _hybrid(model, batch, physical)
    twice = name == TWICE
    config = TwiceSamplingConfig.single(
        num_examples=NUM_EXAMPLES, expected_batch_size=batch,
        l2_norm_clip=L2_CLIP, noise_multiplier=NOISE,
        linf_norm_clip=L2_CLIP / 10 if twice else None,
        coordinate_sampling_rate=0.5 if twice else 1.0)
    private = DPModel(model, config, physical_batch_size=physical, seed=0)
    private.compile(optimizer=_optimizer(), loss=_loss())
    return private


def _hybrid(model, batch: int, physical) -> tf.keras.Model:
    """The tuned hybrid run's mechanism (clips and noise of its plan,
    rounded: they do not change the cost)."""
    model.build((None, 7, 7, 81))
    rng = np.random.default_rng(1)
    gradients = [rng.standard_normal((64, *v.shape)).astype(np.float32)
                 for v in model.trainable_variables]
    basis = learning.learn_basis(gradients, ranks=[16], seed=0)
    blocks = (Block(l2_norm_clip=0.084, noise_multiplier=21.7,
                    coordinate_sampling_rate=1.0),
              Block(l2_norm_clip=0.055, linf_norm_clip=0.0055,
                    noise_multiplier=1.9))
    config = TwiceSamplingConfig(
        num_examples=NUM_EXAMPLES, expected_batch_size=batch,
        coordinate_sampling_rate=0.5, blocks=blocks)
    private = DPModel(model, config, basis=basis,
                      physical_batch_size=physical, seed=0)
    private.compile(optimizer=_optimizer(), loss=_loss())
    return private


class _StepClock(tf.keras.callbacks.Callback):
    """Wall-clock and CPU seconds (all threads) spent in a fit's steps."""

    def __init__(self):
        super().__init__()
        self.wall = self.cpu = 0.0
        self._start = (0.0, 0.0)

    def on_train_batch_begin(self, batch, logs=None):
        self._start = (time.perf_counter(), time.process_time())

    def on_train_batch_end(self, batch, logs=None):
        self.wall += time.perf_counter() - self._start[0]
        self.cpu += time.process_time() - self._start[1]


def time_fit(model, data, steps: int, batch: int) -> Tuple[float, float]:
    """Examples per wall-clock second and per CPU second of ``steps`` steps
    of ``fit``, timed step by step: a fit call's own set-up and tear-down
    are not counted (on the 2-core host they rounded some calls' wall time
    up to multiples of about 1.3 s, whatever the model)."""
    clock = _StepClock()
    model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0,
              callbacks=[clock])
    return steps * batch / clock.wall, steps * batch / clock.cpu


DP_ROWS = (DP_SGD, TWICE, HYBRID)


def _at_physical(name: str, size: int) -> str:
    return f'{name} at {size}'


def run(args) -> Dict[str, List[Tuple[float, float]]]:
    batch = args.batch_size
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2 * batch, 7, 7, 81), dtype=np.float32)
    y = rng.integers(0, 10, 2 * batch)
    data = (tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
            .cache().repeat())
    names = [FIT, DP_SGD, TWICE, HYBRID]
    built = {name: build(name, batch, args.physical_batch_size)
             for name in names}
    for size in args.compare_physical:
        for name in DP_ROWS:
            names.append(_at_physical(name, size))
            built[names[-1]] = build(name, batch, size)
    for name in names:
        time_fit(built[name], data, 2, batch)  # Traced, compiled, warm.
    print(f'physical batch: {built[DP_SGD].physical_batch_size}', flush=True)
    results: Dict[str, List[Tuple[float, float]]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            results[name].append(time_fit(built[name], data, args.steps,
                                          batch))
        print(f'  round {r + 1}: ' + ', '.join(
            f'{n} {results[n][-1][0]:,.0f}' for n in names), flush=True)
    return results


def _summary(values: List[float], form: str) -> str:
    return (f'{statistics.median(values):{form}} '
            f'({min(values):{form}} to {max(values):{form}})')


def report(results: Dict[str, List[Tuple[float, float]]],
           compare_physical: List[int]) -> None:
    width = max(len(name) for name in results)
    for clock, label in ((0, 'wall-clock second'), (1, 'CPU second')):
        print(f'examples per {label}, median (range) over rounds:')
        for name, rows in results.items():
            print(f'  {name:{width}s} '
                  f'{_summary([row[clock] for row in rows], ",.0f")}')
    print('paired ratios of examples/s (each round; median (range)):')
    for row, against, bound in TARGETS + tuple(
            (_at_physical(name, size), name, None)
            for size in compare_physical for name in DP_ROWS):
        for clock, label in ((0, 'wall'), (1, 'CPU')):
            ratios = [a[clock] / b[clock]
                      for a, b in zip(results[row], results[against])]
            if bound is None or bound < 0:  # Time per example.
                ratios = [1 / v for v in ratios]
                what = f'time/example {row} / {against}'
            else:
                what = f'{row} / {against}'
            if bound is None:
                verdict = 'no target'
            else:
                median = statistics.median(ratios)
                sign, goal = ('<=', -bound) if bound < 0 else ('>=', bound)
                meets = median <= goal if bound < 0 else median >= goal
                verdict = (f'target {sign} {goal:.2f}: '
                           + ('met' if meets else 'NOT met'))
            print(f'  {what} ({label}): '
                  + ' '.join(f'{v:.2f}' for v in ratios)
                  + f'; {_summary(ratios, ".2f")}; {verdict}')

def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--rounds', type=int, default=7)
    parser.add_argument('--steps', type=int, default=5,
                        help='steps per row per round')
    parser.add_argument('--batch_size', type=int, default=8192)
    parser.add_argument('--physical_batch_size', type=int, default=None,
                        help="default: DPModel's default")
    parser.add_argument('--compare_physical', type=int, nargs='*',
                        default=[], metavar='P',
                        help='also time each DP row in chunks of P rows')
    parser.add_argument('--quick', action='store_true',
                        help='3 rounds of 2 steps: a smoke run, not figures')
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 3, 2
    print(f'TensorFlow {tf.__version__}, {_keras.KERAS_PACKAGE} '
          f'{_keras.KERAS_VERSION}, '
          f'batch {args.batch_size}, {args.rounds} rounds of {args.steps} '
          'steps', flush=True)
    with warnings.catch_warnings():
        # Fixed batches, no ledger: DPModel warns that nothing accounts.
        warnings.simplefilter('ignore')
        results = run(args)
    report(results, args.compare_physical)


if __name__ == '__main__':
    main()
