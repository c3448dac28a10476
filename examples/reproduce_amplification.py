"""Reproduces the paper's simulation of privacy amplification by sampling.

Two figures of Xiao, Wan and Devadas (CCS 2023), section "Simulation on
Privacy Amplification", with l2 clip c2 = 1, l-infinity clip
c_inf = 1/sqrt(d0) and Gaussian noise of standard deviation sigma:

* `amplification_rdp.png`: log eps(alpha) of ONE step against sigma, for
  alpha in {4, 8} (rows) and d0 in {16, 64, 256} (columns);
* `amplification_epsilon_<conversion>.png`: log eps of (eps, delta = 1e-5)-DP
  after T = 10,000 steps against sigma, one panel per d0.

Curves: input-wise (Poisson) sampling at q = 0.005 (dp_accounting's
Poisson-subsampled Gaussian), coordinate-wise sampling alone at q = 0.005
(`twice_sampling_rdp` with q1 = 1, q2 = q: the paper's [COORD] closed form for
integer d0) and twice sampling with q1 * q2 = 0.005 for q2 in {1/2, 1/3, 1/4}.

It also locates the paper's quoted numbers (eps = 8 by twice sampling with
(q1, q2) = (0.01, 1/2) and (0.015, 1/3), where input-wise sampling gives
30.4 and 88.5) and prints ours beside them.

Run: python examples/reproduce_amplification.py [--conversion=basic]
"""

import dataclasses
import math
import os
import time
from typing import Dict, List, Sequence, Tuple

from absl import app
from absl import flags
import dp_accounting
import numpy as np
from scipy import optimize

from tf_twice import accounting

SAMPLING_RATE = 0.005
COORDINATE_RATES = (1 / 2, 1 / 3, 1 / 4)
D0_VALUES = (16, 64, 256)
ALPHAS = (4, 8)
STEPS = 10_000
DELTA = 1e-5
# Integer orders, as in the paper; fractional orders add nothing to twice
# sampling (its RDP at alpha is that of ceil(alpha)).
INTEGER_ORDERS = tuple(range(2, 257))
ORDER_SETS = {
    'integer': INTEGER_ORDERS,
    'dp_accounting': accounting.DEFAULT_ORDERS,
}

# The paper's Fig. (b) (presumably d0 = 64): twice sampling reaches eps = 8
# where input-wise sampling at q = 0.005 gives these epsilons.
PAPER_TARGET_EPSILON = 8.0
PAPER_D0 = 64
PAPER_INPUT_WISE_EPSILON = {1 / 2: 30.4, 1 / 3: 88.5}

RDP_FIGURE = 'amplification_rdp.png'
EPSILON_FIGURE = 'amplification_epsilon_{conversion}.png'


@dataclasses.dataclass(frozen=True)
class Scheme:
    """One sampling scheme: Poisson rate of examples and of coordinates."""
    label: str
    example_sampling_rate: float
    coordinate_sampling_rate: float

    @property
    def input_wise(self) -> bool:
        return self.coordinate_sampling_rate == 1.0


def _fraction(q: float) -> str:
    inverse = 1.0 / q
    if abs(inverse - round(inverse)) < 1e-9:
        return f'1/{round(inverse)}'
    return f'{q:g}'


def sampling_schemes(
        sampling_rate: float = SAMPLING_RATE,
        coordinate_rates: Sequence[float] = COORDINATE_RATES
) -> List[Scheme]:
    """Input-wise, coordinate-wise and twice sampling, all at rate q."""
    schemes = [
        Scheme(f'input-wise q={sampling_rate:g}', sampling_rate, 1.0),
        Scheme(f'coordinate-wise q={sampling_rate:g}', 1.0, sampling_rate),
    ]
    for q2 in coordinate_rates:
        q1 = sampling_rate / q2
        schemes.append(Scheme(f'twice q1={q1:.3g}, q2={_fraction(q2)}',
                              q1, q2))
    return schemes


def input_wise_rdp(orders: Sequence[float], sampling_rate: float,
                   sigma: float) -> np.ndarray:
    """One step of dp_accounting's Poisson-subsampled Gaussian (c2 = 1)."""
    accountant = accounting.TwiceSamplingRdpAccountant(orders)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(
        sampling_rate, dp_accounting.GaussianDpEvent(float(sigma))))
    return accountant.rdp


def scheme_rdp(scheme: Scheme, orders: Sequence[float], sigma: float,
               d0: float) -> np.ndarray:
    """One-step RDP at `orders` with c2 = 1 and c_inf = 1/sqrt(d0)."""
    if scheme.input_wise:
        return input_wise_rdp(orders, scheme.example_sampling_rate, sigma)
    return accounting.twice_sampling_rdp(
        orders, example_sampling_rate=scheme.example_sampling_rate,
        coordinate_sampling_rate=scheme.coordinate_sampling_rate,
        noise_multiplier=float(sigma), l2_norm_clip=1.0,
        linf_norm_clip=1.0 / math.sqrt(d0))


def rdp_curves(schemes: Sequence[Scheme], sigmas: Sequence[float],
               d0_values: Sequence[float], orders: Sequence[float]
               ) -> Dict[Tuple[float, str], np.ndarray]:
    """{(d0, label): one-step RDP, shape (len(sigmas), len(orders))}.

    One accountant call per (scheme, sigma) gives all orders; input-wise
    sampling does not depend on d0 and is computed once.
    """
    curves = {}
    for scheme in schemes:
        shared = None
        for d0 in d0_values:
            if scheme.input_wise and shared is not None:
                curves[(d0, scheme.label)] = shared
                continue
            curve = np.array([scheme_rdp(scheme, orders, s, d0)
                              for s in sigmas])
            curves[(d0, scheme.label)] = curve
            if scheme.input_wise:
                shared = curve
    return curves


def epsilons_after_steps(orders: Sequence[float], rdp: np.ndarray,
                         steps: int, delta: float, conversion: str
                         ) -> Tuple[np.ndarray, np.ndarray]:
    """(epsilon, optimal order) per row of a one-step RDP array."""
    pairs = [accounting.rdp_to_epsilon(orders, steps * row, delta, conversion)
             for row in np.atleast_2d(rdp)]
    return (np.array([eps for eps, _ in pairs]),
            np.array([order for _, order in pairs]))


def order_columns(orders: Sequence[float], alphas: Sequence[float]
                  ) -> List[int]:
    """Positions of `alphas` in `orders`."""
    orders = list(np.asarray(orders, dtype=np.float64))
    missing = [a for a in alphas if float(a) not in orders]
    if missing:
        raise ValueError(f'alphas {missing} are not among the orders.')
    return [orders.index(float(a)) for a in alphas]


def epsilon_of_scheme(scheme: Scheme, sigma: float, d0: float, *,
                      orders: Sequence[float], steps: int, delta: float,
                      conversion: str) -> Tuple[float, float]:
    """(epsilon, optimal order) of `steps` steps of `scheme` at `sigma`."""
    return accounting.rdp_to_epsilon(
        orders, steps * scheme_rdp(scheme, orders, sigma, d0), delta,
        conversion)


def sigma_for_epsilon(scheme: Scheme, target_epsilon: float, d0: float, *,
                      orders: Sequence[float], steps: int, delta: float,
                      conversion: str) -> float:
    """The sigma at which `scheme` reaches `target_epsilon` (c2 = 1)."""
    if not scheme.input_wise:
        return accounting.calibrate_noise_multiplier(
            target_epsilon=target_epsilon, delta=delta, steps=steps,
            example_sampling_rate=scheme.example_sampling_rate,
            coordinate_sampling_rate=scheme.coordinate_sampling_rate,
            l2_norm_clip=1.0, linf_norm_clip=1.0 / math.sqrt(d0),
            orders=orders, conversion=conversion, tolerance=1e-6)

    def gap(log_sigma):
        return epsilon_of_scheme(
            scheme, math.exp(log_sigma), d0, orders=orders, steps=steps,
            delta=delta, conversion=conversion)[0] - target_epsilon

    return math.exp(optimize.brentq(gap, math.log(0.05), math.log(50.0),
                                    xtol=1e-9))


@dataclasses.dataclass(frozen=True)
class PaperComparison:
    """The paper's quoted pair for one twice-sampling scheme and one d0."""
    d0: float
    twice: Scheme
    paper_input_epsilon: float
    sigma_at_target: float  # Where twice sampling gives exactly eps = 8.
    input_epsilon_at_target: float
    sigma_at_paper: float  # Where input-wise gives the paper's epsilon.
    twice_epsilon_at_paper: float


def paper_comparison(d0_values: Sequence[float], *, orders: Sequence[float],
                     conversion: str, steps: int = STEPS,
                     delta: float = DELTA,
                     sampling_rate: float = SAMPLING_RATE
                     ) -> List[PaperComparison]:
    """Our numbers behind the paper's 'eps = 8 versus 30.4 and 88.5'.

    For each d0 and q2 in {1/2, 1/3}: input-wise epsilon at the sigma where
    twice sampling gives exactly 8, and, conversely, twice sampling's epsilon
    at the sigma where input-wise sampling gives the paper's number.
    """
    common = dict(orders=orders, steps=steps, delta=delta,
                  conversion=conversion)
    input_wise = sampling_schemes(sampling_rate, ())[0]
    rows = []
    for d0 in d0_values:
        for q2, paper_epsilon in PAPER_INPUT_WISE_EPSILON.items():
            twice = sampling_schemes(sampling_rate, (q2,))[2]
            sigma_target = sigma_for_epsilon(twice, PAPER_TARGET_EPSILON, d0,
                                             **common)
            sigma_paper = sigma_for_epsilon(input_wise, paper_epsilon, d0,
                                            **common)
            rows.append(PaperComparison(
                d0, twice, paper_epsilon, sigma_target,
                epsilon_of_scheme(input_wise, sigma_target, d0, **common)[0],
                sigma_paper,
                epsilon_of_scheme(twice, sigma_paper, d0, **common)[0]))
    return rows


def _pyplot():
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
    return plt


def _style(label: str) -> dict:
    if label.startswith('input'):
        return dict(color='black', linewidth=2)
    if label.startswith('coordinate'):
        return dict(color='tab:gray', linestyle='--', linewidth=2)
    return dict(linewidth=1.5)


def plot_rdp(path: str, sigmas: Sequence[float],
             curves: Dict[Tuple[float, str], np.ndarray],
             schemes: Sequence[Scheme], d0_values: Sequence[float],
             alphas: Sequence[float], orders: Sequence[float],
             dpi: int = 100) -> None:
    """The 2 x 3 figure: log eps(alpha) against sigma."""
    plt = _pyplot()
    columns = order_columns(orders, alphas)
    fig, axes = plt.subplots(len(alphas), len(d0_values), squeeze=False,
                             figsize=(4.2 * len(d0_values),
                                      3.4 * len(alphas)))
    sigmas = np.asarray(sigmas)
    for i, (alpha, column) in enumerate(zip(alphas, columns)):
        for j, d0 in enumerate(d0_values):
            ax = axes[i, j]
            ax.plot(sigmas, np.log(alpha / (2.0 * sigmas ** 2)), ':',
                    color='tab:red', linewidth=1,
                    label='no sampling: alpha/(2 sigma^2)')
            for scheme in schemes:
                rdp = curves[(d0, scheme.label)][:, column]
                ax.plot(sigmas, np.log(rdp), label=scheme.label,
                        **_style(scheme.label))
            ax.set_title(f'alpha = {alpha:g}, d0 = {d0:g}', fontsize=10)
            ax.set_xlabel('sigma')
            ax.set_ylabel(f'log eps({alpha:g})')
            ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7)
    fig.suptitle('One-step RDP, c2 = 1, c_inf = 1/sqrt(d0), q = q1*q2 = '
                 f'{SAMPLING_RATE:g}', fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def plot_epsilon(path: str, sigmas: Sequence[float],
                 epsilons: Dict[Tuple[float, str], np.ndarray],
                 schemes: Sequence[Scheme], d0_values: Sequence[float],
                 steps: int, delta: float, conversion: str,
                 dpi: int = 100) -> None:
    """The 1 x 3 figure: log eps of (eps, delta)-DP after `steps` steps."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(d0_values), squeeze=False,
                             figsize=(4.2 * len(d0_values), 3.6))
    for j, d0 in enumerate(d0_values):
        ax = axes[0, j]
        for scheme in schemes:
            ax.plot(sigmas, np.log(epsilons[(d0, scheme.label)]),
                    label=scheme.label, **_style(scheme.label))
        ax.axhline(math.log(PAPER_TARGET_EPSILON), color='tab:red',
                   linestyle=':', linewidth=1,
                   label=f'eps = {PAPER_TARGET_EPSILON:g}')
        ax.set_title(f'd0 = {d0:g}', fontsize=10)
        ax.set_xlabel('sigma')
        ax.set_ylabel('log eps')
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(f'(eps, delta={delta:g})-DP after T = {steps:,} steps '
                 f'({conversion} conversion)', fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def parse_positive_floats(text: str, name: str) -> List[float]:
    """Comma-separated positive numbers of flag --`name`, or ValueError."""
    try:
        values = [float(v) for v in text.split(',') if v.strip()]
    except ValueError:
        raise ValueError(f'--{name} must be comma-separated numbers; got '
                         f'{text!r}.') from None
    if not values or any(not (v > 0 and math.isfinite(v)) for v in values):
        raise ValueError(f'--{name} must be positive numbers; got {text!r}.')
    return values


def _print_tables(table_sigmas, schemes, d0_values, alphas, orders,
                  conversion):
    labels = [s.label for s in schemes]
    header = '| d0 | alpha | sigma | ' + ' | '.join(labels) + ' |'
    rule = '|' + '---|' * (3 + len(labels))
    print('\nOne-step RDP eps(alpha):\n')
    print(header)
    print(rule)
    curves = rdp_curves(schemes, table_sigmas, d0_values, orders)
    columns = order_columns(orders, alphas)
    for d0 in d0_values:
        for alpha, column in zip(alphas, columns):
            for i, sigma in enumerate(table_sigmas):
                values = ' | '.join(
                    f'{curves[(d0, label)][i, column]:.3g}'
                    for label in labels)
                print(f'| {d0:g} | {alpha:g} | {sigma:g} | {values} |')
    print(f'\nEpsilon at delta={DELTA:g} after T={STEPS:,} steps '
          f'({conversion} conversion):\n')
    print('| d0 | sigma | ' + ' | '.join(labels) + ' |')
    print('|' + '---|' * (2 + len(labels)))
    for d0 in d0_values:
        epsilons = {label: epsilons_after_steps(
            orders, curves[(d0, label)], STEPS, DELTA, conversion)[0]
                    for label in labels}
        for i, sigma in enumerate(table_sigmas):
            values = ' | '.join(f'{epsilons[label][i]:.3g}'
                                for label in labels)
            print(f'| {d0:g} | {sigma:g} | {values} |')


def _print_paper_comparison(rows: Sequence[PaperComparison],
                            conversion: str) -> None:
    print(f'\nThe paper\'s quoted numbers (its Fig. (b), presumably d0 = '
          f'{PAPER_D0}): '
          f'twice sampling reaches eps = {PAPER_TARGET_EPSILON:g} where '
          f'input-wise q = {SAMPLING_RATE:g} gives the paper\'s value '
          f'({conversion} conversion, T = {STEPS:,}, delta = {DELTA:g}):\n')
    print('| d0 | twice sampling | paper: input-wise eps | sigma (twice eps '
          '= 8) | ours: input-wise eps there | sigma (input-wise eps = '
          'paper\'s) | ours: twice eps there |')
    print('|---|---|---|---|---|---|---|')
    for row in rows:
        print(f'| {row.d0:g} | {row.twice.label} | '
              f'{row.paper_input_epsilon:g} | {row.sigma_at_target:.4f} | '
              f'{row.input_epsilon_at_target:.1f} | '
              f'{row.sigma_at_paper:.4f} | '
              f'{row.twice_epsilon_at_paper:.2f} |')


def main(argv):
    del argv
    flag_values = flags.FLAGS
    if flag_values.num_sigmas < 2:
        raise ValueError(f'--num_sigmas must be >= 2; got '
                         f'{flag_values.num_sigmas}.')
    if not 0 < flag_values.sigma_min < flag_values.sigma_max:
        raise ValueError('need 0 < --sigma_min < --sigma_max; got '
                         f'{flag_values.sigma_min}, {flag_values.sigma_max}.')
    if not 10 <= flag_values.dpi <= 300:
        raise ValueError(f'--dpi must be in [10, 300]; got '
                         f'{flag_values.dpi}.')
    table_sigmas = parse_positive_floats(flag_values.table_sigmas,
                                         'table_sigmas')
    conversion = flag_values.conversion
    orders = ORDER_SETS[flag_values.orders]
    output_dir = flag_values.output_dir
    os.makedirs(output_dir, exist_ok=True)

    start = time.perf_counter()
    sigmas = np.linspace(flag_values.sigma_min, flag_values.sigma_max,
                         flag_values.num_sigmas)
    schemes = sampling_schemes()
    curves = rdp_curves(schemes, sigmas, D0_VALUES, orders)
    epsilons = {key: epsilons_after_steps(orders, rdp, STEPS, DELTA,
                                          conversion)[0]
                for key, rdp in curves.items()}
    rdp_path = os.path.join(output_dir, RDP_FIGURE)
    epsilon_path = os.path.join(output_dir,
                                EPSILON_FIGURE.format(conversion=conversion))
    plot_rdp(rdp_path, sigmas, curves, schemes, D0_VALUES, ALPHAS, orders,
             dpi=flag_values.dpi)
    plot_epsilon(epsilon_path, sigmas, epsilons, schemes, D0_VALUES, STEPS,
                 DELTA, conversion, dpi=flag_values.dpi)
    print(f'Wrote {rdp_path} and {epsilon_path} ({len(sigmas)} sigmas in '
          f'[{sigmas[0]:g}, {sigmas[-1]:g}], {flag_values.orders} orders '
          f'{orders[0]:g}..{orders[-1]:g}).')

    _print_tables(table_sigmas, schemes, D0_VALUES, ALPHAS, orders,
                  conversion)
    _print_paper_comparison(
        paper_comparison(D0_VALUES, orders=orders, conversion=conversion),
        conversion)
    print(f'\nTotal time: {time.perf_counter() - start:.1f} s')


def define_flags() -> None:
    """Flags, defined only when run as a script (the module is importable)."""
    flags.DEFINE_string('output_dir', 'docs/figures',
                        'Where the two PNG figures are written.')
    flags.DEFINE_enum('conversion', 'dp_accounting',
                      ['dp_accounting', 'basic'],
                      'RDP to (eps, delta) conversion: dp_accounting\'s, or '
                      'the basic one the paper used.')
    flags.DEFINE_enum('orders', 'integer', sorted(ORDER_SETS),
                      'RDP orders: integers 2..256 (the paper\'s) or '
                      'dp_accounting\'s default orders.')
    flags.DEFINE_float('sigma_min', 0.2, 'Smallest noise std plotted.')
    flags.DEFINE_float('sigma_max', 1.5, 'Largest noise std plotted.')
    flags.DEFINE_integer('num_sigmas', 40, 'Number of sigmas plotted.')
    flags.DEFINE_string('table_sigmas', '0.4,0.5,0.7,1',
                        'Comma-separated sigmas of the printed tables.')
    flags.DEFINE_integer('dpi', 100, 'Resolution of the PNG files.')


if __name__ == '__main__':
    define_flags()
    app.run(main)
