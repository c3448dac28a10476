"""Renyi DP of one step of twice sampling with (hybrid) l2 + l-infinity clipping.

Notation follows Xiao, Wan and Devadas, "Geometry of Sensitivity: Twice
Sampling and Hybrid Clipping in Differential Privacy with Optimal Gaussian
Noise", CCS 2023, doi:10.1145/3576915.3623142. Theorems by title: [COORD]
"Privacy Amplification of Coordinate-Wise Sampling", [TWICE] "Privacy
Amplification from Twice Sampling".

* Coordinate-wise sampling at rate q2 of one coordinate of size s under
  Gaussian noise sigma has, for integer v >= 0,
      M(v, a) = sum_{l=0..v} C(v,l) (1-q2)^(v-l) q2^l exp(l(l-1) a),
  with a = s^2 / (2 sigma^2); M(v, a) = E_P[(Q/P)^v] of the pair
  P = N(0, sigma^2), Q = (1-q2) P + q2 N(s, sigma^2).
* Block j's dominating sensitivity is n_j coordinates at c_inf_j plus one at
  c'_j ([COORD] and the remark after it), so with L(v) = (v-1) eps0(v),
      L(v) = sum_j [ n_j log M(v, c_inf_j^2/(2 sigma_j^2))
                     + log M(v, c'_j^2/(2 sigma_j^2)) ].
* Twice sampling ([TWICE]), integer alpha >= 2:
      eps(alpha) = log( sum_{v=0..alpha} C(alpha,v) (1-q1)^(alpha-v) q1^v
                        exp(L(v)) ) / (alpha - 1).

For integer alpha this equals D_alpha(Q || P) of the dominating pair
P = N(0, sigma^2 I), Q = (1-q1) P + q1 prod_l [(1-q2) N(0) + q2 N(s_l)]
(expand ((1-q1) + q1 prod_l Q_l/P)^alpha and use independence across
coordinates), so it is exact, not a bound. A fractional order uses the next
integer order: Renyi divergence is non-decreasing in the order, so that is a
sound upper bound. Everything is computed in log space, for all orders at once;
both sums are binomial means of exp(x), x >= 0, taken as log1p of a mean of
expm1(x) so that values near 1 (huge d0, tiny q1 or q2) keep their digits.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence, Union

import numpy as np
from scipy import special

from tf_twice.accounting import blocks as blocks_lib

# The largest RDP order accepted. The cost is O(MAX_ORDER^2) memory and time;
# dp_accounting's default orders stop at 1024.
MAX_ORDER = 2048


@functools.lru_cache(maxsize=4)
def _log_binomials(v_max: int) -> np.ndarray:
    """log C(v, l) for 0 <= l, v <= v_max; -inf where l > v. Read-only."""
    v = np.arange(v_max + 1, dtype=np.float64)
    l = v[None, :]
    v = v[:, None]
    with np.errstate(invalid='ignore'):
        table = (special.gammaln(v + 1) - special.gammaln(l + 1)
                 - special.gammaln(np.maximum(v - l, 0) + 1))
    table = np.where(l <= v, table, -np.inf)
    table.setflags(write=False)
    return table


@functools.lru_cache(maxsize=8)
def _log_binomial_weights(v_max: int, rate: float) -> np.ndarray:
    """log[C(v,l) (1-rate)^(v-l) rate^l] for 0 <= l, v <= v_max. Read-only.

    Row v is the Binomial(v, rate) pmf in log space, -inf where l > v;
    (1-rate)^0 = 1 also at rate = 1. Cached: calibration calls this with the
    same rates many times.
    """
    log_binom = _log_binomials(v_max)
    v = np.arange(v_max + 1, dtype=np.float64)
    misses = np.maximum(v[:, None] - v[None, :], 0.0)
    table = (log_binom + special.xlog1py(misses, -rate)
             + special.xlogy(v[None, :], rate))
    table.setflags(write=False)
    return table


def _row_logsumexp(x: np.ndarray) -> np.ndarray:
    """log(sum(exp(x), axis=1)); -inf for a row that is all -inf."""
    row_max = x.max(axis=1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    with np.errstate(divide='ignore'):
        return np.log(np.exp(x - row_max).sum(axis=1)) + row_max[:, 0]


def _log_expm1(x: np.ndarray) -> np.ndarray:
    """log(exp(x) - 1) for x >= 0: -inf at 0, no overflow for large x."""
    with np.errstate(divide='ignore'):
        return np.where(x < 1.0, np.log(np.expm1(np.minimum(x, 1.0))),
                        x + np.log1p(-np.exp(-np.maximum(x, 1.0))))


def _log_mean_exp(log_weights: np.ndarray, x: np.ndarray) -> np.ndarray:
    """log(sum_l w_l exp(x_l)) per row of `log_weights`, for pmf rows, x >= 0.

    As the rows sum to 1, this is log1p(sum_l w_l expm1(x_l)) (every term
    >= 0), evaluated as logaddexp(0, logsumexp(log w + log expm1(x))). A plain
    logsumexp computes 1 + S and loses S when S is far below 1 (huge d0, tiny
    q1 or q2): |error| ~ 1e-16 absolute, then multiplied by n = floor(d0).
    In log space, S keeps full relative precision and large x cannot overflow.
    """
    return np.logaddexp(0.0, _row_logsumexp(log_weights
                                            + _log_expm1(x)[None, :]))


def _log_coordinate_moments(max_order: int, rate: float,
                            a: float) -> np.ndarray:
    """log M(v, a) for v = 0..max_order, coordinate sampling rate `rate`."""
    v = np.arange(max_order + 1, dtype=np.float64)
    if a == 0.0:
        return np.zeros(max_order + 1)
    if rate == 1.0:  # No coordinate sampling: the Gaussian's exp(v(v-1)a).
        return v * (v - 1.0) * a
    # M(v, a) = E_{l ~ Binomial(v, rate)} exp(l(l-1) a).
    return _log_mean_exp(_log_binomial_weights(max_order, rate),
                         v * (v - 1.0) * a)


def check_orders(orders: Union[float, Sequence[float]]) -> np.ndarray:
    """Returns `orders` as a 1-d float array after checking 1 < order <= max."""
    orders_array = np.atleast_1d(np.asarray(orders, dtype=np.float64))
    if orders_array.ndim != 1 or orders_array.size == 0:
        raise ValueError('orders must be a non-empty number or 1-d sequence.')
    bad = orders_array[~((orders_array > 1.0)
                         & (orders_array <= MAX_ORDER))]
    if bad.size:
        raise ValueError(f'orders must be in (1, {MAX_ORDER}]; got '
                         f'{bad[0]!r}.')
    return orders_array


def log_moments_of_coordinate_sampling(
        max_order: int, coordinate_sampling_rate: float,
        blocks: blocks_lib.Blocks) -> np.ndarray:
    """L(v) = (v-1) eps0(v) for v = 0..max_order ([COORD], all blocks).

    L(0) = L(1) = 0: M(0, a) = M(1, a) = 1.
    """
    total = np.zeros(max_order + 1)
    for j in range(blocks.size):
        n, c_last = blocks.worst_case_coordinates(j)
        sigma = blocks.noise_multipliers[j] * blocks.l2_norm_clips[j]
        a_inf = blocks.linf_norm_clips[j] ** 2 / (2.0 * sigma * sigma)
        # float(n): n = floor(d0) may exceed int64 (d0 ~ 1e19 and above).
        total += float(n) * _log_coordinate_moments(
            max_order, coordinate_sampling_rate, a_inf)
        total += _log_coordinate_moments(
            max_order, coordinate_sampling_rate,
            c_last ** 2 / (2.0 * sigma * sigma))
    return total


def rdp_of_blocks(orders: np.ndarray, example_sampling_rate: float,
                  coordinate_sampling_rate: float,
                  blocks: blocks_lib.Blocks) -> np.ndarray:
    """One-step RDP at `orders` (already checked) for validated blocks."""
    integer_orders = np.ceil(orders - 1e-12).astype(np.int64)
    unique_orders, positions = np.unique(integer_orders, return_inverse=True)
    max_order = int(unique_orders[-1])

    log_moments = log_moments_of_coordinate_sampling(
        max_order, coordinate_sampling_rate, blocks)
    # Rows alpha of the Binomial(alpha, q1) pmf, columns v = 0..max_order;
    # L(v) >= 0 (M(v, a) >= 1), and the sum is 1 + O(q1^2) for tiny q1.
    log_weights = _log_binomial_weights(max_order, example_sampling_rate)
    log_sums = _log_mean_exp(log_weights[unique_orders], log_moments)
    rdp = log_sums / (unique_orders - 1.0)
    return rdp[positions]


def twice_sampling_rdp(
        orders: Union[float, Sequence[float]],
        *,
        example_sampling_rate: float,
        coordinate_sampling_rate: float,
        noise_multiplier: blocks_lib.ScalarOrBlocks,
        l2_norm_clip: blocks_lib.ScalarOrBlocks = 1.0,
        linf_norm_clip: blocks_lib.OptionalScalarOrBlocks,
        block_dimensions: Optional[Union[int, Sequence[int]]] = None,
) -> np.ndarray:
    """RDP of ONE step of twice-sampled DP-SGD with hybrid clipping.

    Guarantee: the step (Poisson-sample examples at rate q1, clip each block
    of each sampled example to l2 <= c2_j then every coordinate to
    |.| <= c_inf_j, keep each coordinate with probability q2, sum, add
    N(0, (z_j c2_j)^2) to every coordinate of block j) satisfies
    (alpha, eps(alpha))-RDP under add-or-remove-one adjacency for every
    returned eps(alpha). Exact for integer orders; a fractional order gets the
    value of the next integer order (a sound upper bound).

    Args:
      orders: RDP order(s) in (1, MAX_ORDER].
      example_sampling_rate: q1 in (0, 1], the Poisson rate of examples.
      coordinate_sampling_rate: q2 in (0, 1], the per-coordinate keep rate.
      noise_multiplier: z_j > 0, scalar (one block) or one per block.
      l2_norm_clip: c2_j > 0, scalar or one per block.
      linf_norm_clip: c_inf_j > 0 (None: no l-infinity clipping), scalar or
        one per block.
      block_dimensions: optional r_j, the number of coordinates of each block;
        a block with r_j < (c2_j/c_inf_j)^2 has a smaller worst case. Without
        it the bound is still sound, slightly looser.

    Returns:
      A float64 array of the same length as `orders`.
    """
    orders_array = check_orders(orders)
    q1 = blocks_lib.check_rate('example_sampling_rate', example_sampling_rate)
    q2 = blocks_lib.check_rate('coordinate_sampling_rate',
                               coordinate_sampling_rate)
    blocks = blocks_lib.Blocks.from_arguments(
        noise_multiplier, l2_norm_clip, linf_norm_clip, block_dimensions)
    return rdp_of_blocks(orders_array, q1, q2, blocks)


def gaussian_rdp_upper_envelope(orders: np.ndarray,
                                blocks: blocks_lib.Blocks) -> np.ndarray:
    """alpha * sum_j c2_j^2/(2 sigma_j^2): the RDP with q1 = q2 = 1."""
    return orders * 0.5 / blocks.effective_noise_multiplier() ** 2

