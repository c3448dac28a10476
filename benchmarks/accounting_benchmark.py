"""Accounting speed, measured side by side with dp_accounting in one run.

Prints:
  * epsilon after 10,000 composed steps with the default orders: tf_twice's
    twice-sampling event over dp_accounting's Poisson-subsampled Gaussian
    (target: ratio <= 3);
  * one noise calibration (target: < 2 s);
  * one per-block noise optimisation with 5 blocks (target: < 10 s).

Run: python benchmarks/accounting_benchmark.py [--repeats=5]
"""

import statistics
import time

from absl import app
from absl import flags
import dp_accounting

from tf_twice import accounting
from tf_twice.accounting import rdp as rdp_lib

_REPEATS = flags.DEFINE_integer('repeats', 5, 'Repetitions; medians shown.')

STEPS, DELTA, Q1, Q2, Z = 10_000, 1e-5, 0.01, 0.5, 1.0


def _clear_caches():
    """Every timed call starts cold: no table from an earlier call."""
    rdp_lib._log_binomials.cache_clear()  # pylint: disable=protected-access
    rdp_lib._log_binomial_weights.cache_clear()  # pylint: disable=protected-access


def _timed(function):
    _clear_caches()
    start = time.perf_counter()
    result = function()
    return time.perf_counter() - start, result


def _ours():
    accountant = accounting.TwiceSamplingRdpAccountant()
    accountant.compose(accounting.TwiceSampledGaussianDpEvent(
        Q1, Q2, Z, 1.0, 0.1), STEPS)
    return accountant.get_epsilon(DELTA)


def _dp_accounting():
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(
        Q1, dp_accounting.GaussianDpEvent(Z)), STEPS)
    return accountant.get_epsilon(DELTA)


def _calibration():
    return accounting.calibrate_noise_multiplier(
        target_epsilon=2.0, delta=DELTA, steps=STEPS,
        example_sampling_rate=Q1, coordinate_sampling_rate=Q2,
        linf_norm_clip=0.1)


def _optimisation():
    return accounting.optimize_block_noise(
        target_epsilon=4.0, delta=DELTA, steps=2000,
        example_sampling_rate=Q1, coordinate_sampling_rate=Q2,
        l2_norm_clips=[0.6, 0.3, 0.2, 0.4, 1.0],
        linf_norm_clips=[0.1, 0.05, 0.02, 0.02, 0.01],
        ranks=[250, 500, 1000, 1500, 288_648])


def main(argv):
    del argv
    rows = []
    ours, theirs = [], []
    for _ in range(_REPEATS.value):  # Interleaved, so load hits both alike.
        ours.append(_timed(_ours))
        theirs.append(_timed(_dp_accounting))
    ours_s = statistics.median(t for t, _ in ours)
    theirs_s = statistics.median(t for t, _ in theirs)
    rows.append(('epsilon, 10,000 steps, default orders: tf_twice twice '
                 f'sampling (eps={ours[0][1]:.3f})', ours_s))
    rows.append(('epsilon, same call, dp_accounting Poisson Gaussian '
                 f'(eps={theirs[0][1]:.3f})', theirs_s))
    calibration = [_timed(_calibration) for _ in range(_REPEATS.value)]
    rows.append((f'calibrate_noise_multiplier (z={calibration[0][1]:.4f})',
                 statistics.median(t for t, _ in calibration)))
    optimisation = [_timed(_optimisation) for _ in range(2)]
    rows.append(('optimize_block_noise, 5 blocks',
                 statistics.median(t for t, _ in optimisation)))
    for label, seconds in rows:
        print(f'{label:<72} {seconds * 1e3:9.1f} ms')
    print(f'ratio tf_twice / dp_accounting (target <= 3): '
          f'{ours_s / theirs_s:.2f}')
    print(f'calibration under 2 s: {rows[2][1] < 2.0}; '
          f'5-block optimisation under 10 s: {rows[3][1] < 10.0}')


if __name__ == '__main__':
    app.run(main)
