"""Checks of the aggregation's raw arguments, one block or several.

The functions of ``tf_twice.mechanism.aggregation`` are public and take raw
numbers, so they check their arguments although the training paths pass a
``TwiceSamplingConfig`` that is already validated. The checks are host-side
Python, run when a step is traced, not in the step's graph: a block's
numbers get ``config.Block``'s own checks, so the kernels, the config and
the accounting refuse the same values with the same messages. Per-block
arguments (one entry per block) are normalised to lists here, and an error
names the block and the argument.
"""

from typing import List, Optional, Sequence

import attr
import numpy as np
import tensorflow as tf

from tf_twice import _validate
from tf_twice import config as config_lib
# The block limit belongs to the TF-free config; the kernel uses the same.
from tf_twice.config import MAX_BLOCKS
from tf_twice.mechanism import randomness

__all__ = [
    'check_blocks',
    'per_block',
    'scalar_or_per_block',
    'validate_each_block',
    'validate_params',
]


def validate_params(
    *,
    l2_norm_clip: Optional[float] = None,
    linf_norm_clip: Optional[float] = None,
    noise_multiplier: Optional[float] = None,
    coordinate_sampling_rate: Optional[float] = None,
    expected_batch_size: Optional[float] = None,
) -> None:
    """Raises ValueError naming the first argument outside its allowed range.

    A block's numbers get ``config.Block``'s own checks (its fields'
    converters), the rate and the expected batch size the config's;
    arguments left as None are not checked (``linf_norm_clip=None`` means
    "no l-infinity clipping"). Noise 0 is allowed here: the config decides
    whether a run may be noise-free.
    """
    fields = attr.fields_dict(config_lib.Block)
    for name, value in (('l2_norm_clip', l2_norm_clip),
                        ('linf_norm_clip', linf_norm_clip),
                        ('noise_multiplier', noise_multiplier)):
        if value is not None:
            fields[name].converter(value)
    if coordinate_sampling_rate is not None:
        config_lib.check_coordinate_sampling_rate(coordinate_sampling_rate)
    if expected_batch_size is not None:
        _validate.positive('expected_batch_size', expected_batch_size)


def validate_each_block(**per_block_values: list) -> None:
    """``validate_params`` on block j's values of each named argument; the
    error names the block."""
    for j, values in enumerate(zip(*per_block_values.values())):
        try:
            validate_params(**dict(zip(per_block_values, values)))
        except ValueError as err:
            raise ValueError(f'block {j}: {err}') from err


def per_block(name: str, values, num_blocks: int) -> list:
    """A per-block argument as a list of length ``num_blocks``."""
    if values is None:
        return [None] * num_blocks
    if isinstance(values, (str, bytes)) or not isinstance(
            values, Sequence) and not hasattr(values, 'tolist'):
        raise ValueError(
            f'{name} must be a sequence with one entry per block '
            f'({num_blocks}), got {values!r}.')
    values = list(values.tolist() if hasattr(values, 'tolist') else values)
    # numpy scalars as Python numbers: the kernels trace them as constants
    # of the gradients' dtype (a float64 tensor would not cast).
    values = [v.item() if isinstance(v, np.generic) else v for v in values]
    if len(values) != num_blocks:
        raise ValueError(
            f'{name} must have one entry per block ({num_blocks}), got '
            f'{len(values)}.')
    return values


def scalar_or_per_block(name: str, value, num_blocks: int) -> list:
    """A number for every block, or one per block (`per_block`), as a list
    of length ``num_blocks``."""
    if np.ndim(value) == 0 and not isinstance(value, (str, bytes)):
        return [value.item() if hasattr(value, 'item') else value] * (
            num_blocks)
    return per_block(name, value, num_blocks)


def check_blocks(blocks) -> List[List[tf.Tensor]]:
    """``blocks`` as lists of tensors [B, *shape] with static per-example
    shapes, at most ``MAX_BLOCKS`` of them, each within the stream layout."""
    if isinstance(blocks, (tf.Tensor, str)) or not blocks:
        raise ValueError('blocks must be a non-empty sequence of blocks, '
                         'each a non-empty list of tensors [B, ...].')
    if len(blocks) > MAX_BLOCKS:
        raise ValueError(f'blocks must hold at most {MAX_BLOCKS} blocks, got '
                         f'{len(blocks)}.')
    out = []
    for j, block in enumerate(blocks):
        tensors = [tf.convert_to_tensor(g) for g in block]
        if not tensors:
            raise ValueError(f'blocks[{j}] must contain at least one tensor.')
        randomness.check_block_index(j, len(tensors))
        for g in tensors:
            if g.shape.rank is None or g.shape.rank < 1 or (
                    not g.shape[1:].is_fully_defined()):
                raise ValueError(
                    'per-example tensors must have static shapes [B, *shape]; '
                    f'got {g.shape} in blocks[{j}].')
        out.append(tensors)
    return out
