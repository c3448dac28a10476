"""Validated per-block parameters shared by every accounting entry point.

A hybrid-clipping step has m blocks; block j has noise multiplier z_j, l2 clip
c2_j, l-infinity clip c_inf_j, coordinate sampling rate q2_j and (optionally)
its number of coordinates r_j. Each public function accepts scalars (one
block) or equal-length sequences and normalises them here into one `Blocks`
record, which every accounting computation takes alone, so the per-block
validation and its error messages live in one place; the generic checks
(positive, rate, integer) are ``tf_twice._validate``'s.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple, Union

import attr

from tf_twice import _validate

ScalarOrBlocks = Union[float, Sequence[float]]
OptionalScalarOrBlocks = Union[None, float, Sequence[Optional[float]]]


def check_coordinate_rates(
        value: ScalarOrBlocks) -> Union[float, Tuple[float, ...]]:
    """q2 in (0, 1] for every block (a float), or a sequence of one q2_j
    per block (returned as a tuple)."""
    name = 'coordinate_sampling_rate'
    if hasattr(value, 'tolist'):  # numpy arrays and scalars.
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        return _validate.rate(name, value)
    return tuple(_validate.rate(f'{name}[{j}]', q)
                 for j, q in enumerate(_as_tuple(name, value)))


def _as_tuple(name: str, value, allow_none: bool = False) -> Tuple:
    if value is None and allow_none:
        return (None,)
    if isinstance(value, (str, bytes)):
        raise ValueError(f'{name} must be a number or a sequence of numbers; '
                         f'got {value!r}.')
    if hasattr(value, 'tolist'):  # numpy arrays and scalars.
        value = value.tolist()
    if isinstance(value, Sequence):
        values = tuple(value)
        if not values:
            raise ValueError(f'{name} must not be empty.')
        return values
    return (value,)


@attr.s(frozen=True, slots=True, auto_attribs=True)
class Blocks:
    """Per-block parameters, validated; all tuples have length `size`.

    Not ``tf_twice.config.Block``: a config's blocks may leave the noise
    (to calibrate) and the rate (the config's) open and are held to the
    mechanism's limits (e.g. q2 >= 2**-16, the mask resolution), while the
    accounting resolves every value and accepts any rate in (0, 1].

    Attributes:
      noise_multipliers: z_j > 0; block j's noise std is z_j * c2_j.
      l2_norm_clips: c2_j > 0.
      linf_norm_clips: c_inf_j > 0, capped at c2_j (a larger l-infinity clip
        has no effect after l2 clipping).
      dimensions: r_j (number of coordinates) or None when unknown.
      coordinate_sampling_rates: q2_j in (0, 1], the keep rate of block
        j's coordinates.
    """
    noise_multipliers: Tuple[float, ...]
    l2_norm_clips: Tuple[float, ...]
    linf_norm_clips: Tuple[float, ...]
    dimensions: Optional[Tuple[int, ...]]
    coordinate_sampling_rates: Tuple[float, ...]

    @property
    def size(self) -> int:
        return len(self.noise_multipliers)

    @classmethod
    def from_arguments(
        cls,
        noise_multiplier: ScalarOrBlocks,
        l2_norm_clip: ScalarOrBlocks,
        linf_norm_clip: OptionalScalarOrBlocks,
        block_dimensions: Optional[Union[int, Sequence[int]]] = None,
        coordinate_sampling_rate: ScalarOrBlocks = 1.0,
        noise_multiplier_name: str = 'noise_multiplier',
        l2_norm_clip_name: str = 'l2_norm_clip',
        linf_norm_clip_name: str = 'linf_norm_clip',
        block_dimensions_name: str = 'block_dimensions',
    ) -> 'Blocks':
        """Validates user arguments (scalars or per-block sequences).

        A scalar is broadcast to the number of blocks given by the longest
        sequence argument; sequences must all have that length.
        `linf_norm_clip=None` (or a None entry) means no l-infinity clipping.
        The rates are one for every block or one per block; they do not
        set the number of blocks (a rate tuple for a scalar noise is refused,
        not read as several blocks).
        """
        rates = check_coordinate_rates(coordinate_sampling_rate)
        named = [
            (noise_multiplier_name, _as_tuple(noise_multiplier_name,
                                              noise_multiplier)),
            (l2_norm_clip_name, _as_tuple(l2_norm_clip_name, l2_norm_clip)),
            (linf_norm_clip_name, _as_tuple(linf_norm_clip_name,
                                            linf_norm_clip, allow_none=True)),
        ]
        if block_dimensions is not None:
            named.append((block_dimensions_name,
                          _as_tuple(block_dimensions_name, block_dimensions)))
        size = max(len(values) for _, values in named)
        broadcast = {}
        for name, values in named:
            if len(values) == 1:
                values = values * size
            elif len(values) != size:
                lengths = ', '.join(f'{n}: {len(v)}' for n, v in named)
                raise ValueError(
                    f'{name} has {len(values)} blocks but another argument '
                    f'has {size}; per-block arguments must have equal lengths '
                    f'({lengths}).')
            broadcast[name] = values

        noise = tuple(_validate.positive(f'{noise_multiplier_name}[{j}]', z)
                      for j, z in enumerate(broadcast[noise_multiplier_name]))
        l2 = tuple(_validate.positive(f'{l2_norm_clip_name}[{j}]', c)
                   for j, c in enumerate(broadcast[l2_norm_clip_name]))
        linf = []
        for j, c in enumerate(broadcast[linf_norm_clip_name]):
            if c is None:
                linf.append(l2[j])
            else:
                linf.append(min(_validate.positive(
                    f'{linf_norm_clip_name}[{j}]', c), l2[j]))
        dims = None
        if block_dimensions is not None:
            dims = tuple(
                _validate.integer(f'{block_dimensions_name}[{j}]', r, 1)
                for j, r in enumerate(broadcast[block_dimensions_name]))
        if not isinstance(rates, tuple):
            rates = (rates,) * size
        elif len(rates) != size:
            raise ValueError(
                f'coordinate_sampling_rate must be one rate for every block '
                f'or one per block ({size}); got {len(rates)} rates.')
        return cls(noise, l2, tuple(linf), dims, rates)

    def with_noise_multipliers(self, noise_multipliers) -> 'Blocks':
        """These blocks with other (valid) z_j: a noise search's step."""
        return attr.evolve(self, noise_multipliers=tuple(
            float(z) for z in noise_multipliers))

    def effective_noise_multiplier(self) -> float:
        """z_eff with 1/z_eff^2 = sum_j 1/z_j^2 (the q2 = 1 equivalent)."""
        return sum(z ** -2 for z in self.noise_multipliers) ** -0.5

    def worst_case_coordinates(self, j: int) -> Tuple[int, float]:
        """Block j's dominating sensitivity (remark after [COORD]).

        Returns (n, c_last): n coordinates at c_inf_j and one more at c_last
        (c_last = 0 when there is none), with n * c_inf^2 + c_last^2 = c2^2,
        or n = r_j coordinates at c_inf and nothing else when the block has
        only r_j <= d0 coordinates.
        """
        c2, cinf = self.l2_norm_clips[j], self.linf_norm_clips[j]
        d0 = (c2 / cinf) ** 2
        n = math.floor(d0)
        # A ratio that is an integer up to rounding has no fractional part.
        if d0 - n > 1.0 - 1e-9:
            n += 1
        if self.dimensions is not None and self.dimensions[j] <= n:
            return self.dimensions[j], 0.0
        # Rounding n up above is sound: n * c_inf^2 >= c2^2 then.
        # c'^2 = c2^2 - n c_inf^2 = c_inf^2 (d0 - n): the right-hand form
        # avoids cancelling two numbers of size c2^2 when n is huge.
        return n, cinf * math.sqrt(max(d0 - n, 0.0))
