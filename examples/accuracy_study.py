r"""Test accuracy at equal epsilon: DP-SGD, twice sampling, hybrid clipping.

Every row trains the same model (examples/train.py) on the same private set
(the training split minus `--public_examples` held-out public examples, which
only hybrid clipping uses) for the same number of steps, with the same
optimiser and global l2 clip, each with its noise calibrated to the same
(epsilon, delta), for every epsilon of `--target_epsilons`. Rows:

* `dpsgd q=q1`: standard DP-SGD with Poisson sampling at the expected batch
  size B of the twice-sampling rows;
* `dpsgd q=q1*q2`: standard DP-SGD at batch B * q2, the paper's baseline:
  the same expected number of contributions per coordinate as twice
  sampling (the update is divided by n * q1 * q2 in both);
* `twice`: (q1, q2)-twice sampling with l-infinity clip c2 / sqrt(d0);
* `hybrid`: the paper's hybrid clipping: twice sampling with a basis of
  rank `--ranks` learned from the public split (in `--parameter_groups`
  groups, refreshed every `--basis_refresh_steps` steps), every block
  masked at q2, and per-block clips and noise from
  `tf_twice.hybrid.plan_blocks` (the l2 budget split by `--budget_split`,
  `--budget_quantile`; principal blocks' l-infinity clip per
  `--principal_d0`);
* by name only (`--rows`), hybrid's variants: `hybrid unmasked` (principal
  blocks without masks, the library's default: examples/train.py
  --mode=hybrid), `hybrid replanned` (budgets re-split at every basis
  refresh, --replan_budgets), `hybrid unmasked replanned` (both) and
  `hybrid by progress` (keep rate of the principal blocks and noise
  objective chosen by public one-step progress, --plan_by_progress,
  budgets re-planned).

Tuned rows (`--tuned=NAME=FILE`, from examples/tune.py): the row NAME (one
of the above, or a new one) takes the settings the search fixed and the best
point it found on its validation split; every such row should come from a
search with the same budget. `--features=scattering` trains every row on
ScatterNet features; the dataset's recipe (examples/training/recipes.py)
gives every shared setting not set by a flag.

Each row runs once per seed and epsilon; the tables give the median test
accuracy, its range over the seeds, the noise multiplier(s) and the epsilon
the privacy ledger reports. `--plot` draws accuracy against epsilon, with the
published results for the dataset marked.

Long studies: with `--results_json`, every finished run is written to that
file at once and a rerun with the same settings skips the runs it holds, so a
study can be run in parts (one epsilon, seed or a few rows per invocation, or
after an interruption; a row's name keeps its settings), and the tables and
plot cover every stored run of the rows asked for.

Run: python examples/accuracy_study.py   (digits, about 6 minutes)
Fashion-MNIST (Debian package dataset-fashion-mnist), Tramer & Boneh's
setting: see docs/results.md for the command.

The console is kept as quiet as examples/train.py keeps it (TensorFlow's C++
log and a few known notes hidden; set TF_CPP_MIN_LOG_LEVEL to see the log).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

if __package__ in (None, ''):
    # Run as `python examples/accuracy_study.py`: Python puts examples/ on
    # the path, not the repository root that holds the `examples` package.
    sys.path.insert(0, os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags

from examples.training import console
from examples.training import data as data_lib
from examples.training import recipes
from examples.training import runner
from examples.training.run_store import RunStore
from examples.training import settings as settings_lib
from tf_twice import sampling
# pylint: enable=g-import-not-at-top,wrong-import-position

ROWS = ('dpsgd q=q1', 'dpsgd q=q1*q2', 'twice', 'hybrid')
# Hybrid's rows: whether the principal blocks are masked at q2 (the paper's
# algorithm; 'q2') or unmasked (1.0, the library's default) and what else
# each adds. The variants run when --rows names them.
HYBRID_ROWS = {
    'hybrid': dict(principal_coordinate_sampling_rate='q2'),
    'hybrid unmasked': dict(principal_coordinate_sampling_rate=1.0),
    'hybrid replanned': dict(principal_coordinate_sampling_rate='q2',
                             replan_budgets=True),
    'hybrid unmasked replanned': dict(principal_coordinate_sampling_rate=1.0,
                                      replan_budgets=True),
    # --plan_by_progress chooses the principal keep rate itself.
    'hybrid by progress': dict(plan_by_progress=True, replan_budgets=True),
}

# Published test accuracies (label, epsilon, accuracy %) at delta = 1e-5,
# marked on the plot for comparison.
PUBLISHED = {
    'fashion_mnist': (
        ('Tramer & Boneh (ICLR 2021), tanh CNN', 3.0, 86.0),
        ('Papernot et al. (AAAI 2021), tempered sigmoids', 3.0, 86.1),
        ('Tramer & Boneh (ICLR 2021), ScatterNet + linear', 3.0, 89.7),
    ),
}

# One study's results: results[epsilon][row] is the list of runs (seeds).
Results = Dict[float, Dict[str, List[Dict[str, Any]]]]


def row_configs(*, batch_size: float, coordinate_sampling_rate: float,
                d0: float, ranks: Sequence[int], basis_refresh_steps: int,
                rows: Sequence[str] = ROWS,
                budget_split: str = settings_lib.TrainConfig.budget_split,
                budget_quantile: Optional[float] = None,
                noise_objective: str = (
                    settings_lib.TrainConfig.noise_objective),
                principal_d0: float = settings_lib.TrainConfig.principal_d0,
                parameter_groups: int = (
                    settings_lib.TrainConfig.parameter_groups)
                ) -> Dict[str, Dict[str, Any]]:
    """The settings that differ between rows (see the module docstring).

    The hybrid rows name `budget_split`, `budget_quantile`,
    `noise_objective`, `principal_d0` and `parameter_groups` only when they
    are not the defaults, so that a --results_json written before these
    flags existed still has this study's settings. Their principal keep
    rate is named unless --plan_by_progress chooses it (HYBRID_ROWS): its
    default changed, and a stored row keeps what it ran.
    """
    q2 = coordinate_sampling_rate
    split = settings_lib.TrainConfig(mode='hybrid', budget_split=budget_split,
                                     budget_quantile=budget_quantile,
                                     noise_objective=noise_objective)
    settings_lib.check_budget_split(split)
    settings_lib.check_noise_objective(split)
    hybrid_extra: Dict[str, Any] = {}
    if principal_d0 != settings_lib.TrainConfig.principal_d0:
        hybrid_extra['principal_d0'] = settings_lib.check_at_least_one(
            'principal_d0', principal_d0)
    if parameter_groups != settings_lib.TrainConfig.parameter_groups:
        hybrid_extra['parameter_groups'] = settings_lib.check_integer(
            'parameter_groups', parameter_groups, 1)
    every = {
        'dpsgd q=q1': dict(mode='dpsgd', batch_size=batch_size),
        'dpsgd q=q1*q2': dict(mode='dpsgd', batch_size=batch_size * q2),
        'twice': dict(mode='twice', batch_size=batch_size,
                      coordinate_sampling_rate=q2, d0=d0),
    }
    hybrid = dict(mode='hybrid', batch_size=batch_size,
                  coordinate_sampling_rate=q2, d0=d0, ranks=tuple(ranks),
                  basis_refresh_steps=basis_refresh_steps,
                  **settings_lib.budget_split_settings(split), **hybrid_extra)
    for name, extra in HYBRID_ROWS.items():
        every[name] = dict(hybrid, **extra)
        if extra.get('principal_coordinate_sampling_rate') == 'q2':
            every[name]['principal_coordinate_sampling_rate'] = q2
    unknown = [row for row in rows if row not in every]
    if unknown:
        raise ValueError(f'--rows must be among {", ".join(every)}; got '
                         f'{unknown}.')
    return {row: every[row] for row in rows}


def rows_from_flags(f, batch_size: float) -> Dict[str, Dict[str, Any]]:
    """The rows `--rows` and `--tuned` name, at expected batch size B."""
    try:
        configs = row_configs(
            batch_size=batch_size,
            coordinate_sampling_rate=f.coordinate_sampling_rate, d0=f.d0,
            ranks=[int(r) for r in f.ranks],
            basis_refresh_steps=f.basis_refresh_steps, rows=f.rows,
            budget_split=f.budget_split, budget_quantile=f.budget_quantile,
            noise_objective=f.noise_objective, principal_d0=f.principal_d0,
            parameter_groups=f.parameter_groups)
        configs.update(tuned_rows(f.tuned))
    except (ValueError, OSError) as e:
        raise app.UsageError(str(e)) from e
    return configs


def tuned_rows(tuned: Sequence[str]) -> Dict[str, Dict[str, Any]]:
    """Rows from examples/tune.py result files, `NAME=FILE` each: the
    settings the search fixed (less the data, shared by the study) and its
    best point."""
    rows = {}
    for text in tuned:
        name, sep, path = text.partition('=')
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f'--tuned must be NAME=FILE; got {text!r}.')
        with open(path.strip(), encoding='utf-8') as f:
            saved = json.load(f)
        if not saved.get('best'):
            raise ValueError(f'--tuned={text}: {path} holds no finished '
                             'search (no best point).')
        fixed = {k: v for k, v in saved['settings'].items()
                 if k not in ('dataset', 'features', 'data_dir',
                              'validation_examples')}
        rows[name.strip()] = dict(fixed, **saved['best'])
    return rows


def run_study(configs: Dict[str, Dict[str, Any]], *, seeds: Sequence[int],
              target_epsilons: Sequence[float], common: Dict[str, Any],
              public_examples: int, data=None,
              store: Optional[RunStore] = None,
              train_fn: Optional[Callable[..., Dict[str, Any]]] = None,
              log=print) -> Results:
    """Trains every row once per epsilon and seed (runs already in `store`
    are reused); returns the results per epsilon and row."""
    if data is None:
        data = data_lib.load_data(common.get('dataset', 'digits'),
                                  data_dir=common.get('data_dir'),
                                  features=common.get('features', 'none'),
                                  public_examples=public_examples)
    store = store or RunStore(None, {})
    train_fn = train_fn or runner.train
    results: Results = {}
    for epsilon in target_epsilons:
        results[epsilon] = {row: [] for row in configs}
        for seed in seeds:
            for row, overrides in configs.items():
                key = RunStore.key(row, epsilon, seed)
                result = store.get(key)
                if result is None:
                    config = dict(common)
                    if 'epochs' in overrides:  # A tuned schedule.
                        config.pop('steps', None)
                    config.update(overrides)
                    # The study's axes, last: a tuned row's search fixed
                    # its own epsilon (and seeds), which must not win.
                    config.update(seed=seed, public_examples=public_examples,
                                  target_epsilon=epsilon)
                    result = train_fn(config, data=data)
                    result.pop('statement', None)
                    store.put(key, result)
                    done = 'ran'
                else:
                    done = 'from --results_json'
                results[epsilon][row].append(result)
                log(f'{row:>14}  epsilon {epsilon:g}  seed {seed}: test '
                    f"accuracy {result['test_accuracy']:.4f}, epsilon "
                    f"{result['epsilon']:.3f}, "
                    f"{result['train_seconds']:.0f} s ({done})")
    return results


def _number_or_list(value) -> str:
    """A setting that is one number or one per block (a list)."""
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
            f"| {_number_or_list(first['coordinate_sampling_rate'])} "
            f"| {_number_or_list(first['noise_multiplier'])} "
            f"| {max(r['epsilon'] for r in runs):.3f} "
            f"| {first['total_steps']} "
            f'| {statistics.median(accuracies):.1f} % '
            f'| {min(accuracies):.1f} - {max(accuracies):.1f} % '
            f'| {len(runs)} |')
    return '\n'.join(lines)


def _median_and_range(runs: List[Dict[str, Any]]) -> Tuple[float, ...]:
    accuracies = [100.0 * r['test_accuracy'] for r in runs]
    return (statistics.median(accuracies), min(accuracies), max(accuracies))


def plot_accuracy(results: Results, path: str, *,
                  published: Sequence[Tuple[str, float, float]] = (),
                  title: str = '') -> None:
    """Median test accuracy (bars: min - max over seeds) against epsilon,
    one line per row, published results as stars; written to `path`."""
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use('Agg')
    from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
    epsilons = sorted(results)
    rows = [row for row in dict.fromkeys(
        row for e in epsilons for row in results[e]) if any(
            results[e].get(row) for e in epsilons)]
    fig, ax = plt.subplots(figsize=(9.0, 4.4))
    for row in rows:
        points = [(e, *_median_and_range(results[e][row]))
                  for e in epsilons if results[e].get(row)]
        x = [p[0] for p in points]
        median = [p[1] for p in points]
        ax.errorbar(x, median, yerr=[[p[1] - p[2] for p in points],
                                     [p[3] - p[1] for p in points]],
                    marker='o', capsize=3, label=row)
    for label, epsilon, accuracy in published:
        ax.plot([epsilon], [accuracy], marker='*', markersize=12,
                linestyle='none', label=f'{label}: {accuracy:g} %')
    ax.set_xscale('log')
    ax.minorticks_off()
    ax.set_xticks(epsilons)
    ax.set_xticklabels([f'{e:g}' for e in epsilons])
    ax.set_xlabel('epsilon (delta = 1e-5)' if all(
        r['delta'] == 1e-5 for e in epsilons for runs in results[e].values()
        for r in runs) else 'epsilon')
    ax.set_ylabel('test accuracy (%)')
    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    # Outside the axes: inside, it hides points or the published marks.
    ax.legend(fontsize=8, loc='upper left', bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    fv = dict(flag_values=flag_values)
    flags.DEFINE_list('seeds', ['0', '1', '2', '3', '4'], 'Seeds per row.',
                      **fv)
    flags.DEFINE_list('rows', list(ROWS), 'Rows to run.', **fv)
    flags.DEFINE_list('target_epsilons', ['4'], 'Epsilons; every row runs '
                      'at each.', **fv)
    flags.DEFINE_enum('dataset', 'digits', ['digits', 'fashion_mnist'],
                      'Dataset (examples/train.py --dataset).', **fv)
    flags.DEFINE_string('data_dir', None, 'Directory of the dataset files '
                        '(examples/train.py --data_dir).', **fv)
    flags.DEFINE_enum('features', 'none', settings_lib.FEATURES,
                      'Features (examples/train.py --features).', **fv)
    flags.DEFINE_multi_string('tuned', [], 'NAME=FILE: the row NAME takes '
                              'the best setting of an examples/tune.py '
                              'search (a new NAME adds a row).', **fv)
    flags.DEFINE_string('model', None, 'Model (examples/train.py --model; '
                        "default: the recipe's).", **fv)
    flags.DEFINE_float('epochs', None, 'Epochs (1/q1 steps each) of the '
                       'twice-sampling rows; every row runs as many steps '
                       "(default: the recipe's).", **fv)
    flags.DEFINE_integer('steps', None, 'Steps of every row (instead of '
                         '--epochs).', **fv)
    flags.DEFINE_float('momentum', None, "SGD momentum (default: the "
                       "recipe's).", **fv)
    flags.DEFINE_integer('physical_batch_size', None, 'Examples per '
                         'vectorized chunk (speed and memory only; default: '
                         "the recipe's).", **fv)
    flags.DEFINE_string('results_json', None, 'File that keeps every '
                        'finished run; a rerun skips the runs it holds.',
                        **fv)
    flags.DEFINE_string('plot', None, 'PNG of accuracy against epsilon.',
                        **fv)
    flags.DEFINE_float('batch_size', None, "Expected batch size B (default: "
                       "the recipe's).", **fv)
    flags.DEFINE_float('coordinate_sampling_rate', 0.5, 'q2.', **fv)
    flags.DEFINE_float('d0', 100, 'c_inf = c2 / sqrt(d0) (twice, and the '
                       'residual of hybrid).', **fv)
    flags.DEFINE_float('learning_rate', None, "SGD learning rate (default: "
                       "the recipe's).", **fv)
    flags.DEFINE_float('l2_norm_clip', None, "Global l2 clip (default: the "
                       "recipe's).", **fv)
    flags.DEFINE_integer('public_examples', 200, 'Held-out public examples '
                         '(removed from every row\'s private set).', **fv)
    flags.DEFINE_list('ranks', ['16'], 'Hybrid principal ranks.', **fv)
    flags.DEFINE_integer('basis_refresh_steps', 20, 'Hybrid basis refresh.',
                         **fv)
    flags.DEFINE_enum('budget_split', settings_lib.TrainConfig.budget_split,
                      list(settings_lib.BUDGET_SPLITS), 'Hybrid: how the '
                      'global l2 budget is split over blocks '
                      '(examples/train.py --budget_split).', **fv)
    flags.DEFINE_float('budget_quantile', None, 'Hybrid, '
                       '--budget_split=quantile: the public norm quantile '
                       '(examples/train.py --budget_quantile).', **fv)
    flags.DEFINE_enum('noise_objective',
                      settings_lib.TrainConfig.noise_objective,
                      list(settings_lib.NOISE_OBJECTIVES), 'Hybrid: what '
                      'the per-block noise minimises (examples/train.py '
                      '--noise_objective).', **fv)
    flags.DEFINE_float('principal_d0', settings_lib.TrainConfig.principal_d0,
                       'Hybrid: l-infinity clip c2_j / sqrt(min('
                       'principal_d0, r_j)) of the principal blocks '
                       '(examples/train.py --principal_d0).', **fv)
    flags.DEFINE_integer('parameter_groups',
                         settings_lib.TrainConfig.parameter_groups,
                         'Hybrid: parameter groups of the basis '
                         '(examples/train.py --parameter_groups).', **fv)


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    console.quiet_known_noise()
    f = flags.FLAGS
    recipe = recipes.recipe_for(f.dataset, f.features)
    pick = lambda value, default: default if value is None else value
    batch_size = pick(f.batch_size, recipe.batch_size)
    try:
        seeds = [int(s) for s in f.seeds]
        epsilons = [float(e) for e in f.target_epsilons]
    except ValueError as e:
        raise app.UsageError(str(e)) from e
    configs = rows_from_flags(f, batch_size)
    data = data_lib.load_data(f.dataset, data_dir=f.data_dir,
                              features=f.features,
                              public_examples=f.public_examples)
    n = len(data.x_train)
    if f.steps is not None:
        steps = int(f.steps)
    else:  # Every row runs the steps of the twice-sampling rows' epochs.
        steps_per_epoch = sampling.poisson_schedule(
            n, expected_batch_size=batch_size).steps_per_epoch
        steps = int(round(pick(f.epochs, recipe.epochs) * steps_per_epoch))
    model = pick(f.model, recipe.model)
    learning_rate = pick(f.learning_rate, recipe.learning_rate)
    momentum = pick(f.momentum, recipe.momentum)
    l2_norm_clip = pick(f.l2_norm_clip, recipe.l2_norm_clip)
    common = dict(dataset=f.dataset, data_dir=f.data_dir, model=model,
                  steps=steps, learning_rate=learning_rate,
                  momentum=momentum, l2_norm_clip=l2_norm_clip,
                  physical_batch_size=pick(f.physical_batch_size,
                                           recipe.physical_batch_size),
                  verbose=0)
    if f.features != 'none':  # Stored studies without features stay valid.
        common['features'] = f.features
    # What a stored run must share with this invocation to be reused.
    settings = dict(common, data_dir=None, public_examples=f.public_examples,
                    rows={row: configs[row] for row in configs})
    store = RunStore(f.results_json, settings, union_key='rows')
    start = time.time()
    results = run_study(configs, seeds=seeds, target_epsilons=epsilons,
                        common=common, public_examples=f.public_examples,
                        data=data, store=store)
    first = results[epsilons[0]][next(iter(configs))][0]
    summary = (
        f'{f.dataset}: {n} private training examples, {f.public_examples} '
        f'public (hybrid only), {len(data.x_test)} test; {model}; '
        f'{steps} steps; SGD learning rate {learning_rate:g}, momentum '
        f'{momentum:g}; l2 clip {l2_norm_clip:g} (tuned rows: their own); '
        'delta '
        f"{first['delta']:g}; seeds {seeds}.")
    print()
    print(summary)
    for epsilon in epsilons:
        print()
        print(f'Target epsilon {epsilon:g}:')
        print()
        print(markdown_table(results[epsilon]))
    if f.plot:
        plot_accuracy(results, f.plot, published=PUBLISHED.get(f.dataset, ()),
                      title=f'{f.dataset}, {model}, {steps} steps')
        print()
        print(f'Plot: {f.plot}')
    print()
    print(f'Total time: {time.time() - start:.0f} s.')


if __name__ == '__main__':
    define_flags()
    app.run(main)
