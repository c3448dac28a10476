"""One block of a DP step, and the blocks as the accounting reads them.

A hybrid-clipping step has m blocks; block j has noise multiplier z_j, l2 clip
c2_j, l-infinity clip c_inf_j, coordinate sampling rate q2_j and (optionally)
its number of coordinates r_j. ``Block`` is the one description of a block:
the config holds the user's (noise and rate may be left open), the
accounting resolves every value into ``Blocks``, and the aggregation
kernels' raw arguments are checked by building one. Its checks are the
generic ones of ``tf_twice._validate``, plus the masks' resolution for the
rate; an error names the argument and the allowed range.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import attr

from tf_twice import _validate

ScalarOrBlocks = Union[float, Sequence[float]]
OptionalScalarOrBlocks = Union[None, float, Sequence[Optional[float]]]

# A mask entry compares a uniform integer of b <= 16 random bits with
# rate * 2**b, so the keep probability is exactly the dyadic rate
# floor(q2 * 2**16) / 2**16 (``effective_coordinate_sampling_rate``).
MASK_PRECISION_BITS = 16
_MASK_LEVELS = 2**MASK_PRECISION_BITS


def effective_coordinate_sampling_rate(
        coordinate_sampling_rate: float) -> float:
    """The keep probability the masks realise: floor(q2 * 2**16) / 2**16.

    It equals q2 for dyadic rates such as 1/2 or 1/4 and is below q2 by less
    than 2**-16 otherwise. The twice-sampling RDP bound is non-decreasing in
    q2 (the number of kept coordinates is stochastically increasing in q2),
    so accounting at the nominal q2 covers the realised rate; the update is
    normalised by the realised rate, so it stays unbiased.
    """
    q2 = float(coordinate_sampling_rate)
    if q2 >= 1.0:
        return 1.0
    return math.floor(q2 * _MASK_LEVELS) / _MASK_LEVELS


def mask_bits_per_coordinate(coordinate_sampling_rate: float) -> int:
    """Random bits one mask entry uses: the least b in (1, 2, 4, 8, 16) with
    q2 * 2**b an integer. Dyadic rates such as 1/2 (b = 1) need far fewer
    random bits, and generating them dominates the cost of masking."""
    levels = effective_coordinate_sampling_rate(
        coordinate_sampling_rate) * _MASK_LEVELS
    for bits in (1, 2, 4, 8):
        if (levels / 2**(MASK_PRECISION_BITS - bits)).is_integer():
            return bits
    return MASK_PRECISION_BITS


def check_coordinate_sampling_rate(
        value: Any, name: str = 'coordinate_sampling_rate') -> float:
    """q2 in (0, 1] and at least the mask resolution 2**-16: a smaller rate
    would mask every coordinate."""
    q2 = _validate.rate(name, value)
    if effective_coordinate_sampling_rate(q2) <= 0:
        raise ValueError(
            f'{name} must be >= 2**-{MASK_PRECISION_BITS} '
            f'(the mask resolution); got {q2}.')
    return q2


def _optional(check, name: str):
    return lambda value: None if value is None else check(name, value)


@attr.s(frozen=True, slots=True, kw_only=True)
class Block:
    """Clipping and noise of one block of the gradient space.

    Attributes:
      l2_norm_clip: c2 > 0, the l2 bound of one example's vector in the
        block, in ``_validate.L2_CLIP_RANGE`` ([1e-12, 1e30]).
      noise_multiplier: z; the noise std on every coordinate is z * c2.
        None: to be chosen by ``TwiceSamplingConfig.calibrate``. Must be
        > 0 unless the config is explicitly ``non_private``.
      linf_norm_clip: c_inf > 0 applied to every coordinate after the l2
        clip, or None (no l-infinity clip). A value >= c2 has no effect.
      dimension: the block's number of coordinates (a hybrid basis's rank,
        or the residual's d), or None; it can only tighten the accounting.
      coordinate_sampling_rate: q2_j in (0, 1], the keep rate of this
        block's coordinates (1: unmasked, e.g. a principal block of hybrid
        clipping), or None for the config's ``coordinate_sampling_rate``.
        A rate per block departs from the paper's algorithm, whose masks
        share one rate; the accountant is exact for it (``rdp``). The
        accountant takes any rate; a config or a kernel also needs it at
        least the masks' resolution (``check_coordinate_sampling_rate``).
    """
    l2_norm_clip: float = attr.ib(
        converter=lambda v: _validate.l2_clip('l2_norm_clip', v))
    noise_multiplier: Optional[float] = attr.ib(
        default=None,
        converter=_optional(_validate.non_negative, 'noise_multiplier'))
    linf_norm_clip: Optional[float] = attr.ib(
        default=None, converter=_optional(_validate.positive,
                                          'linf_norm_clip'))
    dimension: Optional[int] = attr.ib(
        default=None,
        converter=lambda v: None if v is None else _validate.integer(
            'dimension', v, 1))
    coordinate_sampling_rate: Optional[float] = attr.ib(
        default=None,
        converter=_optional(_validate.rate, 'coordinate_sampling_rate'))

    def __attrs_post_init__(self):
        if (self.linf_norm_clip is not None
                and self.linf_norm_clip > self.l2_norm_clip):
            _warn_linf_above_l2(self.linf_norm_clip, self.l2_norm_clip)


@functools.lru_cache(maxsize=None)  # Once per pair: evolve() re-inits.
def _warn_linf_above_l2(linf_norm_clip: float, l2_norm_clip: float) -> None:
    # Sound, but most likely the two clips swapped.
    warnings.warn(
        f'linf_norm_clip = {linf_norm_clip:g} is larger than l2_norm_clip = '
        f'{l2_norm_clip:g}, so it clips nothing (no coordinate of an '
        'l2-clipped vector exceeds c2): were the two swapped? The '
        'l-infinity clip is usually c2 / sqrt(d0), e.g. c2 / 10.',
        UserWarning, stacklevel=2)


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


def _named_block(j: int, names: Dict[str, str], **fields) -> Block:
    """``Block(**fields)``, whose error names the caller's argument and the
    block (``l2_norm_clips[1] must be ...``) instead of the field."""
    try:
        return Block(**fields)
    except ValueError as err:
        message = str(err)
        for field, name in names.items():
            if message.startswith(field + ' '):
                raise ValueError(
                    f'{name}[{j}]{message[len(field):]}') from None
        raise


class BlockColumns:
    """The per-block columns of a class whose ``blocks`` is a tuple of
    ``Block`` (the config's, and the accounting's ``Blocks``)."""
    __slots__ = ()

    @property
    def l2_norm_clips(self) -> Tuple[float, ...]:
        return tuple(b.l2_norm_clip for b in self.blocks)

    @property
    def noise_multipliers(self) -> Tuple[Optional[float], ...]:
        return tuple(b.noise_multiplier for b in self.blocks)

    @property
    def linf_norm_clips(self) -> Tuple[Optional[float], ...]:
        return tuple(b.linf_norm_clip for b in self.blocks)

    @property
    def dimensions(self) -> Optional[Tuple[int, ...]]:
        """r_j of every block, or None unless all are known."""
        dims = tuple(b.dimension for b in self.blocks)
        return None if None in dims else dims


@attr.s(frozen=True, slots=True, auto_attribs=True)
class Blocks(BlockColumns):
    """The blocks of one step as the accounting reads them: ``Block``s with
    every value resolved.

    Every block has its noise multiplier z_j > 0 (a noise-free block has no
    guarantee to account), its rate q2_j, and an l-infinity clip c_inf_j <=
    c2_j (none given: c2_j; a larger one clips nothing after the l2 clip).
    Its columns (``BlockColumns``) are what the RDP computations
    vectorise over.
    """
    blocks: Tuple[Block, ...]

    @property
    def size(self) -> int:
        return len(self.blocks)

    @property
    def coordinate_sampling_rates(self) -> Tuple[float, ...]:
        return tuple(b.coordinate_sampling_rate for b in self.blocks)

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
        if not isinstance(rates, tuple):
            rates = (rates,) * size
        elif len(rates) != size:
            raise ValueError(
                f'coordinate_sampling_rate must be one rate for every block '
                f'or one per block ({size}); got {len(rates)} rates.')
        # The rates, dimensions and noise are checked, named, here; only the
        # clips' errors come from Block.
        names = {'l2_norm_clip': l2_norm_clip_name,
                 'linf_norm_clip': linf_norm_clip_name}
        dims = (None,) * size
        if block_dimensions is not None:
            # Every block's, when given: a Block alone may leave it open.
            dims = tuple(
                _validate.integer(f'{block_dimensions_name}[{j}]', r, 1)
                for j, r in enumerate(broadcast[block_dimensions_name]))
        blocks = []
        for j in range(size):
            # The accounting's own rule: a noise-free block is not private.
            _validate.positive(f'{noise_multiplier_name}[{j}]',
                               broadcast[noise_multiplier_name][j])
            block = _named_block(
                j, names,
                noise_multiplier=broadcast[noise_multiplier_name][j],
                l2_norm_clip=broadcast[l2_norm_clip_name][j],
                linf_norm_clip=broadcast[linf_norm_clip_name][j],
                dimension=dims[j], coordinate_sampling_rate=rates[j])
            c2, cinf = block.l2_norm_clip, block.linf_norm_clip
            blocks.append(attr.evolve(
                block, linf_norm_clip=c2 if cinf is None else min(cinf, c2)))
        return cls(tuple(blocks))

    def with_noise_multipliers(self, noise_multipliers) -> 'Blocks':
        """These blocks with other (valid) z_j: a noise search's step."""
        noise_multipliers = tuple(noise_multipliers)
        if len(noise_multipliers) != self.size:
            raise ValueError(f'noise_multipliers must hold one value per '
                             f'block ({self.size}); got '
                             f'{len(noise_multipliers)}.')
        return Blocks(tuple(
            attr.evolve(b, noise_multiplier=float(z))
            for b, z in zip(self.blocks, noise_multipliers)))

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
