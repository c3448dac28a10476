"""Privacy statements for twice-sampled DP-SGD, beside tf_privacy's.

Mirrors tensorflow_privacy's `compute_dp_sgd_privacy` and
`compute_dp_sgd_privacy_statement` (same arguments, plus the coordinate
sampling rate and the clip norms). The comparison with standard DP-SGD is
computed as tf_privacy's `compute_dp_sgd_privacy` computes it (the same
dp_accounting event, orders and conversion), with dp_accounting alone: no
TensorFlow, no tensorflow-privacy.
"""

from __future__ import annotations

import contextlib
import logging
import math
import textwrap
from typing import NamedTuple, Optional, Sequence, Tuple, Union

import dp_accounting

from tf_twice import _validate
from tf_twice.accounting import blocks as blocks_lib
from tf_twice.accounting import calibration
from tf_twice.accounting import conversion as conversion_lib

_WIDTH = 80


def _steps(number_of_examples: int, batch_size: float,
           num_epochs: float) -> int:
    """tf_privacy's step count: ceil(epochs * n / batch_size)."""
    return int(math.ceil(num_epochs * number_of_examples / batch_size))


def _check_dataset(number_of_examples, batch_size, num_epochs
                   ) -> Tuple[int, float, float, int]:
    _validate.integer('number_of_examples', number_of_examples, 1)
    batch_size = _validate.positive('batch_size', batch_size)
    if batch_size > number_of_examples:
        raise ValueError(f'batch_size must be in (0, number_of_examples='
                         f'{number_of_examples}]; got {batch_size}.')
    num_epochs = _validate.positive('num_epochs', num_epochs)
    q1 = batch_size / number_of_examples
    return number_of_examples, q1, num_epochs, _steps(
        number_of_examples, batch_size, num_epochs)


def _check_no_microbatching(used_microbatching: bool) -> None:
    """Refuses microbatched clipping, which this analysis does not cover.

    tf_privacy's statement halves the noise multiplier for microbatches of
    several examples. Under Poisson sampling one added example can change
    the membership of several microbatches, and the coordinate-sampling
    analysis assumes one clipped contribution per example, so no such
    simple correction is claimed here.
    """
    if used_microbatching:
        raise ValueError(
            'used_microbatching must be False: the twice-sampling guarantee '
            'assumes every example is clipped on its own (tf_twice\'s '
            'training paths do this; microbatched clipping is refused by its '
            'privacy ledger too).')


def compute_twice_sampling_privacy(
        n: int,
        batch_size: float,
        noise_multiplier: blocks_lib.ScalarOrBlocks,
        epochs: float,
        delta: float,
        coordinate_sampling_rate: blocks_lib.ScalarOrBlocks,
        l2_norm_clip: blocks_lib.ScalarOrBlocks = 1.0,
        linf_norm_clip: blocks_lib.OptionalScalarOrBlocks = None,
        *,
        block_dimensions: Optional[Union[int, Sequence[int]]] = None,
        orders: Optional[Sequence[float]] = None,
        conversion: conversion_lib.ConversionLike = 'dp_accounting',
) -> Tuple[float, float]:
    """(epsilon, optimal RDP order) of twice-sampled DP-SGD.

    Like tf_privacy's `compute_dp_sgd_privacy(n, batch_size,
    noise_multiplier, epochs, delta)`: Poisson sampling at
    q1 = batch_size / n for ceil(epochs * n / batch_size) steps, add-or-remove
    adjacency, plus coordinate sampling at rate q2 and l2 / l-infinity clips
    (scalars or one per hybrid block).
    """
    n, q1, epochs, steps = _check_dataset(n, batch_size, epochs)
    return calibration.epsilon_and_optimal_order_after_steps(
        steps=steps, delta=delta, example_sampling_rate=q1,
        coordinate_sampling_rate=coordinate_sampling_rate,
        noise_multiplier=noise_multiplier, l2_norm_clip=l2_norm_clip,
        linf_norm_clip=linf_norm_clip, block_dimensions=block_dimensions,
        orders=orders, conversion=conversion)


# The RDP orders of tf_privacy's `compute_dp_sgd_privacy` (0.9.0).
STANDARD_DP_SGD_ORDERS = (
    (1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0, 4.5)
    + tuple(range(5, 64)) + (128, 256, 512))


class _DropConvergenceNotice(logging.Filter):

    def filter(self, record: logging.LogRecord) -> bool:
        return 'failed to converge' not in record.getMessage()


@contextlib.contextmanager
def _quiet_dp_accounting_convergence_log():
    absl_logger = logging.getLogger('absl')
    notice_filter = _DropConvergenceNotice()
    absl_logger.addFilter(notice_filter)
    try:
        yield
    finally:
        absl_logger.removeFilter(notice_filter)


def standard_dp_sgd_epsilon(*, example_sampling_rate: float,
                            noise_multiplier: float, steps: int,
                            delta: float) -> Tuple[float, float]:
    """(epsilon, optimal order) of standard DP-SGD, as tf_privacy reports it.

    The Poisson-subsampled Gaussian mechanism (sampling rate q, noise
    multiplier z, l2 sensitivity 1, add-or-remove adjacency) composed
    `steps` times, with dp_accounting's `RdpAccountant` over tf_privacy's
    orders (`STANDARD_DP_SGD_ORDERS`) and its conversion to (epsilon, delta):
    the computation of tf_privacy's `compute_dp_sgd_privacy`, here with the
    step count given directly instead of recomputed from epochs (the RDP of
    the subsampled Gaussian: Mironov, Talwar and Zhang, arXiv:1908.10530).
    """
    q = _validate.rate('example_sampling_rate', example_sampling_rate)
    z = _validate.non_negative('noise_multiplier', noise_multiplier)
    steps = _validate.integer('steps', steps, 1)
    delta = _validate.probability('delta', delta)
    accountant = dp_accounting.rdp.RdpAccountant(list(STANDARD_DP_SGD_ORDERS))
    # dp_accounting >= 0.5 drops a fractional order whose series does not
    # converge (large q, small z) and logs it; dropping an order only leaves
    # the minimum over the rest, still an upper bound, so the log is noise.
    with _quiet_dp_accounting_convergence_log():
        accountant.compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(
                sampling_probability=q,
                event=dp_accounting.GaussianDpEvent(z)),
            steps))
    eps, order = accountant.get_epsilon_and_optimal_order(delta)
    return float(eps), float(order)


def noise_variance_ratio(
        *, target_epsilon: float, delta: float, steps: int,
        example_sampling_rate: float, coordinate_sampling_rate: float,
        l2_norm_clip: blocks_lib.ScalarOrBlocks = 1.0,
        linf_norm_clip: blocks_lib.OptionalScalarOrBlocks = None,
        block_dimensions=None,
        conversion: conversion_lib.ConversionLike = 'dp_accounting',
        tolerance: float = 1e-4) -> float:
    """Noise variance of twice sampling over standard DP-SGD at equal epsilon.

    Both noise multipliers are calibrated to `target_epsilon` after `steps`
    steps with the same accountant and conversion: twice sampling at
    (q1, q2) with the given clips, and standard DP-SGD (l2 clip only) with
    Poisson sampling at q1 * q2, which has the same expected number of
    contributions per coordinate. The ratio (z_twice / z_standard)^2 is the
    paper's tabulated noise-variance ratio; below 1 means twice sampling
    needs less noise.
    """
    if isinstance(blocks_lib.check_coordinate_rates(coordinate_sampling_rate),
                  tuple):
        raise ValueError(
            'coordinate_sampling_rate must be one rate for this one-rate '
            f'comparison; got {coordinate_sampling_rate!r} (per-block rates: '
            'hybrid_noise_variance_ratio).')
    common = dict(target_epsilon=target_epsilon, delta=delta, steps=steps,
                  conversion=conversion, tolerance=tolerance)
    z_twice = calibration.calibrate_noise_multiplier(
        example_sampling_rate=example_sampling_rate,
        coordinate_sampling_rate=coordinate_sampling_rate,
        l2_norm_clip=l2_norm_clip, linf_norm_clip=linf_norm_clip,
        block_dimensions=block_dimensions, **common)
    # Standard DP-SGD is the case q2 = 1 without l-infinity clipping.
    z_standard = calibration.calibrate_noise_multiplier(
        example_sampling_rate=example_sampling_rate
        * coordinate_sampling_rate,
        coordinate_sampling_rate=1.0, l2_norm_clip=1.0, linf_norm_clip=None,
        **common)
    return (z_twice / z_standard) ** 2


class HybridNoiseComparison(NamedTuple):
    """Total noise variance of hybrid clipping against standard DP-SGD.

    Attributes:
      ratio: hybrid_variance / standard_variance (below 1: hybrid clipping
        adds less noise).
      hybrid_variance: sum_j r_j (z_j c2_j)^2, the variance of all the
        Gaussian noise one hybrid step adds (principal blocks on their r_j
        coefficients, the residual on all d coordinates; with orthonormal
        principal blocks it is also the noise's total variance in gradient
        space).
      standard_variance: d (z_std c)^2 of standard DP-SGD.
      global_l2_clip: c = sqrt(sum_j c2_j^2), the l2 ball that contains
        the hybrid sensitivity set.
      standard_noise_multiplier: z_std, calibrated to the same epsilon.
      model_dimension: d.
    """
    ratio: float
    hybrid_variance: float
    standard_variance: float
    global_l2_clip: float
    standard_noise_multiplier: float
    model_dimension: int


def hybrid_noise_variance_ratio(
        *, noise_multipliers: Sequence[float],
        l2_norm_clips: Sequence[float],
        block_dimensions: Sequence[int],
        target_epsilon: float, delta: float, steps: int,
        example_sampling_rate: float,
        coordinate_sampling_rate: blocks_lib.ScalarOrBlocks,
        model_dimension: Optional[int] = None,
        conversion: conversion_lib.ConversionLike = 'dp_accounting',
        tolerance: float = 1e-4) -> HybridNoiseComparison:
    """Hybrid clipping's total noise variance over standard DP-SGD's.

    The comparison is with standard DP-SGD (no basis, no coordinate
    sampling, no l-infinity clip) that clips every example to the global l2
    norm c = sqrt(sum_j c2_j^2), whose ball contains the hybrid set, samples
    examples with Poisson rate q1 * q2 and has its noise multiplier z_std
    calibrated to `target_epsilon` after `steps` steps with the same
    accountant and conversion. At rate q1 * q2 both mechanisms have the same
    expected number of contributions per coordinate (n q1 q2), so both
    updates are unbiased estimates of a mean clipped gradient divided by the
    same n q1 q2, and the ratio of the summed noise variances is the ratio of
    the updates' noise variances (the paper's comparison at equal epsilon,
    as in `noise_variance_ratio`).

    Args:
      noise_multipliers, l2_norm_clips, block_dimensions: z_j, c2_j and r_j
        per block (hybrid clipping: principal blocks, then the residual with
        r_m = d, as `HybridBasis.block_dimensions`).
      model_dimension: d, the number of coordinates of standard DP-SGD's
        noise; default the last block's dimension (the residual is released
        in all d natural coordinates).
      target_epsilon: the epsilon both are compared at (normally the hybrid
        mechanism's own epsilon for these z_j).
      coordinate_sampling_rate: q2, or q2_j per block; with per-block rates
        DP-SGD samples at q1 q2 with q2 = max_j q2_j, and block j's
        variance is scaled by (q2 / q2_j)^2 (its update is divided by
        n q1 q2_j, DP-SGD's by n q1 q2).
      Other arguments as in `noise_variance_ratio`.
    """
    blocks = blocks_lib.Blocks.from_arguments(
        noise_multipliers, l2_norm_clips, None, block_dimensions,
        coordinate_sampling_rate, noise_multiplier_name='noise_multipliers',
        l2_norm_clip_name='l2_norm_clips')
    if blocks.dimensions is None:
        raise ValueError('block_dimensions must be given, one per block.')
    d = blocks.dimensions[-1] if model_dimension is None else (
        _validate.integer('model_dimension', model_dimension, 1))
    rates = blocks.coordinate_sampling_rates
    q2 = max(rates)
    hybrid = sum(r * (z * c * q2 / q) ** 2 for r, z, c, q in zip(
        blocks.dimensions, blocks.noise_multipliers, blocks.l2_norm_clips,
        rates))
    c = math.sqrt(sum(c2 ** 2 for c2 in blocks.l2_norm_clips))
    # The calibrated z is scale-free: its noise std is z * c for any c.
    z_std = calibration.calibrate_noise_multiplier(
        target_epsilon=target_epsilon, delta=delta, steps=steps,
        example_sampling_rate=example_sampling_rate * q2,
        coordinate_sampling_rate=1.0, l2_norm_clip=1.0, linf_norm_clip=None,
        conversion=conversion, tolerance=tolerance)
    standard = d * (z_std * c) ** 2
    return HybridNoiseComparison(hybrid / standard, hybrid, standard, c,
                                 z_std, d)


def _block_table(blocks: blocks_lib.Blocks) -> str:
    """One row per block of a multi-block step: c2, c_inf, d0, z, sigma, r
    and q2_j (shown even when the blocks share it: a plan's principal
    blocks usually keep every coordinate, and one rate for all blocks,
    masked, has a smaller epsilon)."""
    rates = blocks.coordinate_sampling_rates
    rows = [f'    {"block":>8} {"l2 clip":>9} {"l-inf clip":>11} {"d0":>9} '
            f'{"noise mult.":>12} {"noise std":>10} {"coordinates":>11} '
            f'{"q2":>6}']
    for j in range(blocks.size):
        c2, ci = blocks.l2_norm_clips[j], blocks.linf_norm_clips[j]
        z = blocks.noise_multipliers[j]
        r = ('?' if blocks.dimensions is None
             else f'{blocks.dimensions[j]:,}')
        name = 'residual' if j == blocks.size - 1 else str(j + 1)
        rows.append(f'    {name:>8} {c2:9.4g} {ci:11.4g} {(c2 / ci) ** 2:9.4g}'
                    f' {z:12.4g} {z * c2:10.4g} {r:>11} {rates[j]:6.4g}')
    return '\n'.join(rows)


def _format_blocks(values) -> str:
    if hasattr(values, 'tolist'):  # numpy arrays and scalars.
        values = values.tolist()
    if isinstance(values, (list, tuple)):
        return '(' + ', '.join(f'{v:g}' if v is not None else 'none'
                               for v in values) + ')'
    return 'none' if values is None else f'{values:g}'


def compute_twice_sampling_privacy_statement(
        number_of_examples: int,
        batch_size: float,
        num_epochs: float,
        noise_multiplier: blocks_lib.ScalarOrBlocks,
        delta: float,
        coordinate_sampling_rate: blocks_lib.ScalarOrBlocks,
        l2_norm_clip: blocks_lib.ScalarOrBlocks = 1.0,
        linf_norm_clip: blocks_lib.OptionalScalarOrBlocks = None,
        used_microbatching: bool = False,
        max_examples_per_user: Optional[int] = None,
        *,
        block_dimensions: Optional[Union[int, Sequence[int]]] = None,
        conversion: conversion_lib.ConversionLike = 'dp_accounting',
        model_dimension: Optional[int] = None,
) -> str:
    """A report of the DP guarantee of twice-sampled DP-SGD.

    Same arguments as tf_privacy's `compute_dp_sgd_privacy_statement`, plus
    the coordinate sampling rate and the clip norms (one per hybrid block for
    several blocks). tf_twice clips every example on its own, so
    `used_microbatching` must be False (True raises ValueError). The report
    gives epsilon under Poisson sampling, the epsilon of standard DP-SGD with
    Poisson sampling at q1 * q2 and the same noise (computed as tf_privacy's
    `compute_dp_sgd_privacy` does, `standard_dp_sgd_epsilon`),
    and the noise-variance ratio at equal epsilon.

    Several blocks (hybrid clipping: principal blocks, then the residual)
    are listed one per row (c2_j, c_inf_j, d0_j, z_j, sigma_j = z_j c2_j,
    r_j). With `block_dimensions` (`HybridBasis.block_dimensions`) the report
    also compares the total noise variance sum_j r_j sigma_j^2 with that of
    standard DP-SGD at the same epsilon (`hybrid_noise_variance_ratio`: global
    clip c = sqrt(sum_j c2_j^2), rate q1 * q2, d = `model_dimension`,
    default the residual's dimension).
    """
    n, q1, num_epochs, steps = _check_dataset(number_of_examples, batch_size,
                                              num_epochs)
    delta = _validate.probability('delta', delta)
    _validate.warn_if_delta_not_small(delta, n)
    conversion = conversion_lib.as_conversion(conversion)
    _check_no_microbatching(used_microbatching)
    blocks = blocks_lib.Blocks.from_arguments(
        noise_multiplier, l2_norm_clip, linf_norm_clip, block_dimensions,
        coordinate_sampling_rate)
    block_rates = blocks.coordinate_sampling_rates
    # DP-SGD is compared at q1 q2, q2 the largest rate: it computes as many
    # contributions per coordinate as the most-kept block does.
    q2 = max(block_rates)
    # `compute_twice_sampling_privacy` of the checked arguments.
    eps, order = calibration.checked_epsilon_function(
        steps=steps, delta=delta, example_sampling_rate=q1, orders=None,
        conversion=conversion).epsilon_and_optimal_order(blocks)
    z_eff = blocks.effective_noise_multiplier()
    eps_standard, _ = standard_dp_sgd_epsilon(
        example_sampling_rate=q1 * q2, noise_multiplier=z_eff, steps=steps,
        delta=delta)

    d0 = tuple((c / ci) ** 2 for c, ci in zip(blocks.l2_norm_clips,
                                                blocks.linf_norm_clips))
    one_block = blocks.size == 1
    # At q2 = 1 with no l-infinity clip that binds the step is DP-SGD's.
    linf_binds = any(d > 1 for d in d0)
    name = ('Twice-sampled DP-SGD' if min(block_rates) < 1 or linf_binds
            or not one_block else 'DP-SGD')
    paragraphs = [textwrap.fill(
        f'{name} performed over {n} examples with '
        f'{batch_size:g} examples per iteration in expectation (Poisson '
        f'sampling rate q1 = {q1:.6g}), '
        + (f'coordinate sampling rate q2 = '
           f'{_format_blocks(coordinate_sampling_rate)}, '
           if min(block_rates) < 1 else '')
        + f'noise multiplier {_format_blocks(noise_multiplier)}, l2 clip '
        f'{_format_blocks(l2_norm_clip)}'
        + (f' and l-infinity clip {_format_blocks(linf_norm_clip)} '
           f'(d0 = {_format_blocks(d0[0] if one_block else d0)})'
           if linf_binds else '')
        + f' for {num_epochs:g} epochs ({steps} steps), every example '
        'clipped on '
        'its own (no microbatching)'
        + ('' if one_block else f', over {blocks.size} hybrid-clipping '
           f'blocks (effective noise multiplier {z_eff:.4g})')
        + '.', width=_WIDTH)]
    paragraphs.append(textwrap.fill(
        'This privacy guarantee protects the release of all model '
        'checkpoints in addition to the final model. It assumes every '
        'example is included in each step independently with probability q1 '
        '(Poisson sampling); shuffled fixed-size batches do not give it.',
        width=_WIDTH))
    paragraphs.append(
        textwrap.fill(
            f'Example-level DP with add-or-remove-one adjacency at delta = '
            f'{delta} computed with RDP accounting ({conversion.value} '
            'conversion):', width=_WIDTH)
        + f'\n    Epsilon with twice sampling:{eps:>37.3f}'
        f'  (RDP order {order:g})'
        + f'\n    Epsilon of standard DP-SGD with Poisson sampling at q1*q2 ='
        f' {q1 * q2:.6g}\n    and the same noise (tf_privacy\'s accounting):'
        f'{eps_standard:>20.3f}')
    # The single-noise comparison is meaningful for one block; several blocks
    # get per-block noise from `optimize_block_noise` instead.
    if one_block and math.isfinite(eps) and eps > 0:
        ratio = noise_variance_ratio(
            target_epsilon=eps, delta=delta, steps=steps,
            example_sampling_rate=q1, coordinate_sampling_rate=q2,
            l2_norm_clip=blocks.l2_norm_clips,
            linf_norm_clip=blocks.linf_norm_clips,
            block_dimensions=block_dimensions, conversion=conversion)
        paragraphs.append(textwrap.fill(
            f'Noise-variance ratio at equal epsilon ({eps:.3f}): '
            f'{ratio:.4f} (noise calibrated for twice sampling over noise '
            'calibrated for standard DP-SGD at rate q1*q2, same steps; below '
            '1 means twice sampling needs less noise).', width=_WIDTH))
    if not one_block:
        paragraphs.append(_hybrid_paragraph(
            blocks, eps, delta=delta, steps=steps, q1=q1,
            model_dimension=model_dimension, conversion=conversion))
    if max_examples_per_user is None:
        paragraphs.append(textwrap.fill(
            'No user-level privacy guarantee is possible without a bound on '
            'the number of examples per user.', width=_WIDTH))
    else:
        paragraphs.append(textwrap.fill(
            f'At most {max_examples_per_user} examples per user: tf_twice '
            'does not compute a user-level guarantee for twice sampling; the '
            'epsilon above is example-level only.', width=_WIDTH))
    return '\n\n'.join(paragraphs) + '\n'


def _hybrid_paragraph(blocks: blocks_lib.Blocks, eps: float, *, delta: float,
                      steps: int, q1: float, model_dimension: Optional[int],
                      conversion: conversion_lib.Conversion) -> str:
    """The block table and the variance comparison of a multi-block step."""
    text = (textwrap.fill(
        'Hybrid-clipping blocks (principal blocks, then the residual; noise '
        'std = noise multiplier * l2 clip on every coordinate of the '
        'block):', width=_WIDTH) + '\n' + _block_table(blocks))
    if blocks.dimensions is None:
        return text + '\n' + textwrap.fill(
            'The total noise variance and its ratio to standard DP-SGD need '
            'every block\'s number of coordinates: pass block_dimensions '
            '(HybridBasis.block_dimensions: principal ranks, then d).',
            width=_WIDTH)
    if not (math.isfinite(eps) and eps > 0):
        return text
    rates = blocks.coordinate_sampling_rates
    cmp = hybrid_noise_variance_ratio(
        noise_multipliers=blocks.noise_multipliers,
        l2_norm_clips=blocks.l2_norm_clips,
        block_dimensions=blocks.dimensions, target_epsilon=eps, delta=delta,
        steps=steps, example_sampling_rate=q1, coordinate_sampling_rate=rates,
        model_dimension=model_dimension, conversion=conversion)
    q2 = max(rates)
    scaled = ('' if len(set(rates)) == 1 else
              ', block j\'s scaled by (q2 / q2_j)^2 as its update is divided '
              'by n*q1*q2_j')
    return text + '\n\n' + textwrap.fill(
        f'Hybrid noise-variance ratio at equal epsilon ({eps:.3f}): '
        f'{cmp.ratio:.4f} (below 1 means hybrid clipping adds less noise): '
        f'total noise variance sum_j r_j (z_j c2_j)^2{scaled} = '
        f'{cmp.hybrid_variance:.6g}, against d (z c)^2 = '
        f'{cmp.standard_variance:.6g} for standard DP-SGD without basis or '
        f'coordinate sampling over d = {cmp.model_dimension:,} parameters, '
        f'clipped to the global l2 norm c = sqrt(sum_j c2_j^2) = '
        f'{cmp.global_l2_clip:.4g} (its ball contains the hybrid set), with '
        f'Poisson sampling at q1*q2 = {q1 * q2:.6g} (the same expected '
        'number of contributions per coordinate, so both updates are '
        'divided by n*q1*q2) and noise multiplier '
        f'{cmp.standard_noise_multiplier:.4g} calibrated to the same epsilon '
        'and steps.', width=_WIDTH)
