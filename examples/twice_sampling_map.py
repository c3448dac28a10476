r"""Where twice sampling reduces the noise of DP-SGD: a map from the accountant.

No training: every number here is a noise multiplier calibrated with
`tf_twice.accounting.calibrate_noise_multiplier` to the same (epsilon, delta)
after the same number of steps T, and compared as the per-coordinate noise
variance of the normalised update.

The three mechanisms, all with l2 clip c2 and Poisson sampling of examples:

* twice: (q1, q2)-twice sampling with the l-infinity clip
  c_inf = c2 / sqrt(d0) (default d0 = 100, the paper's); its update is
  (masked sum + N(0, (z_twice c2)^2 I)) / (n q1 q2);
* same batch: standard DP-SGD at the same rate q1 (same expected batch, same
  per-example gradient cost); its update is
  (sum + N(0, (z_q1 c2)^2 I)) / (n q1);
* same contributions: standard DP-SGD at rate q1 q2, the paper's baseline,
  with the same expected number of contributions per coordinate; its update
  is (sum + N(0, (z_q1q2 c2)^2 I)) / (n q1 q2).

All three updates are unbiased estimates of the mean clipped gradient, so
their noise can be compared directly. The per-coordinate noise variances of
the updates give the two ratios in the map:

* ratio_same_batch = (z_twice c2 / (n q1 q2))^2 / (z_q1 c2 / (n q1))^2
                   = (z_twice / (q2 z_q1))^2;
* ratio_same_contributions = (z_twice / z_q1q2)^2, the paper's "noise
  variance ratio" (`tf_twice.accounting.noise_variance_ratio`).

Below 1 (100 %) twice sampling adds less noise to the update. The noise of
the coordinate masks themselves (the update's sampling variance) is not part
of either ratio.

Writes twice_sampling_map.csv and two PNG heat maps (one panel per
(q2, epsilon); x: q1, y: T) into --output_dir, and prints the table.

Run: python examples/twice_sampling_map.py
"""

from __future__ import annotations

import csv
import math
import os
import time
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from absl import app
from absl import flags

from tf_twice import accounting

DELTA = 1e-5
D0 = 100.0
SAMPLING_RATES = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
STEPS = (100, 300, 1000, 3000, 10000)
EPSILONS = (1.0, 2.0, 3.0, 8.0)
COORDINATE_SAMPLING_RATES = (0.5, 0.1)
# Calibrated epsilons lie in [(1 - TOLERANCE) target, target]; the ratios
# are then accurate to about 2 * TOLERANCE / (d log eps / d log z) ~ 0.1 %.
TOLERANCE = 1e-3
# summary() counts a ratio within this of 1 as no difference.
SAME = 0.005

CSV_NAME = 'twice_sampling_map.csv'
COMPARISONS = ('same_batch', 'same_contributions')
FIGURE_NAMES = {c: f'twice_sampling_map_{c}.png' for c in COMPARISONS}
TITLES = {
    'same_batch': 'Twice sampling (q1, q2) vs DP-SGD at q1 (same expected '
                  'batch):\nper-coordinate noise variance of the update, '
                  '(z_twice / (q2 z_q1))^2 in %',
    'same_contributions': 'Twice sampling (q1, q2) vs DP-SGD at q1*q2 (same '
                          'contributions per coordinate):\nper-coordinate '
                          'noise variance of the update, '
                          '(z_twice / z_q1q2)^2 in %',
}

CSV_FIELDS = ('epsilon', 'delta', 'coordinate_sampling_rate',
              'example_sampling_rate', 'steps', 'epochs', 'd0',
              'z_twice', 'z_same_batch', 'z_same_contributions',
              'ratio_same_batch', 'ratio_same_contributions')


class Cell(NamedTuple):
    """One point of the map. A noise multiplier that no calibration gave
    (target unreachable, or met already by the smallest z searched) is NaN,
    and so is every ratio that uses it."""
    epsilon: float
    delta: float
    coordinate_sampling_rate: float
    example_sampling_rate: float
    steps: int
    d0: float
    z_twice: float
    z_same_batch: float
    z_same_contributions: float

    @property
    def epochs(self) -> float:
        return self.steps * self.example_sampling_rate

    @property
    def ratio_same_batch(self) -> float:
        """(z_twice / (q2 z_q1))^2: both updates' per-coordinate noise
        variance, twice sampling's over DP-SGD's at the same q1."""
        return (self.z_twice / (self.coordinate_sampling_rate
                                * self.z_same_batch)) ** 2

    @property
    def ratio_same_contributions(self) -> float:
        """(z_twice / z_q1q2)^2: the same, against DP-SGD at q1 * q2."""
        return (self.z_twice / self.z_same_contributions) ** 2

    def ratio(self, comparison: str) -> float:
        return getattr(self, f'ratio_{comparison}')


def calibrated(*, epsilon: float, delta: float, steps: int, q1: float,
               q2: float, linf_norm_clip: Optional[float],
               conversion: str = 'dp_accounting',
               tolerance: float = TOLERANCE) -> float:
    """The calibrated z for l2 clip 1 (z is scale-free), or NaN when the
    target is unreachable or already met by the smallest z searched."""
    try:
        z = accounting.calibrate_noise_multiplier(
            target_epsilon=epsilon, delta=delta, steps=steps,
            example_sampling_rate=q1, coordinate_sampling_rate=q2,
            l2_norm_clip=1.0, linf_norm_clip=linf_norm_clip,
            conversion=conversion, tolerance=tolerance)
    except ValueError:
        return math.nan
    if z <= accounting.MIN_NOISE_MULTIPLIER:
        return math.nan
    return z


def compute_map(*, sampling_rates: Sequence[float] = SAMPLING_RATES,
                steps: Sequence[int] = STEPS,
                epsilons: Sequence[float] = EPSILONS,
                coordinate_sampling_rates: Sequence[float] = (
                    COORDINATE_SAMPLING_RATES),
                d0: float = D0, delta: float = DELTA,
                conversion: str = 'dp_accounting',
                tolerance: float = TOLERANCE) -> List[Cell]:
    """Every (epsilon, q2, q1, T) of the grid, in that nesting order."""
    linf = 1.0 / math.sqrt(d0)
    standard: Dict[Tuple[float, float, int], float] = {}

    def dpsgd(epsilon: float, q: float, t: int) -> float:
        key = (epsilon, q, t)
        if key not in standard:
            standard[key] = calibrated(epsilon=epsilon, delta=delta,
                                       steps=t, q1=q, q2=1.0,
                                       linf_norm_clip=None,
                                       conversion=conversion,
                                       tolerance=tolerance)
        return standard[key]

    cells = []
    for epsilon in epsilons:
        for q2 in coordinate_sampling_rates:
            for q1 in sampling_rates:
                for t in steps:
                    z_twice = calibrated(epsilon=epsilon, delta=delta,
                                         steps=t, q1=q1, q2=q2,
                                         linf_norm_clip=linf,
                                         conversion=conversion,
                                         tolerance=tolerance)
                    cells.append(Cell(
                        epsilon=float(epsilon), delta=delta,
                        coordinate_sampling_rate=float(q2),
                        example_sampling_rate=float(q1), steps=int(t),
                        d0=float(d0), z_twice=z_twice,
                        z_same_batch=dpsgd(epsilon, q1, t),
                        z_same_contributions=dpsgd(epsilon, q1 * q2, t)))
    return cells


def write_csv(path: str, cells: Iterable[Cell]) -> None:
    with open(path, 'w', newline='') as f:
        writer = csv.writer(f)
        writer.writerow(CSV_FIELDS)
        for cell in cells:
            writer.writerow([f'{getattr(cell, name):.6g}'
                             if isinstance(getattr(cell, name), float)
                             else getattr(cell, name)
                             for name in CSV_FIELDS])


def read_csv(path: str) -> List[Dict[str, float]]:
    """The CSV's rows as {field: float}."""
    with open(path, newline='') as f:
        return [{k: float(v) for k, v in row.items()}
                for row in csv.DictReader(f)]


def _axes_values(cells: Sequence[Cell]):
    epsilons = sorted({c.epsilon for c in cells})
    q2s = sorted({c.coordinate_sampling_rate for c in cells}, reverse=True)
    q1s = sorted({c.example_sampling_rate for c in cells})
    steps = sorted({c.steps for c in cells})
    return epsilons, q2s, q1s, steps


def panel(cells: Sequence[Cell], comparison: str, epsilon: float,
          q2: float) -> List[List[float]]:
    """ratio[i][j] at steps[i] and q1[j] for one (epsilon, q2)."""
    _, _, q1s, steps = _axes_values(cells)
    index = {(c.epsilon, c.coordinate_sampling_rate, c.example_sampling_rate,
              c.steps): c for c in cells}
    return [[index[(epsilon, q2, q1, t)].ratio(comparison)
             if (epsilon, q2, q1, t) in index else math.nan for q1 in q1s]
            for t in steps]


def plot_map(path: str, cells: Sequence[Cell], comparison: str,
             dpi: int = 100) -> None:
    """Heat maps of one ratio: rows q2, columns epsilon; x q1, y T."""
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
    from matplotlib import colors  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top

    epsilons, q2s, q1s, steps = _axes_values(cells)
    values = np.array([c.ratio(comparison) for c in cells], dtype=float)
    finite = values[np.isfinite(values)]
    # A log scale symmetric about 1: a ratio r and 1 / r get opposite
    # colours of the same strength.
    span = max(1.1, *(float(np.max(v)) for v in (finite, 1.0 / finite)
                      if v.size))
    norm = colors.LogNorm(vmin=1.0 / span, vmax=span)
    fig, axes = plt.subplots(len(q2s), len(epsilons), squeeze=False,
                             figsize=(3.3 * len(epsilons) + 1.0,
                                      2.9 * len(q2s) + 0.9))
    image = None
    for i, q2 in enumerate(q2s):
        for j, epsilon in enumerate(epsilons):
            ax = axes[i, j]
            grid = np.array(panel(cells, comparison, epsilon, q2))
            image = ax.imshow(np.ma.masked_invalid(grid), origin='lower',
                              cmap='RdBu_r', norm=norm, aspect='auto')
            for (r, k), value in np.ndenumerate(grid):
                text = '-' if not np.isfinite(value) else f'{100 * value:.0f}'
                ax.text(k, r, text, ha='center', va='center', fontsize=7)
            ax.set_xticks(range(len(q1s)))
            ax.set_xticklabels([f'{q:g}' for q in q1s], rotation=60,
                               fontsize=7)
            ax.set_yticks(range(len(steps)))
            ax.set_yticklabels([f'{t:,}' for t in steps], fontsize=7)
            ax.set_title(f'eps = {epsilon:g}, q2 = {q2:g}', fontsize=9)
            if i == len(q2s) - 1:
                ax.set_xlabel('q1', fontsize=8)
            if j == 0:
                ax.set_ylabel('steps T', fontsize=8)
    d0 = cells[0].d0
    fig.suptitle(f'{TITLES[comparison]}; delta = {cells[0].delta:g}, '
                 f'c_inf = c2/sqrt({d0:g}); blue: twice sampling adds less '
                 'noise', fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.93, 0.95))
    bar = fig.add_axes((0.94, 0.12, 0.012, 0.7))
    ticks = [t for t in (0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0)
             if 1.0 / span <= t <= span]
    colorbar = fig.colorbar(image, cax=bar, ticks=ticks)
    colorbar.ax.set_yticklabels([f'{100 * t:g} %' for t in ticks])
    colorbar.ax.minorticks_off()
    colorbar.ax.tick_params(labelsize=7)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def markdown_tables(cells: Sequence[Cell], comparison: str) -> str:
    """One table (rows T, columns q1; ratios in %) per (q2, epsilon)."""
    epsilons, q2s, q1s, steps = _axes_values(cells)
    blocks = []
    for q2 in q2s:
        for epsilon in epsilons:
            grid = panel(cells, comparison, epsilon, q2)
            lines = [f'{comparison}, q2 = {q2:g}, eps = {epsilon:g} '
                     '(ratio in %; rows T, columns q1)', '',
                     '| T \\ q1 | ' + ' | '.join(f'{q:g}' for q in q1s)
                     + ' |', '|---|' + '---|' * len(q1s)]
            for t, row in zip(steps, grid):
                lines.append(f'| {t:,} | ' + ' | '.join(
                    '-' if not math.isfinite(v) else f'{100 * v:.1f}'
                    for v in row) + ' |')
            blocks.append('\n'.join(lines))
    return '\n\n'.join(blocks)


def summary(cells: Sequence[Cell], comparison: str) -> str:
    """The smallest and largest ratio of a comparison, with their cells."""
    valid = [c for c in cells if math.isfinite(c.ratio(comparison))]
    if not valid:
        return f'{comparison}: no finite ratio.'
    low = min(valid, key=lambda c: c.ratio(comparison))
    high = max(valid, key=lambda c: c.ratio(comparison))

    def where(c: Cell) -> str:
        return (f'{100 * c.ratio(comparison):.1f} % at eps={c.epsilon:g}, '
                f'q2={c.coordinate_sampling_rate:g}, '
                f'q1={c.example_sampling_rate:g}, T={c.steps:,} '
                f'(z_twice={c.z_twice:.4g}, z_q1={c.z_same_batch:.4g}, '
                f'z_q1q2={c.z_same_contributions:.4g})')

    # Ratios within SAME of 1 cannot be told apart from 1 at the
    # calibration tolerance.
    below = sum(c.ratio(comparison) < 1.0 - SAME for c in valid)
    above = sum(c.ratio(comparison) > 1.0 + SAME for c in valid)
    return (f'{comparison}: of {len(valid)} cells, {below} below '
            f'{100 * (1 - SAME):g} %, {above} above {100 * (1 + SAME):g} %, '
            f'{len(valid) - below - above} in between; smallest {where(low)};'
            f' largest {where(high)}.')


def parse_numbers(text: str, name: str, *, integer: bool = False
                  ) -> List[float]:
    """Comma-separated positive numbers of flag --`name`, or ValueError."""
    try:
        values = [(int if integer else float)(v) for v in text.split(',')
                  if v.strip()]
    except ValueError:
        raise ValueError(f'--{name} must be comma-separated '
                         f'{"integers" if integer else "numbers"}; got '
                         f'{text!r}.') from None
    if not values or any(not (v > 0 and math.isfinite(v)) for v in values):
        raise ValueError(f'--{name} must be positive; got {text!r}.')
    return values


def main(argv):
    del argv
    fv = flags.FLAGS
    q1s = parse_numbers(fv.sampling_rates, 'sampling_rates')
    q2s = parse_numbers(fv.coordinate_sampling_rates,
                        'coordinate_sampling_rates')
    if any(q > 1 for q in q1s) or any(q >= 1 for q in q2s):
        raise ValueError('--sampling_rates must be in (0, 1] and '
                         '--coordinate_sampling_rates in (0, 1).')
    steps = [int(t) for t in parse_numbers(fv.steps, 'steps', integer=True)]
    epsilons = parse_numbers(fv.epsilons, 'epsilons')
    if not fv.d0 >= 1:
        raise ValueError(f'--d0 must be >= 1; got {fv.d0}.')
    if not 0 < fv.delta < 1:
        raise ValueError(f'--delta must be in (0, 1); got {fv.delta}.')
    os.makedirs(fv.output_dir, exist_ok=True)

    start = time.perf_counter()
    cells = compute_map(sampling_rates=q1s, steps=steps, epsilons=epsilons,
                        coordinate_sampling_rates=q2s, d0=fv.d0,
                        delta=fv.delta, conversion=fv.conversion)
    elapsed = time.perf_counter() - start
    csv_path = os.path.join(fv.output_dir, CSV_NAME)
    write_csv(csv_path, cells)
    paths = [csv_path]
    for comparison in COMPARISONS:
        path = os.path.join(fv.output_dir, FIGURE_NAMES[comparison])
        plot_map(path, cells, comparison, dpi=fv.dpi)
        paths.append(path)
    print(f'Noise-variance ratios of the update, twice sampling over '
          f'standard DP-SGD at equal (epsilon, delta = {fv.delta:g}) after '
          f'T steps; c_inf = c2 / sqrt({fv.d0:g}), {fv.conversion} '
          'conversion.\n')
    for comparison in COMPARISONS:
        print(markdown_tables(cells, comparison))
        print()
    for comparison in COMPARISONS:
        print(summary(cells, comparison))
    print(f'\n{len(cells)} cells calibrated in {elapsed:.1f} s. Wrote '
          + ', '.join(paths) + '.')


def define_flags() -> None:
    """Flags, defined only when run as a script (the module is importable)."""
    flags.DEFINE_string('output_dir', 'docs/figures',
                        'Where the CSV and the two PNG maps are written.')
    flags.DEFINE_string('sampling_rates',
                        ','.join(f'{q:g}' for q in SAMPLING_RATES),
                        'Comma-separated example sampling rates q1.')
    flags.DEFINE_string('coordinate_sampling_rates',
                        ','.join(f'{q:g}' for q in COORDINATE_SAMPLING_RATES),
                        'Comma-separated coordinate sampling rates q2 < 1.')
    flags.DEFINE_string('steps', ','.join(str(t) for t in STEPS),
                        'Comma-separated step counts T.')
    flags.DEFINE_string('epsilons', ','.join(f'{e:g}' for e in EPSILONS),
                        'Comma-separated target epsilons.')
    flags.DEFINE_float('d0', D0, 'c2^2 / c_inf^2 of twice sampling; the '
                       'paper used 100.')
    flags.DEFINE_float('delta', DELTA, 'Target delta.')
    flags.DEFINE_enum('conversion', 'dp_accounting',
                      ['dp_accounting', 'basic'],
                      'RDP to (eps, delta) conversion: dp_accounting\'s, or '
                      'the basic one the paper used.')
    flags.DEFINE_integer('dpi', 100, 'Resolution of the PNG files.')


if __name__ == '__main__':
    define_flags()
    app.run(main)
