r"""Test accuracy on digits at equal epsilon: DP-SGD, twice sampling, hybrid.

Every row trains the same small CNN (examples/train.py) on the same private
set (the digits training split minus `--public_examples` held-out public
examples, which only hybrid clipping uses) for the same number of steps,
with the same learning rate and global l2 clip, each with its noise
calibrated to the same (epsilon, delta). Rows:

* `dpsgd q=q1`: standard DP-SGD with Poisson sampling at the expected batch
  size B of the twice-sampling rows;
* `dpsgd q=q1*q2`: standard DP-SGD at batch B * q2, the paper's baseline:
  the same expected number of contributions per coordinate as twice
  sampling (the update is divided by n * q1 * q2 in both);
* `twice`: (q1, q2)-twice sampling with l-infinity clip c2 / sqrt(d0);
* `hybrid`: twice sampling plus hybrid clipping with a basis of rank
  `--ranks` learned from the public split (refreshed every
  `--basis_refresh_steps` steps) and per-block noise optimised for the
  target.

Each row runs once per seed; the table gives the median test accuracy, its
range over the seeds, the noise multiplier(s) and the epsilon the privacy
ledger reports.

Run: python examples/accuracy_study.py

The console is kept as quiet as examples/train.py keeps it (TensorFlow's C++
log and a few known notes hidden; set TF_CPP_MIN_LOG_LEVEL to see the log).
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Sequence

from absl import app
from absl import flags


def _load_train():
    """Imports examples/train.py, which sits beside this script."""
    name = 'tf_twice_examples_train'
    if name in sys.modules:
        return sys.modules[name]
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                        'train.py')
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


train_lib = _load_train()

ROWS = ('dpsgd q=q1', 'dpsgd q=q1*q2', 'twice', 'hybrid')


def row_configs(*, batch_size: float, coordinate_sampling_rate: float,
                d0: float, ranks: Sequence[int], basis_refresh_steps: int,
                rows: Sequence[str] = ROWS) -> Dict[str, Dict[str, Any]]:
    """The settings that differ between rows (see the module docstring)."""
    q2 = coordinate_sampling_rate
    every = {
        'dpsgd q=q1': dict(mode='dpsgd', batch_size=batch_size),
        'dpsgd q=q1*q2': dict(mode='dpsgd', batch_size=batch_size * q2),
        'twice': dict(mode='twice', batch_size=batch_size,
                      coordinate_sampling_rate=q2, d0=d0),
        'hybrid': dict(mode='hybrid', batch_size=batch_size,
                       coordinate_sampling_rate=q2, d0=d0,
                       ranks=tuple(ranks),
                       basis_refresh_steps=basis_refresh_steps),
    }
    unknown = [row for row in rows if row not in every]
    if unknown:
        raise ValueError(f'--rows must be among {", ".join(ROWS)}; got '
                         f'{unknown}.')
    return {row: every[row] for row in rows}


def run_study(configs: Dict[str, Dict[str, Any]], *, seeds: Sequence[int],
              common: Dict[str, Any], public_examples: int, data=None,
              log=print) -> Dict[str, List[Dict[str, Any]]]:
    """Trains every row once per seed; returns the results per row."""
    if data is None:
        data = train_lib.load_data('digits', public_examples=public_examples)
    results: Dict[str, List[Dict[str, Any]]] = {row: [] for row in configs}
    for seed in seeds:
        for row, overrides in configs.items():
            config = dict(common, seed=seed, public_examples=public_examples,
                          **overrides)
            result = train_lib.train(config, data=data)
            results[row].append(result)
            log(f'{row:>14}  seed {seed}: test accuracy '
                f"{result['test_accuracy']:.4f}, epsilon "
                f"{result['epsilon']:.3f}, {result['train_seconds']:.0f} s")
    return results


def _noise(value) -> str:
    if isinstance(value, (list, tuple)):
        return ', '.join(f'{v:.3g}' for v in value)
    return f'{value:.3g}'


def markdown_table(results: Dict[str, List[Dict[str, Any]]]) -> str:
    """Median and range of the test accuracy per row, as markdown."""
    lines = [
        '| method | expected batch | q2 | noise multiplier | epsilon '
        '| steps | test accuracy: median | min - max | seeds |',
        '|---|---:|---:|---|---:|---:|---:|---:|---:|',
    ]
    for row, runs in results.items():
        if not runs:
            continue
        accuracies = [100.0 * r['test_accuracy'] for r in runs]
        first = runs[0]
        lines.append(
            f"| {row} | {first['expected_batch_size']:g} "
            f"| {first['coordinate_sampling_rate']:g} "
            f"| {_noise(first['noise_multiplier'])} "
            f"| {max(r['epsilon'] for r in runs):.3f} "
            f"| {first['total_steps']} "
            f'| {statistics.median(accuracies):.1f} % '
            f'| {min(accuracies):.1f} - {max(accuracies):.1f} % '
            f'| {len(runs)} |')
    return '\n'.join(lines)


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    fv = dict(flag_values=flag_values)
    flags.DEFINE_list('seeds', ['0', '1', '2', '3', '4'], 'Seeds per row.',
                      **fv)
    flags.DEFINE_list('rows', list(ROWS), 'Rows to run.', **fv)
    flags.DEFINE_float('target_epsilon', 4.0, 'Epsilon of every row.', **fv)
    flags.DEFINE_float('epochs', 40, 'Epochs (1/q1 steps each) of the '
                       'twice-sampling rows; every row runs as many steps.',
                       **fv)
    flags.DEFINE_float('batch_size', 128, 'Expected batch size B.', **fv)
    flags.DEFINE_float('coordinate_sampling_rate', 0.5, 'q2.', **fv)
    flags.DEFINE_float('d0', 100, 'c_inf = c2 / sqrt(d0) (twice, and the '
                       'residual of hybrid).', **fv)
    flags.DEFINE_float('learning_rate', 0.5, 'SGD learning rate.', **fv)
    flags.DEFINE_float('l2_norm_clip', 1.0, 'Global l2 clip.', **fv)
    flags.DEFINE_integer('public_examples', 200, 'Held-out public examples '
                         '(removed from every row\'s private set).', **fv)
    flags.DEFINE_list('ranks', ['16'], 'Hybrid principal ranks.', **fv)
    flags.DEFINE_integer('basis_refresh_steps', 20, 'Hybrid basis refresh.',
                         **fv)


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    train_lib.quiet_known_noise()
    f = flags.FLAGS
    try:
        seeds = [int(s) for s in f.seeds]
        configs = row_configs(
            batch_size=f.batch_size,
            coordinate_sampling_rate=f.coordinate_sampling_rate, d0=f.d0,
            ranks=[int(r) for r in f.ranks],
            basis_refresh_steps=f.basis_refresh_steps, rows=f.rows)
    except ValueError as e:
        raise app.UsageError(str(e)) from e
    data = train_lib.load_data('digits', public_examples=f.public_examples)
    n = len(data.x_train)
    # Every row runs the steps of the twice-sampling rows' epochs.
    steps_per_epoch = train_lib.sampling.poisson_schedule(
        n, expected_batch_size=f.batch_size).steps_per_epoch
    steps = int(round(f.epochs * steps_per_epoch))
    common = dict(target_epsilon=f.target_epsilon, steps=steps,
                  learning_rate=f.learning_rate,
                  l2_norm_clip=f.l2_norm_clip, verbose=0)
    start = time.time()
    results = run_study(configs, seeds=seeds, common=common,
                        public_examples=f.public_examples, data=data)
    print()
    print(f'digits: {n} private training examples, {f.public_examples} '
          f'public (hybrid only), {len(data.x_test)} test; small_cnn; '
          f'{steps} steps; SGD learning rate {f.learning_rate:g}; l2 clip '
          f'{f.l2_norm_clip:g}; target epsilon {f.target_epsilon:g} at delta '
          f"{results[next(iter(results))][0]['delta']:g}; seeds {seeds}.")
    print()
    print(markdown_table(results))
    print()
    print(f'Total time: {time.time() - start:.0f} s.')


if __name__ == '__main__':
    define_flags()
    app.run(main)
