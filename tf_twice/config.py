"""The one description of a twice-sampling DP-SGD mechanism (TF-free).

``TwiceSamplingConfig`` is the single source of truth for a training run's
privacy: the Poisson sampler, the private aggregator, the ``DpEvent``, the
ledger, the privacy statement and the noise calibration are all derived from
it, so nothing has to be reconciled. It is frozen and validated once, here.

One logical step on n = ``num_examples`` records (SPEC section 4):

1. Poisson-sample every record with rate q1 = expected_batch_size / n;
2. per sampled record and block j: clip the gradient's block to l2 <= c2_j,
   then every coordinate to |x| <= c_inf_j (if given);
3. keep each coordinate of block j with probability q2_j (the block's
   ``coordinate_sampling_rate``, else the config's q2);
4. sum, add N(0, (z_j c2_j)^2) to every coordinate of block j and divide
   block j by expected_batch_size * q2_j.

Guarantee: each such step is exactly ``config.dp_event()``
(``TwiceSampledGaussianDpEvent``), so T steps are (epsilon, delta)-DP with
``config.epsilon(T, delta)``.

What cannot be expressed: a noise multiplier of 0 (or any config without
noise) is only possible with the explicit ``non_private=True`` switch, whose
config has no ``dp_event`` and which the ledger and the statement refuse. A
config whose noise is still to be chosen (``noise_multiplier=None``) must be
``calibrate``d before it can train or be accounted.

Performance settings (physical batch size, seeds, jit) are not part of the
config: they live on the model and the data pipeline and cannot change the
guarantee.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence, Tuple

import attr

from tf_twice import _validate
from tf_twice import accounting
from tf_twice.accounting import conversion as conversion_lib
# One block's description and the masks' resolution belong to the
# accounting, which reads them too; they are the config's public names.
from tf_twice.accounting.blocks import Block
from tf_twice.accounting.blocks import BlockColumns
from tf_twice.accounting.blocks import MASK_PRECISION_BITS
from tf_twice.accounting.blocks import check_coordinate_sampling_rate
from tf_twice.accounting.blocks import effective_coordinate_sampling_rate
from tf_twice.accounting.blocks import mask_bits_per_coordinate

__all__ = ['Block', 'MASK_PRECISION_BITS', 'MAX_BLOCKS',
           'TwiceSamplingConfig', 'effective_coordinate_sampling_rate',
           'mask_bits_per_coordinate', 'steps_per_epoch']

# Every block draws from its own Philox streams; stream numbers must fit the
# signed 64-bit high word of the counter (mechanism/randomness.py).
MAX_BLOCKS = 2**22
_FORMAT = 'tf_twice.TwiceSamplingConfig'


def steps_per_epoch(example_sampling_rate: float) -> int:
    """Steps of one epoch of Poisson sampling at rate q1: round(1 / q1)
    (halves up), after which each example was used once in expectation."""
    return max(1, int(math.floor(1.0 / example_sampling_rate + 0.5)))


def _blocks_tuple(blocks: Any) -> Tuple[Block, ...]:
    if isinstance(blocks, Block):
        blocks = (blocks,)
    if isinstance(blocks, (str, bytes)) or not isinstance(blocks, Sequence):
        raise ValueError('blocks must be a sequence of tf_twice.config.Block; '
                         f'got {type(blocks).__name__}.')
    blocks = tuple(blocks)
    if not 1 <= len(blocks) <= MAX_BLOCKS:
        raise ValueError(f'blocks must hold between 1 and {MAX_BLOCKS} '
                         f'Blocks; got {len(blocks)}.')
    for j, block in enumerate(blocks):
        if not isinstance(block, Block):
            raise ValueError(f'blocks[{j}] must be a tf_twice.config.Block; '
                             f'got {type(block).__name__}.')
    return blocks


@attr.s(frozen=True, slots=True, kw_only=True)
class TwiceSamplingConfig(BlockColumns):
    """The mechanism of one DP-SGD run with twice sampling (frozen).

    Attributes:
      num_examples: n >= 1, the private dataset's size.
      expected_batch_size: n * q1 in (0, n]; examples are Poisson-sampled
        with rate q1 = expected_batch_size / n, and the update is divided by
        expected_batch_size * q2, never by the realised batch size.
      coordinate_sampling_rate: q2 in (0, 1] (at least 2**-16), the rate
        of every block that does not set its own; 1 is standard DP-SGD.
      blocks: one ``Block`` (standard or twice-sampled DP-SGD) or several
        (hybrid clipping: the principal blocks of a basis learned from
        public data, then the residual).
      non_private: True only for non-private baselines: noise multipliers
        may then be 0, and the config has no DpEvent (ledger and statement
        refuse it).
    """
    num_examples: int = attr.ib(
        converter=lambda v: _validate.integer('num_examples', v, 1))
    expected_batch_size: float = attr.ib(
        converter=lambda v: _validate.positive('expected_batch_size', v))
    coordinate_sampling_rate: float = attr.ib(
        default=1.0, converter=check_coordinate_sampling_rate)
    blocks: Tuple[Block, ...] = attr.ib(converter=_blocks_tuple)
    non_private: bool = attr.ib(default=False)

    def __attrs_post_init__(self):
        if self.expected_batch_size > self.num_examples:
            raise ValueError(
                f'expected_batch_size must be in (0, num_examples = '
                f'{self.num_examples}]; got {self.expected_batch_size}.')
        if not isinstance(self.non_private, bool):
            raise ValueError(f'non_private must be a bool; got '
                             f'{self.non_private!r}.')
        for j, block in enumerate(self.blocks):
            if block.coordinate_sampling_rate is not None:
                check_coordinate_sampling_rate(
                    block.coordinate_sampling_rate,
                    f'blocks[{j}].coordinate_sampling_rate')
        if not self.non_private:
            for j, block in enumerate(self.blocks):
                if block.noise_multiplier == 0:
                    raise ValueError(
                        f'blocks[{j}].noise_multiplier must be > 0 (or None '
                        'until calibrate); got 0. Noise-free training is '
                        'not private: only TwiceSamplingConfig(..., '
                        'non_private=True) allows it, and nothing accounts '
                        'it.')

    @classmethod
    def single(cls, *, num_examples: int, expected_batch_size: float,
               l2_norm_clip: float = 1.0,
               noise_multiplier: Optional[float] = None,
               linf_norm_clip: Optional[float] = None,
               coordinate_sampling_rate: float = 1.0,
               non_private: bool = False) -> 'TwiceSamplingConfig':
        """A one-block config in tf_privacy's terms (the common case)."""
        return cls(num_examples=num_examples,
                   expected_batch_size=expected_batch_size,
                   coordinate_sampling_rate=coordinate_sampling_rate,
                   blocks=(Block(l2_norm_clip=l2_norm_clip,
                                 noise_multiplier=noise_multiplier,
                                 linf_norm_clip=linf_norm_clip),),
                   non_private=non_private)

    # Derived quantities ----------------------------------------------------

    @property
    def example_sampling_rate(self) -> float:
        """q1 = expected_batch_size / num_examples."""
        return self.expected_batch_size / self.num_examples

    @property
    def effective_coordinate_sampling_rate(self) -> float:
        """The keep rate the masks realise for the config's own rate
        (``effective_...`` above)."""
        return effective_coordinate_sampling_rate(
            self.coordinate_sampling_rate)

    @property
    def mask_bits(self) -> int:
        """Random bits per mask entry at the config's own rate
        (``mask_bits_per_coordinate``)."""
        return mask_bits_per_coordinate(self.coordinate_sampling_rate)

    @property
    def coordinate_sampling_rates(self) -> Tuple[float, ...]:
        """q2_j of every block: its own, else the config's."""
        return tuple(self.coordinate_sampling_rate
                     if b.coordinate_sampling_rate is None
                     else b.coordinate_sampling_rate for b in self.blocks)

    @property
    def effective_coordinate_sampling_rates(self) -> Tuple[float, ...]:
        """The keep rates the masks realise, per block (``effective_...``
        above): the update of block j is divided by n q1 times its own."""
        return tuple(effective_coordinate_sampling_rate(q2)
                     for q2 in self.coordinate_sampling_rates)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def is_calibrated(self) -> bool:
        """Whether every block has its noise multiplier."""
        return None not in self.noise_multipliers

    # Accounting ------------------------------------------------------------

    def _require_private(self, what: str) -> None:
        if self.non_private:
            raise ValueError(
                f'{what}: this config is non_private (a baseline without a '
                'DP guarantee); there is nothing to account.')
        if not self.is_calibrated:
            raise ValueError(
                f'{what}: noise_multiplier is not set; choose it with '
                'config.calibrate(target_epsilon=..., delta=..., steps=...) '
                'or give it explicitly.')

    def _block_arguments(self) -> Dict[str, Any]:
        """The blocks as the accounting's per-block arguments, which
        ``accounting.blocks.Blocks.from_arguments`` alone resolves (the
        event's ``blocks()``, calibration). One block gives scalars,
        several give tuples, and a rate the blocks share stays one rate: so
        the events, and the ledger keys, of one-rate configs stay as they
        were."""
        def field(values):
            return values[0] if self.num_blocks == 1 else values

        rates, dims = self.coordinate_sampling_rates, self.dimensions
        return dict(
            coordinate_sampling_rate=(rates[0] if len(set(rates)) == 1
                                      else rates),
            noise_multiplier=field(self.noise_multipliers),
            l2_norm_clip=field(self.l2_norm_clips),
            linf_norm_clip=field(self.linf_norm_clips),
            block_dimensions=None if dims is None else field(dims))

    def dp_event(self) -> accounting.TwiceSampledGaussianDpEvent:
        """The DpEvent of one step: the ONLY place an event is built from a
        mechanism; its ``blocks()`` is the accounting's record of them."""
        self._require_private('dp_event')
        return accounting.TwiceSampledGaussianDpEvent(
            example_sampling_rate=self.example_sampling_rate,
            **self._block_arguments())

    def epsilon_and_optimal_order(
            self, steps: int, delta: float, *,
            orders: Optional[Sequence[float]] = None,
            conversion: conversion_lib.ConversionLike = 'dp_accounting'
    ) -> Tuple[float, float]:
        """(epsilon, optimal RDP order) after ``steps`` steps at ``delta``."""
        steps = _validate.integer('steps', steps, 1)
        delta = _validate.probability('delta', delta)
        accountant = accounting.TwiceSamplingRdpAccountant(
            accounting.DEFAULT_ORDERS if orders is None else orders)
        accountant.compose(self.dp_event(), steps)
        return accounting.rdp_to_epsilon(accountant.orders, accountant.rdp,
                                         delta, conversion)

    def epsilon(self, steps: int, delta: float, **kwargs) -> float:
        """Epsilon after ``steps`` steps at ``delta`` (a sound upper bound:
        exact RDP, then dp_accounting's conversion by default)."""
        return self.epsilon_and_optimal_order(steps, delta, **kwargs)[0]

    @property
    def steps_per_epoch(self) -> int:
        """round(1 / q1): steps after which each example was used once in
        expectation (``steps_per_epoch`` above)."""
        return steps_per_epoch(self.example_sampling_rate)

    def steps_for_epochs(self, epochs: float) -> int:
        """Steps of ``epochs`` epochs: ceil(epochs * steps_per_epoch)."""
        epochs = _validate.positive('epochs', epochs)
        return max(1, math.ceil(epochs * self.steps_per_epoch - 1e-9))

    def calibrate(self, *, target_epsilon: float, delta: float, steps: int,
                  orders: Optional[Sequence[float]] = None,
                  conversion: conversion_lib.ConversionLike = 'dp_accounting',
                  tolerance: float = 0.01) -> 'TwiceSamplingConfig':
        """This config with the smallest noise meeting (epsilon, delta).

        Every block gets the same noise multiplier z (hybrid clipping with
        per-block noise: ``tf_twice.hybrid.plan_blocks``). The returned
        config's ``epsilon(steps, delta)`` is at most the target, and
        within [(1 - tolerance) target, target] in all but the edge cases
        that ``accounting.calibrate_noise_multiplier`` lists.

        Raises:
          ValueError: on a non_private config, bad arguments, or a target
            that no z <= ``accounting.MAX_NOISE_MULTIPLIER`` meets.
        """
        if self.non_private:
            raise ValueError('calibrate: a non_private config has no '
                             'privacy guarantee to calibrate.')
        _validate.warn_if_delta_not_small(delta, self.num_examples)
        blocks = self._block_arguments()
        del blocks['noise_multiplier']  # What is calibrated.
        z = accounting.calibrate_noise_multiplier(
            target_epsilon=target_epsilon, delta=delta, steps=steps,
            example_sampling_rate=self.example_sampling_rate,
            orders=orders, conversion=conversion, tolerance=tolerance,
            **blocks)
        return self.with_noise_multipliers((z,) * self.num_blocks)

    # Derived configs -------------------------------------------------------

    def with_noise_multipliers(self, noise_multipliers: Sequence[float]
                               ) -> 'TwiceSamplingConfig':
        """This config with z_j per block (e.g. from per-block optimisation).
        """
        values = tuple(noise_multipliers)
        if len(values) != self.num_blocks:
            raise ValueError(
                f'noise_multipliers must hold one value per block '
                f'({self.num_blocks}); got {len(values)}.')
        return attr.evolve(self, blocks=tuple(
            attr.evolve(b, noise_multiplier=z)
            for b, z in zip(self.blocks, values)))

    def with_dimensions(self, dimensions: Sequence[int]
                        ) -> 'TwiceSamplingConfig':
        """This config with the blocks' dimensions (a basis's
        ``block_dimensions``); blocks whose dimension is already set must
        agree."""
        values = tuple(dimensions)
        if len(values) != self.num_blocks:
            raise ValueError(
                f'the basis has {len(values)} blocks (principal blocks, then '
                f'the residual) but the config has {self.num_blocks}: give '
                'the config one Block per basis block.')
        for j, (block, r) in enumerate(zip(self.blocks, values)):
            if block.dimension is not None and block.dimension != r:
                raise ValueError(
                    f'blocks[{j}].dimension is {block.dimension} but the '
                    f'basis block has {r} coordinates.')
        return attr.evolve(self, blocks=tuple(
            attr.evolve(b, dimension=r) for b, r in zip(self.blocks, values)))

    # Serialisation ---------------------------------------------------------

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready dict; ``from_dict`` restores the config."""
        return {'format': _FORMAT, 'version': 1,
                'num_examples': self.num_examples,
                'expected_batch_size': self.expected_batch_size,
                'coordinate_sampling_rate': self.coordinate_sampling_rate,
                'non_private': self.non_private,
                # A block without a rate of its own is written as before.
                'blocks': [{k: v for k, v in attr.asdict(b).items()
                            if v is not None or k != 'coordinate_sampling_rate'}
                           for b in self.blocks]}

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> 'TwiceSamplingConfig':
        if not isinstance(data, dict) or data.get('format') != _FORMAT or (
                data.get('version') != 1):
            raise ValueError(f'data must be a {_FORMAT} version 1 dict (from '
                             f'to_dict); got {str(data)[:80]!r}.')
        fields = {k: v for k, v in data.items()
                  if k not in ('format', 'version')}
        fields['blocks'] = tuple(Block(**b) for b in fields['blocks'])
        return cls(**fields)
