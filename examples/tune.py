r"""Tunes the training script's settings on a validation split, on a budget.

Every trial is a run of examples/train.py (`examples.training.runner.train`)
on the private training examples less `--validation_examples` (a fixed
subset, the same for every trial and seed) and less `--public_examples`
(hybrid clipping's public split, also fixed), scored by its validation
accuracy; the test split is never read. Each trial's noise is calibrated to
its own target epsilon over its own steps, so trials that train longer or
on larger batches pay for it in noise, as they would in a release.

The search space is a grid of flags (`--grid=learning_rate=8,16,32`,
repeated per flag); `--set` fixes flags shared by every trial (e.g.
`--set=mode=twice`); the dataset's recipe (examples/training/recipes.py)
gives the rest. `--budget` caps the number of grid points tried: when the
grid is larger, a random subset of that size is drawn (fixed by
`--search_seed`), so that rows tuned with the same budget are compared on
equal terms. Each point runs once per `--seeds`, scored by the median.

`--results_json` keeps every finished run and a rerun skips them (a search
can be run in parts); it ends with the best point, which
examples/accuracy_study.py takes with `--tuned=ROW=FILE`.

Hyperparameter tuning on the private data is itself not covered by the
differential-privacy guarantee of each run (Papernot & Steinke, ICLR 2022,
arXiv:2110.03620): the validation split is private data, and the chosen
setting depends on it. It is reported, as is usual in DP benchmarks, so
that the comparison between rows stays fair (same budget for each).

Run (the Fashion-MNIST tuning of docs/results.md):

  python examples/tune.py --dataset=fashion_mnist --features=scattering \
      --set=target_epsilon=3 --grid=learning_rate=8,16,32 \
      --grid=epochs=40,80 --grid=batch_size=8192,16384 --budget=8 \
      --results_json=docs/figures/fmnist_scatternet_tune_dpsgd.json
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

if __package__ in (None, ''):
    sys.path.insert(0, os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags
import numpy as np

from examples.training import console
from examples.training import data as data_lib
from examples.training import runner
from examples.training import settings
from examples.training.run_store import RunStore
# pylint: enable=g-import-not-at-top,wrong-import-position

DEFAULT_VALIDATION_EXAMPLES = 5000
_FIELDS = tuple(f for f in settings.TrainConfig.__dataclass_fields__)
# Chosen by the search itself, or by the data loaded once for every trial.
_NOT_SEARCHED = ('seed', 'validation_examples', 'dataset', 'features',
                 'data_dir', 'data_path', 'public_examples', 'checkpoint_dir',
                 'tensorboard_dir', 'verbose')


def parse_value(text: str) -> Any:
    """'none' -> None, 'true'/'false' -> a bool, else an int, a float or the
    string itself."""
    words = {'none': None, 'true': True, 'false': False}
    if text.lower() in words:
        return words[text.lower()]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_assignment(flag: str, text: str) -> Tuple[str, List[Any]]:
    """'NAME=V1,V2' -> (NAME, [V1, V2]); NAME must be a training flag."""
    name, sep, values = text.partition('=')
    name = name.strip()
    if not sep or not values.strip():
        raise ValueError(f'--{flag} must be NAME=VALUE[,VALUE...]; got '
                         f'{text!r}.')
    if name not in _FIELDS or name in _NOT_SEARCHED:
        raise ValueError(f'--{flag}: {name!r} is not a flag of '
                         'examples/train.py that a search may set (not '
                         f'{", ".join(_NOT_SEARCHED)}).')
    return name, [parse_value(v.strip()) for v in values.split(',')]


def grid_points(grid: Dict[str, List[Any]], budget: Optional[int],
                search_seed: int) -> List[Dict[str, Any]]:
    """The grid's points in a fixed order; at most `budget` of them, drawn
    at random (seeded) when the grid is larger."""
    names = sorted(grid)
    points = [dict(zip(names, values))
              for values in itertools.product(*(grid[n] for n in names))]
    if budget is None or budget >= len(points):
        return points
    if budget < 1:
        raise ValueError(f'--budget must be an integer >= 1; got {budget}.')
    chosen = np.random.default_rng(search_seed).choice(
        len(points), size=budget, replace=False)
    return [points[i] for i in sorted(chosen)]


def point_key(point: Dict[str, Any], seed: int) -> str:
    return json.dumps(dict(point, seed=seed), sort_keys=True)


def median_validation(runs: Sequence[Dict[str, Any]]) -> float:
    return statistics.median(r['validation_accuracy'] for r in runs)


def search(points: Sequence[Dict[str, Any]], *, fixed: Dict[str, Any],
           seeds: Sequence[int], data: data_lib.Data,
           store: RunStore,
           train_fn: Optional[Callable[..., Dict[str, Any]]] = None,
           log=print) -> List[Tuple[Dict[str, Any], List[Dict[str, Any]]]]:
    """Runs every point once per seed (skipping stored runs); returns the
    points with their runs, best median validation accuracy first."""
    train_fn = train_fn or runner.train
    validation = len(data.x_validation)
    for point in points:  # Every point is checked before any step runs.
        settings.check_config(dict(fixed, **point, seed=0,
                                   validation_examples=validation))
    scored = []
    for point in points:
        runs = []
        for seed in seeds:
            key = point_key(point, seed)
            if store.get(key) is None:
                config = dict(fixed, **point, seed=seed, verbose=0,
                              validation_examples=validation)
                result = train_fn(config, data=data, evaluate_test=False)
                result.pop('statement', None)
                store.put(key, result)
            run = store.get(key)
            runs.append(run)
            log(f'{point} seed {seed}: validation accuracy '
                f"{run['validation_accuracy']:.4f}, epsilon "
                f"{run['epsilon']:.3f}, {run['total_steps']} steps, "
                f"{run['train_seconds']:.0f} s")
        scored.append((point, runs))
    scored.sort(key=lambda item: -median_validation(item[1]))
    store.put_entry('best', scored[0][0] if scored else None)
    return scored


def markdown_table(scored) -> str:
    """The points, best first: their settings and validation accuracy."""
    names = sorted({name for point, _ in scored for name in point})
    lines = ['| ' + ' | '.join(names) + ' | noise multiplier | epsilon '
             '| validation accuracy: median | min - max | seeds |',
             '|' + '---|' * (len(names) + 5)]
    for point, runs in scored:
        accuracies = [100.0 * r['validation_accuracy'] for r in runs]
        noise = runs[0]['noise_multiplier']
        noise = (', '.join(f'{z:.3g}' for z in noise)
                 if isinstance(noise, list) else f'{noise:.3g}')
        lines.append(
            '| ' + ' | '.join(f'{point.get(n)}' for n in names)
            + f" | {noise} | {max(r['epsilon'] for r in runs):.3f} "
            f'| {statistics.median(accuracies):.2f} % '
            f'| {min(accuracies):.2f} - {max(accuracies):.2f} % '
            f'| {len(runs)} |')
    return '\n'.join(lines)


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    fv = dict(flag_values=flag_values)
    flags.DEFINE_enum('dataset', 'digits', settings.DATASETS,
                      'Dataset (examples/train.py --dataset).', **fv)
    flags.DEFINE_enum('features', 'none', settings.FEATURES,
                      'Features (examples/train.py --features).', **fv)
    flags.DEFINE_string('data_dir', None, 'examples/train.py --data_dir.',
                        **fv)
    flags.DEFINE_integer('validation_examples', DEFAULT_VALIDATION_EXAMPLES,
                         'Private training examples held out to score the '
                         'trials.', **fv)
    flags.DEFINE_integer('public_examples', 0, 'Training examples held out '
                         'as the public split (hybrid clipping learns its '
                         'basis there), the same for every trial.', **fv)
    flags.DEFINE_multi_string('grid', [], 'NAME=V1,V2,...: a flag of '
                              'examples/train.py and the values to try.',
                              **fv)
    flags.DEFINE_multi_string('set', [], 'NAME=VALUE: a flag of '
                              'examples/train.py fixed for every trial.',
                              **fv)
    flags.DEFINE_integer('budget', None, 'Grid points to try (default: all '
                         'of them).', **fv)
    flags.DEFINE_integer('search_seed', 0, 'Seed of the subset of grid '
                         'points tried when --budget is smaller than the '
                         'grid.', **fv)
    flags.DEFINE_list('seeds', ['0'], 'Training seeds per point.', **fv)
    flags.DEFINE_string('results_json', None, 'File that keeps every '
                        'finished run; a rerun skips the runs it holds.',
                        **fv)


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    console.quiet_known_noise()
    f = flags.FLAGS
    try:
        grid = dict(parse_assignment('grid', g) for g in f.grid)
        fixed = {}
        for text in f.set:
            name, values = parse_assignment('set', text)
            if len(values) != 1:
                raise ValueError(f'--set takes one value; got {text!r}.')
            fixed[name] = values[0]
        overlap = sorted(set(grid) & set(fixed))
        if overlap:
            raise ValueError(f'--grid and --set both name {overlap}.')
        if not grid:
            raise ValueError('give at least one --grid=NAME=V1,V2,...')
        points = grid_points(grid, f.budget, f.search_seed)
        seeds = [int(s) for s in f.seeds]
    except ValueError as e:
        raise app.UsageError(str(e)) from e
    fixed.update(dataset=f.dataset, features=f.features, data_dir=f.data_dir)
    if f.public_examples:  # Only then: the stores of other searches match.
        fixed.update(public_examples=f.public_examples)
    data = data_lib.load_data(f.dataset, data_dir=f.data_dir,
                              features=f.features,
                              validation_examples=f.validation_examples,
                              public_examples=f.public_examples)
    store = RunStore(f.results_json, dict(
        fixed, data_dir=None, validation_examples=f.validation_examples))
    scored = search(points, fixed=fixed, seeds=seeds, data=data, store=store)
    print()
    print(f'{f.dataset} ({f.features} features): {len(data.x_train)} '
          f'training and {len(data.x_validation)} validation examples; '
          f'fixed {fixed}; budget: {len(points)} of '
          f'{int(np.prod([len(v) for v in grid.values()]))} grid points x '
          f'{len(seeds)} seed(s) = {len(points) * len(seeds)} runs.')
    print()
    print(markdown_table(scored))
    print()
    print(f'Best (median validation accuracy): {scored[0][0]}')


if __name__ == '__main__':
    define_flags()
    app.run(main)
