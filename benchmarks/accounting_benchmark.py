"""Accounting speed, measured side by side with dp_accounting in one run.

Prints:
  * epsilon after 10,000 composed steps at dp_accounting's default orders:
    tf_twice's twice-sampling event (q1 = 0.01, q2 = 0.5, z = 1, c2 = 1,
    c_inf = 0.1) against dp_accounting's RdpAccountant on
    PoissonSampledDpEvent(q1, GaussianDpEvent(z)) (target: ratio <= 1);
  * the same with q2 = 1 and no l-infinity clip, like with like: the RDP
    must equal dp_accounting's at every integer order (checked);
  * one noise calibration (target: <= 0.1 s);
  * one per-block noise optimisation with 5 blocks (target: <= 0.5 s).

Every timed call starts cold (no cached table). Ratios come from paired
rounds (ours, theirs, ours, theirs, ...): one ratio per pair, then the median
of the ratios, so load that changes during the run hits both sides of a pair.

Run: python benchmarks/accounting_benchmark.py [--repeats=9]
"""

import functools
import statistics
import time
from typing import Callable, List, Tuple

from absl import app
from absl import flags
import dp_accounting
import numpy as np

from tf_twice import accounting
from tf_twice.accounting import rdp as rdp_lib

_REPEATS = flags.DEFINE_integer('repeats', 9,
                                'Pairs of rounds (and timed calls) per row.')

STEPS, DELTA, Q1, Q2, Z, C2, CINF = 10_000, 1e-5, 0.01, 0.5, 1.0, 1.0, 0.1


def _clear_caches() -> None:
    """Every timed call starts cold: no table from an earlier call."""
    for value in vars(rdp_lib).values():
        if isinstance(value, functools._lru_cache_wrapper):  # pylint: disable=protected-access
            value.cache_clear()


def _timed(function: Callable[[], object]) -> Tuple[float, object]:
    _clear_caches()
    start = time.perf_counter()
    result = function()
    return time.perf_counter() - start, result


def _ours(q2: float, cinf) -> accounting.TwiceSamplingRdpAccountant:
    accountant = accounting.TwiceSamplingRdpAccountant()
    accountant.compose(accounting.TwiceSampledGaussianDpEvent(
        Q1, q2, Z, C2, cinf), STEPS)
    accountant.get_epsilon(DELTA)
    return accountant


def _dp_accounting() -> dp_accounting.rdp.RdpAccountant:
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(
        Q1, dp_accounting.GaussianDpEvent(Z)), STEPS)
    accountant.get_epsilon(DELTA)
    return accountant


def _paired(ours: Callable[[], object], theirs: Callable[[], object]
            ) -> Tuple[float, float, float, object, object]:
    """(median ours s, median theirs s, median of pair ratios, results)."""
    ours_s: List[float] = []
    theirs_s: List[float] = []
    for _ in range(_REPEATS.value):
        seconds, our_result = _timed(ours)
        ours_s.append(seconds)
        seconds, their_result = _timed(theirs)
        theirs_s.append(seconds)
    ratios = [a / b for a, b in zip(ours_s, theirs_s)]
    return (statistics.median(ours_s), statistics.median(theirs_s),
            statistics.median(ratios), our_result, their_result)


def _check_like_with_like(ours: accounting.TwiceSamplingRdpAccountant,
                          theirs: dp_accounting.rdp.RdpAccountant) -> str:
    """q2 = 1 is dp_accounting's Poisson-subsampled Gaussian (SPEC section 3):
    equal RDP at integer orders; a fractional order gets the next integer
    order's value, so there it is only an upper bound."""
    orders = ours.orders
    their_rdp = theirs._rdp  # pylint: disable=protected-access
    integer = orders == np.round(orders)
    np.testing.assert_allclose(ours.rdp[integer], their_rdp[integer],
                               rtol=1e-9, atol=0)
    assert np.all(ours.rdp >= their_rdp * (1 - 1e-12))
    ours_int = accounting.rdp_to_epsilon(orders[integer],
                                         ours.rdp[integer], DELTA)
    theirs_int = accounting.rdp_to_epsilon(orders[integer],
                                           their_rdp[integer], DELTA)
    assert abs(ours_int[0] / theirs_int[0] - 1) < 1e-9, (ours_int, theirs_int)
    return (f'RDP equal at all {int(integer.sum())} integer orders; epsilon '
            f'at the integer orders: tf_twice {ours_int[0]:.6f}, '
            f'dp_accounting {theirs_int[0]:.6f} (order {ours_int[1]:g}); at '
            f'all default orders: {ours.get_epsilon(DELTA):.6f} vs '
            f'{theirs.get_epsilon(DELTA):.6f} (dp_accounting at fractional '
            f'order {theirs.get_epsilon_and_optimal_order(DELTA)[1]:g})')


def _calibration() -> float:
    return accounting.calibrate_noise_multiplier(
        target_epsilon=2.0, delta=DELTA, steps=STEPS,
        example_sampling_rate=Q1, coordinate_sampling_rate=Q2,
        linf_norm_clip=CINF)


def _optimisation():
    return accounting.optimize_block_noise(
        target_epsilon=4.0, delta=DELTA, steps=2000,
        example_sampling_rate=Q1, coordinate_sampling_rate=Q2,
        l2_norm_clips=[0.6, 0.3, 0.2, 0.4, 1.0],
        linf_norm_clips=[0.1, 0.05, 0.02, 0.02, 0.01],
        ranks=[250, 500, 1000, 1500, 288_648])


def main(argv):
    del argv
    twice = _paired(functools.partial(_ours, Q2, CINF), _dp_accounting)
    like = _paired(functools.partial(_ours, 1.0, None), _dp_accounting)
    agreement = _check_like_with_like(like[3], like[4])
    calibration = [_timed(_calibration) for _ in range(_REPEATS.value)]
    calibration_s = statistics.median(t for t, _ in calibration)
    optimisation = [_timed(_optimisation) for _ in range(3)]
    optimisation_s = statistics.median(t for t, _ in optimisation)

    rows = [
        ('epsilon, 10,000 steps, default orders: tf_twice q2=0.5, c_inf=0.1 '
         f'(eps={twice[3].get_epsilon(DELTA):.3f})', twice[0]),
        ('  paired with dp_accounting Poisson Gaussian '
         f'(eps={twice[4].get_epsilon(DELTA):.3f})', twice[1]),
        ('same call, tf_twice with q2=1, no l-infinity clip '
         f'(eps={like[3].get_epsilon(DELTA):.3f})', like[0]),
        ('  paired with dp_accounting Poisson Gaussian '
         f'(eps={like[4].get_epsilon(DELTA):.3f})', like[1]),
        (f'calibrate_noise_multiplier (z={calibration[0][1]:.4f})',
         calibration_s),
        ('optimize_block_noise, 5 blocks', optimisation_s),
    ]
    for label, seconds in rows:
        print(f'{label:<78} {seconds * 1e3:9.1f} ms')
    print(f'q2=1 agrees with dp_accounting: {agreement}')
    print(f'median of {_REPEATS.value} paired ratios tf_twice / dp_accounting: '
          f'q2=0.5 {twice[2]:.2f} (target <= 1: {twice[2] <= 1.0}); '
          f'q2=1 {like[2]:.2f}')
    print(f'calibration <= 0.1 s: {calibration_s <= 0.1}; 5-block '
          f'optimisation <= 0.5 s: {optimisation_s <= 0.5}')


if __name__ == '__main__':
    app.run(main)
