r"""Tables and the accuracy-against-epsilon plot of finished study runs.

`examples/accuracy_study.py --results_json=FILE` keeps every finished run in
FILE; one file holds one set of row settings, so a study whose rows were run
with different settings (e.g. the hybrid row with its own budget split) has
several files. This script trains nothing: it reads the runs of every file
given, groups them by epsilon and row, and prints the study's markdown table
per epsilon (median and range over the seeds present) and, with `--plot`,
draws the study's plot with the published results of `--dataset` marked.

Run (the Fashion-MNIST study of docs/results.md):

  python examples/study_report.py \
    --results_json=docs/figures/fmnist_study.json,docs/figures/fmnist_hybrid_screen_rank8.json \
    --dataset=fashion_mnist --plot=docs/figures/fmnist_accuracy_vs_epsilon.png
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Sequence

if __package__ in (None, ''):
    sys.path.insert(0, os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags

from examples import accuracy_study as study
# pylint: enable=g-import-not-at-top,wrong-import-position

_KEY = re.compile(r'^(?P<row>.+) \| epsilon=(?P<epsilon>[^ ]+) \| '
                  r'seed=(?P<seed>\d+)$')


def load_results(paths: Sequence[str]) -> study.Results:
    """The runs of every results file, as results[epsilon][row] (seed order).

    Raises:
      ValueError: a file that is not a study's results file, or one run
        (row, epsilon, seed) found in two files.
    """
    runs = {}
    for path in paths:
        with open(path, encoding='utf-8') as f:
            saved = json.load(f)
        if not isinstance(saved, dict) or not isinstance(
                saved.get('runs'), dict):
            raise ValueError(f'{path} is not a results file of '
                             'examples/accuracy_study.py (no "runs").')
        for key, run in saved['runs'].items():
            match = _KEY.match(key)
            if match is None:
                raise ValueError(f'{path}: unexpected run key {key!r}.')
            where = (float(match['epsilon']), match['row'],
                     int(match['seed']))
            if where in runs:
                raise ValueError(f'{path}: run {key!r} is also in '
                                 f'{runs[where][0]}; give each row once.')
            runs[where] = (path, run)
    def order(where):  # Epsilon, then the study's row order, then seed.
        epsilon, row, seed = where
        rank = (study.ROWS.index(row) if row in study.ROWS
                else len(study.ROWS))
        return epsilon, rank, row, seed

    results: study.Results = {}
    for where in sorted(runs, key=order):
        epsilon, row, _ = where
        results.setdefault(epsilon, {}).setdefault(row, []).append(
            runs[where][1])
    return results


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    flags.DEFINE_list('results_json', None, 'Results files of '
                      'examples/accuracy_study.py, comma-separated.',
                      flag_values=flag_values)
    flags.DEFINE_string('dataset', None, 'Marks the published results of '
                        f'this dataset ({", ".join(study.PUBLISHED)}).',
                        flag_values=flag_values)
    flags.DEFINE_string('plot', None, 'PNG of accuracy against epsilon.',
                        flag_values=flag_values)
    flags.DEFINE_string('title', '', 'Title of the plot.',
                        flag_values=flag_values)
    flags.mark_flag_as_required('results_json', flag_values=flag_values)


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    f = flags.FLAGS
    try:
        results = load_results(f.results_json)
    except (OSError, ValueError) as e:
        raise app.UsageError(str(e)) from e
    for epsilon in sorted(results):
        print(f'Target epsilon {epsilon:g}:')
        print()
        print(study.markdown_table(results[epsilon]))
        print()
    if f.plot:
        study.plot_accuracy(results, f.plot,
                            published=study.PUBLISHED.get(f.dataset, ()),
                            title=f.title)
        print(f'Plot: {f.plot}')


if __name__ == '__main__':
    define_flags()
    app.run(main)
