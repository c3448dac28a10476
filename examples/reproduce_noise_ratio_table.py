"""Reproduces the noise-variance ratios of the paper's CIFAR-10 table.

Xiao, Wan and Devadas (CCS 2023), table "pure twice sampling" (ResNet22 on
CIFAR-10, delta = 1e-5): l2 clip with an extra l-infinity clip at
c_inf = c2 / sqrt(d0), d0 = 100, and (q1, q2)-twice sampling against
input-wise (Poisson) sampling at q = q1 * q2. For each epsilon in
{2, 2.5, 4, 8} run for T in {1500, 2000, 2500, 5000} steps, the bracketed
number is the noise variance of twice sampling over that of input-wise
sampling, both calibrated to (epsilon, delta) after T steps.

Each ratio is computed with `tf_twice.accounting.noise_variance_ratio`, once
with the basic RDP conversion the paper used and once with dp_accounting's,
and printed as a markdown table beside the paper's values.

Run: python examples/reproduce_noise_ratio_table.py
"""

import math
import time
from typing import Dict, List, Optional, Sequence, Tuple

from absl import app
from absl import flags

from tf_twice import accounting

DELTA = 1e-5
D0 = 100
# The table's columns: (epsilon, steps T).
COLUMNS = ((2.0, 1500), (2.5, 2000), (4.0, 2500), (8.0, 5000))
# Its rows: (q1, q2).
ROWS = ((0.06, 1 / 3), (0.04, 1 / 2), (0.03, 1 / 3), (0.02, 1 / 2))
# The bracketed noise-variance ratios (%) of the CIFAR-10 table, by row.
PAPER_RATIOS = {
    (0.06, 1 / 3): (86.2, 85.4, 82.2, 70.8),
    (0.04, 1 / 2): (89.4, 88.2, 77.4, 75.1),
    (0.03, 1 / 3): (67.4, 65.9, 53.2, 43.3),
    (0.02, 1 / 2): (72.8, 71.6, 61.0, 53.5),
}
CONVERSIONS = ('basic', 'dp_accounting')

Cell = Tuple[Tuple[float, float], Tuple[float, int]]


def noise_ratio(q1: float, q2: float, epsilon: float, steps: int, *,
                d0: float = D0, delta: float = DELTA,
                conversion: str = 'basic') -> float:
    """Twice-sampling noise variance over input-wise at q1*q2 (a fraction)."""
    return accounting.noise_variance_ratio(
        target_epsilon=epsilon, delta=delta, steps=steps,
        example_sampling_rate=q1, coordinate_sampling_rate=q2,
        l2_norm_clip=1.0, linf_norm_clip=1.0 / math.sqrt(d0),
        conversion=conversion)


def ratio_table(rows: Sequence[Tuple[float, float]] = ROWS,
                columns: Sequence[Tuple[float, int]] = COLUMNS, *,
                d0: float = D0, delta: float = DELTA,
                conversions: Sequence[str] = CONVERSIONS
                ) -> Dict[str, Dict[Cell, float]]:
    """{conversion: {((q1, q2), (epsilon, T)): ratio}}."""
    return {
        conversion: {
            (row, column): noise_ratio(*row, *column, d0=d0, delta=delta,
                                       conversion=conversion)
            for row in rows for column in columns
        }
        for conversion in conversions
    }


def _rate(q: float) -> str:
    inverse = 1.0 / q
    if abs(inverse - round(inverse)) < 1e-9 and inverse > 1:
        return f'1/{round(inverse)}'
    return f'{q:g}'


def markdown_table(table: Dict[str, Dict[Cell, float]],
                   rows: Sequence[Tuple[float, float]] = ROWS,
                   columns: Sequence[Tuple[float, int]] = COLUMNS,
                   paper: Dict[Tuple[float, float],
                               Sequence[float]] = PAPER_RATIOS) -> str:
    """Ratios in %, one line per (q1, q2) and source: paper, then ours.

    `paper` rows hold one value per entry of COLUMNS.
    """
    conversions = list(table)
    lines = ['| (q1, q2) | source | ' + ' | '.join(
        f'eps={eps:g}, T={steps}' for eps, steps in columns) + ' |',
             '|---|---|' + '---|' * len(columns)]
    for row in rows:
        name = f'({row[0]:g}, {_rate(row[1])})'
        if row in paper:
            values = [paper_value(paper, row, column) for column in columns]
            lines.append(f'| {name} | paper | ' + ' | '.join(
                '-' if value is None else f'{value:.1f}'
                for value in values) + ' |')
        for conversion in conversions:
            lines.append(f'| {name} | ours, {conversion} | ' + ' | '.join(
                f'{100 * table[conversion][(row, column)]:.1f}'
                for column in columns) + ' |')
    return '\n'.join(lines)


def paper_value(paper: Dict[Tuple[float, float], Sequence[float]],
                row: Tuple[float, float],
                column: Tuple[float, int]) -> Optional[float]:
    """The paper's ratio (%) for a cell, None where it gives none."""
    if row not in paper or column not in COLUMNS:
        return None
    return paper[row][COLUMNS.index(column)]


def agreement(table: Dict[str, Dict[Cell, float]],
              paper: Dict[Tuple[float, float],
                          Sequence[float]] = PAPER_RATIOS
              ) -> Dict[str, Tuple[float, float]]:
    """{conversion: (mean, max) |ours - paper| in percentage points}."""
    summary = {}
    for conversion, cells in table.items():
        gaps = [abs(100 * ratio - paper_value(paper, row, column))
                for (row, column), ratio in cells.items()
                if paper_value(paper, row, column) is not None]
        if gaps:
            summary[conversion] = (sum(gaps) / len(gaps), max(gaps))
    return summary


def parse_conversions(text: str) -> List[str]:
    """The comma-separated names of --conversions, or ValueError."""
    names = [name.strip() for name in text.split(',') if name.strip()]
    if not names:
        raise ValueError('--conversions must name at least one conversion.')
    for name in names:
        if name not in CONVERSIONS:
            raise ValueError(f'--conversions: {name!r} is not one of '
                             f'{", ".join(CONVERSIONS)}.')
    return names


def main(argv):
    del argv
    flag_values = flags.FLAGS
    conversions = parse_conversions(flag_values.conversions)
    if not flag_values.d0 >= 1:
        raise ValueError(f'--d0 must be >= 1; got {flag_values.d0}.')
    if not 0 < flag_values.delta < 1:
        raise ValueError(f'--delta must be in (0, 1); got '
                         f'{flag_values.delta}.')
    start = time.perf_counter()
    table = ratio_table(d0=flag_values.d0, delta=flag_values.delta,
                        conversions=conversions)
    paper = PAPER_RATIOS if (flag_values.d0 == D0
                             and flag_values.delta == DELTA) else {}
    print(f'Noise-variance ratio (%) of (q1, q2)-twice sampling over '
          f'input-wise sampling at q1*q2, d0 = {flag_values.d0:g}, '
          f'delta = {flag_values.delta:g}:\n')
    print(markdown_table(table, paper=paper))
    for conversion, (mean, worst) in agreement(table, paper).items():
        print(f'\n{conversion} conversion against the paper: mean |gap| '
              f'{mean:.1f}, max {worst:.1f} percentage points.')
    print(f'\nTotal time: {time.perf_counter() - start:.1f} s')


def define_flags() -> None:
    """Flags, defined only when run as a script (the module is importable)."""
    flags.DEFINE_float('d0', D0, 'c2^2 / c_inf^2; the paper used 100.')
    flags.DEFINE_float('delta', DELTA, 'Target delta.')
    flags.DEFINE_string('conversions', ','.join(CONVERSIONS),
                        'Comma-separated RDP to (eps, delta) conversions: '
                        'basic (the paper\'s) and/or dp_accounting.')


if __name__ == '__main__':
    define_flags()
    app.run(main)
