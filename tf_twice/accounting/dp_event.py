"""The DpEvent of one twice-sampled, hybrid-clipped Gaussian step."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import attr
import dp_accounting

from tf_twice import _validate
from tf_twice.accounting import blocks as blocks_lib

_Blocks = Union[float, Tuple[float, ...]]


def _scalar_or_tuple(value):
    """Keeps scalars, freezes sequences into tuples (events are hashable)."""
    if isinstance(value, (list, tuple)) or hasattr(value, 'tolist'):
        value = value.tolist() if hasattr(value, 'tolist') else value
        return tuple(value) if isinstance(value, (list, tuple)) else value
    return value


@attr.s(frozen=True, slots=True, auto_attribs=True)
class TwiceSampledGaussianDpEvent(dp_accounting.DpEvent):
    """One step of DP-SGD with twice sampling and hybrid clipping.

    Examples are Poisson-sampled with rate `example_sampling_rate` (q1); each
    coordinate of each sampled example's clipped contribution is kept with
    probability `coordinate_sampling_rate` (q2, or q2_j in block j: a float
    or one per block); block j is clipped to
    l2 <= l2_norm_clip[j] and then |coordinate| <= linf_norm_clip[j], and the
    sum gets N(0, (noise_multiplier[j] * l2_norm_clip[j])^2) on every
    coordinate of block j. Per-block fields are floats (one block) or
    equal-length tuples. `linf_norm_clip=None` (the default) means no
    l-infinity clipping.
    `block_dimensions` (number of coordinates per block) is optional; it can
    only tighten the bound.

    The event carries q1 itself, so it must not be wrapped in
    `PoissonSampledDpEvent`; it composes inside `SelfComposedDpEvent` and
    `ComposedDpEvent`. The RDP is given by `twice_sampling_rdp`; add-or-remove
    adjacency.
    """
    example_sampling_rate: float
    coordinate_sampling_rate: _Blocks = attr.ib(converter=_scalar_or_tuple)
    noise_multiplier: _Blocks = attr.ib(converter=_scalar_or_tuple)
    l2_norm_clip: _Blocks = attr.ib(converter=_scalar_or_tuple)
    linf_norm_clip: Optional[_Blocks] = attr.ib(default=None,
                                                converter=_scalar_or_tuple)
    block_dimensions: Optional[Union[int, Tuple[int, ...]]] = attr.ib(
        default=None, converter=_scalar_or_tuple)

    def __attrs_post_init__(self):
        _validate.rate('example_sampling_rate', self.example_sampling_rate)
        self.blocks()

    def blocks(self) -> blocks_lib.Blocks:
        """The validated per-block parameters, rates included."""
        return blocks_lib.Blocks.from_arguments(
            self.noise_multiplier, self.l2_norm_clip, self.linf_norm_clip,
            self.block_dimensions, self.coordinate_sampling_rate)
