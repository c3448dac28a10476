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
* Per-block rates: block j's coordinates may be kept with a rate q2_j of
  their own (1 on unmasked principal blocks); its coordinates' M then use
  q2_j. Given that the example is sampled, every coordinate's mask is
  independent of the others', so the likelihood ratio of the inner mixture
  is still a product over coordinates and the expansion below is unchanged
  (exact, not a bound); with every q2_j = q2 it is the single-rate formula.
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
import math
from typing import Callable, Optional, Sequence, Tuple, Union

import numpy as np
from scipy import special

from tf_twice import _validate
from tf_twice.accounting import blocks as blocks_lib

# The largest RDP order accepted. The cost is O(MAX_ORDER^2) time per
# coordinate size; dp_accounting's default orders stop at 1024.
MAX_ORDER = 2048
# Binomial tables are evaluated in pieces of at most this many rows and
# exponent vectors: bounds the temporaries (128 x 8 x 2049 doubles = 17 MB)
# and skips most of the empty upper triangle (l > v) of each table.
_ROW_BLOCK = 128
_EXPONENT_BLOCK = 8


@functools.lru_cache(maxsize=4)
def _log_factorials(n: int) -> np.ndarray:
    """log k! for k = 0..n. Read-only."""
    table = special.gammaln(np.arange(n + 1, dtype=np.float64) + 1.0)
    table.setflags(write=False)
    return table


@functools.lru_cache(maxsize=4)
def _negative_log_factorial_toeplitz(n: int) -> np.ndarray:
    """T[v, l] = -log (v-l)! for l <= v and -inf for l > v, 0 <= v, l <= n.

    A read-only strided view of one array of length 2n+1 (no n^2 storage):
    C(v,l) = v! / (l! (v-l)!) splits into a row factor, a column factor and
    this Toeplitz factor, so a binomial table costs one addition per entry.
    """
    log_factorials = _log_factorials(n)
    line = np.concatenate([-log_factorials[::-1], np.full(n, -np.inf)])
    line.setflags(write=False)
    # Window s is line[s:s+n+1]; row v of T is window n - v.
    return np.lib.stride_tricks.sliding_window_view(line, n + 1)[::-1]


# Relative terms below exp(_FLOOR) are raised to it before exponentiating:
# exp() of an argument that underflows is several times slower than of a
# normal one. Raising a term over-estimates the sum (still an upper bound)
# by at most (number of terms) * exp(-700) relative, far below rounding.
_FLOOR = -700.0


def _logsumexp_last_axis(x: np.ndarray) -> np.ndarray:
    """log(sum(exp(x), axis=-1)) up to rounding, never below it; -inf where
    x is all -inf, NaN where x holds a NaN or +inf (never a finite value).

    Overwrites `x` (a temporary of the caller's) to save passes over memory.
    """
    top = x.max(axis=-1, keepdims=True)
    empty = top == -np.inf
    top[empty] = 0.0
    np.subtract(x, top, out=x)
    np.maximum(x, _FLOOR, out=x)
    np.exp(x, out=x)
    sums = x.sum(axis=-1, keepdims=True)
    sums[empty] = 0.0
    with np.errstate(divide='ignore'):
        return (np.log(sums) + top)[..., 0]


def _log_expm1(x: np.ndarray) -> np.ndarray:
    """log(exp(x) - 1) for x >= 0: -inf at 0, no overflow for large x."""
    with np.errstate(divide='ignore'):
        return np.where(x < 1.0, np.log(np.expm1(np.minimum(x, 1.0))),
                        x + np.log1p(-np.exp(-np.maximum(x, 1.0))))


def _log_binomial_terms(rows: np.ndarray, width: int, rate: float,
                        log_f: np.ndarray) -> np.ndarray:
    """log[C(v,l) (1-rate)^(v-l) rate^l f_l] - log v! - v log(1-rate).

    Shape (k, len(rows), width) for log_f of shape (k, >= width), v in
    `rows`, l < width; -inf where l > v. 0 < rate < 1. With
    C(v,l) = v!/(l!(v-l)!) the log term is a row constant (left out), a
    column vector log f_l - log l! + l log(rate/(1-rate)) and the Toeplitz
    table -log (v-l)!: one addition per entry.
    """
    log_factorials = _log_factorials(log_f.shape[-1] - 1)
    l = np.arange(width, dtype=np.float64)
    columns = (log_f[:, :width] - log_factorials[:width]
               + l * (math.log(rate) - math.log1p(-rate)))
    toeplitz = _negative_log_factorial_toeplitz(log_f.shape[-1] - 1)
    return toeplitz[rows, :width][None, :, :] + columns[:, None, :]


def _reduce_binomial_rows(rows: np.ndarray, rate: float, log_f: np.ndarray,
                          reduce: Callable[[np.ndarray, int], np.ndarray]
                          ) -> np.ndarray:
    """reduce(_log_binomial_terms(...), width) piece by piece: (k, len(rows)).

    `rows` is increasing; each piece of rows is taken up to its own largest
    v, so the cost is ~ k * sum over rows of (v+1), not k * len(rows) * (n+1).
    """
    result = np.empty((log_f.shape[0], rows.size))
    for first in range(0, rows.size, _ROW_BLOCK):
        block = rows[first:first + _ROW_BLOCK]
        width = int(block[-1]) + 1
        for k in range(0, log_f.shape[0], _EXPONENT_BLOCK):
            result[k:k + _EXPONENT_BLOCK, first:first + block.size] = reduce(
                _log_binomial_terms(block, width, rate,
                                    log_f[k:k + _EXPONENT_BLOCK]), width)
    return result


def _log_binomial_mean_expm1(rows: np.ndarray, rate: float,
                             h: np.ndarray) -> np.ndarray:
    """log sum_{l=0..v} C(v,l) (1-rate)^(v-l) rate^l expm1(h_l), v in `rows`.

    `rows` is increasing, 0 < rate < 1; h >= 0 has shape (k, n+1) with
    n >= rows[-1]; the result has shape (k, len(rows)).
    """
    result = _reduce_binomial_rows(rows, rate, _log_expm1(h),
                                   lambda terms, _: _logsumexp_last_axis(terms))
    return (result + _log_factorials(h.shape[-1] - 1)[rows]
            + rows * math.log1p(-rate))


def _log_binomial_mean_exp(rows: np.ndarray, rate: float,
                           h: np.ndarray) -> np.ndarray:
    """log E_{l ~ Binomial(v, rate)} exp(h_l) for v in `rows`; h >= 0 of
    shape (k, n+1), result (k, len(rows)).

    As the pmf sums to 1, this is log1p(sum_l pmf_l expm1(h_l)) (every term
    >= 0), evaluated as logaddexp(0, log of that sum). A plain logsumexp
    computes 1 + S and loses S when S is far below 1 (huge d0, tiny q1 or
    q2): |error| ~ 1e-16 absolute, then multiplied by n = floor(d0). In log
    space, S keeps full relative precision and large h cannot overflow.
    rate = 1 is the point mass at l = v.
    """
    if rate == 1.0:
        return h[:, rows].astype(np.float64)
    return np.logaddexp(0.0, _log_binomial_mean_expm1(rows, rate, h))


def _log_coordinate_moments(max_order: int, rate: float,
                            exponents: np.ndarray) -> np.ndarray:
    """log M(v, a) for v = 0..max_order (columns) and a in `exponents` > 0
    (rows), coordinate sampling rate `rate`.

    M(v, a) = E_{l ~ Binomial(v, rate)} exp(l(l-1) a); at rate = 1 it is
    the Gaussian's exp(v(v-1)a).
    """
    v = np.arange(max_order + 1, dtype=np.float64)
    pairs = v * (v - 1.0)
    if rate == 1.0:
        return exponents[:, None] * pairs
    return _log_binomial_mean_exp(np.arange(max_order + 1), rate,
                                  exponents[:, None] * pairs)


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
        max_order: int, blocks: blocks_lib.Blocks) -> np.ndarray:
    """L(v) = (v-1) eps0(v) for v = 0..max_order ([COORD], all blocks).

    L(0) = L(1) = 0: M(0, a) = M(1, a) = 1. The exponents of all blocks
    with one rate are evaluated in one batch.
    """
    block_of, counts, exponents = _all_coordinate_exponents(blocks)
    log_moments = np.zeros(max_order + 1)
    for rate, at in _coordinates_by_rate(blocks, block_of):
        log_moments += counts[at] @ _log_coordinate_moments(
            max_order, rate, exponents[at])
    return log_moments


def _coordinates_by_rate(blocks: blocks_lib.Blocks, block_of: np.ndarray):
    """(rate, mask over the worst-case coordinates) for each distinct rate
    of the coordinates' blocks."""
    rates = np.array(blocks.coordinate_sampling_rates)[block_of]
    return [(float(rate), rates == rate) for rate in np.unique(rates)]


def _all_coordinate_exponents(
        blocks: blocks_lib.Blocks
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(block index, count, exponent a > 0) of every block's worst-case
    coordinates; a coordinate with a = 0 has log M(v, 0) = 0 and is left
    out."""
    triples = [(j, count, a) for j in range(blocks.size)
               for count, a in _coordinate_exponents(blocks, j) if a > 0.0]
    return (np.array([j for j, _, _ in triples], dtype=np.int64),
            np.array([count for _, count, _ in triples], dtype=np.float64),
            np.array([a for _, _, a in triples], dtype=np.float64))


def _coordinate_exponents(blocks: blocks_lib.Blocks,
                          j: int) -> Tuple[Tuple[float, float], ...]:
    """Block j's worst case as (count, a = s^2 / (2 sigma_j^2)) pairs.

    n coordinates at s = c_inf_j and one at s = c'_j (remark after [COORD]);
    the count is a float: n = floor(d0) may exceed int64 (d0 ~ 1e19).
    a is formed from s / c2_j <= 1 and z_j so that it cannot divide by an
    underflowed sigma_j^2; it is +inf where it overflows (tiny z_j).
    """
    n, c_last = blocks.worst_case_coordinates(j)
    z, c2 = blocks.noise_multipliers[j], blocks.l2_norm_clips[j]

    def exponent(s: float) -> float:
        ratio = (s / c2) / z
        return 0.5 * ratio * ratio  # A float product overflows to inf.

    return ((float(n), exponent(blocks.linf_norm_clips[j])),
            (1.0, exponent(c_last)))


# The exponents h = l (l-1) a, the log-moments L(v) and the terms formed from
# them stay below this (so finite, and no inf - inf) when the sum over all
# worst-case coordinates of count * a * max_order * (max_order - 1) does.
_LARGEST_EXPONENT_SUM = 1e300


def _overflows(max_order: int, counts: np.ndarray,
               exponents: np.ndarray) -> bool:
    """Whether the tables at these exponents could overflow a float.

    L(v) <= sum_coordinates count * v (v-1) a (M(v, a) <= exp(v (v-1) a)),
    so below the bound every table entry is finite. Above it the RDP is
    reported as +inf, a sound upper bound: that takes sigma_j below about
    1e-147 c2_j, where the RDP is astronomically large in any case.
    """
    with np.errstate(over='ignore', invalid='ignore'):
        total = float(np.sum(counts * exponents)) * max_order * (
            max_order - 1.0)
    return not total < _LARGEST_EXPONENT_SUM


def rdp_of_blocks(orders: np.ndarray, example_sampling_rate: float,
                  blocks: blocks_lib.Blocks) -> np.ndarray:
    """One-step RDP at `orders` (already checked) for validated blocks."""
    integer_orders = integer_order_ceilings(orders)
    unique_orders, positions = np.unique(integer_orders, return_inverse=True)
    max_order = int(unique_orders[-1])

    _, counts, exponents = _all_coordinate_exponents(blocks)
    if _overflows(max_order, counts, exponents):
        return np.full(orders.shape, np.inf)
    log_moments = log_moments_of_coordinate_sampling(max_order, blocks)
    rdp = _twice_sampling_rdp_of_moments(
        unique_orders, example_sampling_rate, log_moments)[positions]
    # Nothing above can produce a NaN; were one to appear, it must not pass
    # for a small RDP (dp_accounting's compute_epsilon turns NaN into 0).
    return np.where(np.isnan(rdp), np.inf, rdp)


def integer_order_ceilings(orders: np.ndarray) -> np.ndarray:
    """ceil(alpha) for every order alpha > 1, as int64: the integer order
    whose exact RDP bounds a fractional order's (Renyi divergence is
    non-decreasing in the order). No tolerance: an order a rounding error
    above an integer gets the next integer, never the one below it."""
    return np.ceil(orders).astype(np.int64)


def _twice_sampling_rdp_of_moments(orders: np.ndarray, q1: float,
                                   log_moments: np.ndarray) -> np.ndarray:
    """eps(alpha) of [TWICE] at increasing integer `orders` from L(v)."""
    # Row alpha: E_{v ~ Binomial(alpha, q1)} exp(L(v)), L(v) >= 0
    # (M(v, a) >= 1); the mean is 1 + O(q1^2) for tiny q1.
    log_sums = _log_binomial_mean_exp(orders, q1, log_moments[None, :])[0]
    return log_sums / (orders - 1.0)


def twice_sampling_rdp(
        orders: Union[float, Sequence[float]],
        *,
        example_sampling_rate: float,
        coordinate_sampling_rate: blocks_lib.ScalarOrBlocks,
        noise_multiplier: blocks_lib.ScalarOrBlocks,
        l2_norm_clip: blocks_lib.ScalarOrBlocks = 1.0,
        linf_norm_clip: blocks_lib.OptionalScalarOrBlocks,
        block_dimensions: Optional[Union[int, Sequence[int]]] = None,
) -> np.ndarray:
    """RDP of ONE step of twice-sampled DP-SGD with hybrid clipping.

    Guarantee: the step (Poisson-sample examples at rate q1, clip each block
    of each sampled example to l2 <= c2_j then every coordinate to
    |.| <= c_inf_j, keep each coordinate of block j with probability q2_j,
    sum, add
    N(0, (z_j c2_j)^2) to every coordinate of block j) satisfies
    (alpha, eps(alpha))-RDP under add-or-remove-one adjacency for every
    returned eps(alpha). Exact for integer orders; a fractional order gets the
    value of the next integer order (a sound upper bound).

    Args:
      orders: RDP order(s) in (1, MAX_ORDER].
      example_sampling_rate: q1 in (0, 1], the Poisson rate of examples.
      coordinate_sampling_rate: q2 in (0, 1], the per-coordinate keep
        rate, for every block or one per block.
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
    q1 = _validate.rate('example_sampling_rate', example_sampling_rate)
    blocks = blocks_lib.Blocks.from_arguments(
        noise_multiplier, l2_norm_clip, linf_norm_clip, block_dimensions,
        coordinate_sampling_rate)
    return rdp_of_blocks(orders_array, q1, blocks)


def gaussian_rdp_upper_envelope(orders: np.ndarray,
                                blocks: blocks_lib.Blocks) -> np.ndarray:
    """alpha * sum_j c2_j^2/(2 sigma_j^2): the RDP with q1 = q2 = 1."""
    return orders * 0.5 / blocks.effective_noise_multiplier() ** 2



def _log_coordinate_moment_slopes(max_order: int, rate: float,
                                  exponents: np.ndarray) -> np.ndarray:
    """d log M(v, a) / da for v = 0..max_order (columns), a in `exponents`.

    M(v, a) = sum_l pmf_l exp(l(l-1) a), so the derivative is the mean of
    l(l-1) under the tilted pmf proportional to pmf_l exp(l(l-1) a)
    (a softmax over l, stable for any a). At rate = 1 it is v(v-1).
    """
    l = np.arange(max_order + 1, dtype=np.float64)
    pairs = l * (l - 1.0)
    if rate == 1.0:
        return np.broadcast_to(pairs, (exponents.size, max_order + 1))

    def tilted_mean_of_pairs(terms: np.ndarray, width: int) -> np.ndarray:
        terms -= terms.max(axis=-1, keepdims=True)
        np.maximum(terms, _FLOOR, out=terms)  # Fast exp; ~1e-300 relative.
        np.exp(terms, out=terms)
        return (terms @ pairs[:width]) / terms.sum(axis=-1)

    return _reduce_binomial_rows(np.arange(max_order + 1), rate,
                                 exponents[:, None] * pairs,
                                 tilted_mean_of_pairs)


def rdp_and_noise_gradient(order: int, example_sampling_rate: float,
                           blocks: blocks_lib.Blocks
                           ) -> Tuple[float, np.ndarray]:
    """eps(alpha) at one integer order and d eps(alpha) / d log z_j.

    From the formulas in the module docstring, with a = s^2 / (2 z_j^2 c2_j^2)
    (so da / d log z_j = -2a) and pi the tilted Binomial(alpha, q1) pmf
    pi_v proportional to C(alpha,v) (1-q1)^(alpha-v) q1^v exp(L(v)):
        d eps(alpha) / d log z_j = (1/(alpha-1)) sum_v pi_v dL(v)/d log z_j,
        dL(v) / d log z_j = -2 [n_j a_j D(v, a_j) + a'_j D(v, a'_j)],
    where D(v, a) = d log M(v, a) / da (`_log_coordinate_moment_slopes`).
    The value is `rdp_of_blocks` at this order.
    """
    block_of, counts, exponents = _all_coordinate_exponents(blocks)
    if _overflows(order, counts, exponents):
        return math.inf, np.zeros(blocks.size)
    log_moments = log_moments_of_coordinate_sampling(order, blocks)
    value = float(_twice_sampling_rdp_of_moments(
        np.array([order]), example_sampling_rate, log_moments)[0])
    # dL(v) / d log z_j, one column per block: -2 count a D(v, a) summed
    # over the block's coordinates.
    moment_slopes = np.empty((exponents.size, order + 1))
    for rate, at in _coordinates_by_rate(blocks, block_of):
        moment_slopes[at] = _log_coordinate_moment_slopes(order, rate,
                                                          exponents[at])
    weighted = (-2.0 * counts * exponents)[:, None] * moment_slopes
    slopes = np.zeros((blocks.size, order + 1))
    np.add.at(slopes, block_of, weighted)
    if example_sampling_rate == 1.0:
        tilted = np.zeros(order + 1)
        tilted[order] = 1.0
    else:
        tilted = _log_binomial_terms(np.array([order]), order + 1,
                                     example_sampling_rate,
                                     log_moments[None, :])[0, 0]
        tilted = np.exp(tilted - tilted.max())
        tilted /= tilted.sum()
    return value, (slopes @ tilted) / (order - 1.0)
