"""Where every variable's coordinates sit in a block-diagonal basis.

A ``HybridBasis`` is block-diagonal over parameter groups: ``groups``
partitions the variable indices 0..V-1, and group g's flat vector is the
concatenation of its variables' flattened values, in the listed order (d_g
coordinates). This module checks such a structure, sizes it, and moves
tensors between the three layouts of a step, keeping leading (batch)
dimensions:

* per variable: [..., *shape_v], as Keras gives gradients;
* per group: [..., d_g], what the basis projects;
* flat: [..., d] in natural variable order 0..V-1.

Structure only: nothing here holds or reads the basis values, so the
host-side learning code (``tf_twice.hybrid.learning``) checks a structure
with the same rules as ``HybridBasis`` does.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf

from tf_twice import _validate

__all__ = [
    'ArrayLike',
    'basis_memory_bytes',
    'check_groups',
    'check_per_group',
    'check_shapes',
    'flatten',
    'merge_flat',
    'reshape_tail',
    'size',
    'split_flat',
    'unflatten',
]

ArrayLike = Union[np.ndarray, tf.Tensor]
Groups = Tuple[Tuple[int, ...], ...]
Shapes = Tuple[Tuple[int, ...], ...]


def check_groups(groups: Sequence[Sequence[int]],
                 num_variables: int) -> Groups:
    """Checks that ``groups`` partitions range(num_variables)."""
    try:
        normalised = tuple(
            tuple(_validate.integer('groups entries', v, 0) for v in group)
            for group in groups)
    except TypeError as err:
        raise ValueError(
            'groups must be a sequence of sequences of variable indices; '
            f'got {groups!r}.') from err
    if not normalised or any(not group for group in normalised):
        raise ValueError(
            f'groups must be non-empty lists of variable indices; got '
            f'{groups!r}.')
    flat = sorted(v for group in normalised for v in group)
    if flat != list(range(num_variables)):
        raise ValueError(
            'groups must partition the variable indices 0..'
            f'{num_variables - 1}, each exactly once; got {groups!r}.')
    return normalised


def check_shapes(variable_shapes: Sequence[Sequence[int]]) -> Shapes:
    shapes = tuple(
        tuple(_validate.integer('variable_shapes entries', s, 1)
              for s in shape)
        for shape in variable_shapes)
    if not shapes:
        raise ValueError('variable_shapes must name at least one variable.')
    return shapes


def size(shape: Sequence[int]) -> int:
    return int(math.prod(shape))


def basis_memory_bytes(group_dims: Sequence[int],
                       group_ranks: Sequence[Sequence[int]],
                       bytes_per_float: int = 4) -> int:
    """Bytes of a block-diagonal basis: sum_g d_g * k_g * bytes_per_float.

    Computed from shapes only (nothing is allocated), e.g. to size a basis
    before learning it: ResNet22 (d = 291,898) with k = 3,250 in one group is
    291,898 * 3,250 * 4 bytes = 3.8 GB.
    """
    if len(group_dims) != len(group_ranks):
        raise ValueError(
            'group_dims and group_ranks must have one entry per group; got '
            f'{len(group_dims)} and {len(group_ranks)}.')
    return int(sum(int(d) * int(sum(r)) * int(bytes_per_float)
                   for d, r in zip(group_dims, group_ranks)))


def reshape_tail(t: tf.Tensor, lead: int, tail: List[int]) -> tf.Tensor:
    """Reshapes t to t.shape[:lead] + tail, keeping static shapes."""
    if lead == 0:
        return tf.reshape(t, tail)
    if lead == 1:
        return tf.reshape(t, [-1] + tail)
    return tf.reshape(t, tf.concat([tf.shape(t)[:lead], tail], 0))


def _by_group(per_variable: Sequence[tf.Tensor],
              groups: Groups) -> List[tf.Tensor]:
    """Flat per-variable pieces [..., size_v] -> per group [..., d_g]."""
    return [per_variable[group[0]] if len(group) == 1 else
            tf.concat([per_variable[v] for v in group], axis=-1)
            for group in groups]


def _tensors(name: str, values: Sequence[ArrayLike], count: int,
             unit: str) -> List[tf.Tensor]:
    if len(values) != count:
        raise ValueError(f'{name} must have {count} tensors (one per {unit}); '
                         f'got {len(values)}.')
    return [tf.convert_to_tensor(t) for t in values]


def check_per_group(name: str, per_group: Sequence[ArrayLike],
                    group_dims: Sequence[int]) -> List[tf.Tensor]:
    """Tensors [..., d_g], one per group, as tensors."""
    per_group = _tensors(name, per_group, len(group_dims), 'group')
    for g, (t, d_g) in enumerate(zip(per_group, group_dims)):
        if t.shape.rank is None or t.shape.rank < 1 or t.shape[-1] != d_g:
            raise ValueError(f'{name}[{g}] must have last dimension d_g = '
                             f'{d_g}; got shape {t.shape}.')
    return per_group


def flatten(per_variable: Sequence[ArrayLike], groups: Groups,
            variable_shapes: Shapes) -> List[tf.Tensor]:
    """Per-variable tensors [..., *shape_v] -> per-group [..., d_g]."""
    per_variable = _tensors('per_variable', per_variable,
                            len(variable_shapes), 'variable')
    flat = []
    for v, (t, shape) in enumerate(zip(per_variable, variable_shapes)):
        lead = t.shape.rank - len(shape)
        if lead < 0 or tuple(t.shape[lead:]) != shape:
            raise ValueError(
                f'per_variable[{v}] must end in shape {shape}; got '
                f'{t.shape}.')
        flat.append(reshape_tail(t, lead, [size(shape)]))
    return _by_group(flat, groups)


def unflatten(per_group: Sequence[tf.Tensor], groups: Groups,
              variable_shapes: Shapes) -> List[tf.Tensor]:
    """Per-group tensors [..., d_g] -> per-variable [..., *shape_v].

    The caller has checked every group's last dimension.
    """
    out: List[Optional[tf.Tensor]] = [None] * len(variable_shapes)
    for group, t in zip(groups, per_group):
        sizes = [size(variable_shapes[v]) for v in group]
        pieces = tf.split(t, sizes, axis=-1) if len(group) > 1 else [t]
        for v, piece in zip(group, pieces):
            out[v] = reshape_tail(piece, piece.shape.rank - 1,
                                  list(variable_shapes[v]))
    return out


def split_flat(x: ArrayLike, groups: Groups,
               variable_shapes: Shapes) -> List[tf.Tensor]:
    """[..., d] in natural order (variables 0..V-1) -> per group."""
    x = tf.convert_to_tensor(x)
    sizes = [size(s) for s in variable_shapes]
    if x.shape.rank is None or x.shape[-1] != sum(sizes):
        raise ValueError(f'x must have last dimension d = {sum(sizes)}; got '
                         f'shape {x.shape}.')
    pieces = tf.split(x, sizes, axis=-1) if len(sizes) > 1 else [x]
    return _by_group(pieces, groups)


def merge_flat(per_variable: Sequence[tf.Tensor],
               variable_shapes: Shapes) -> tf.Tensor:
    """Per-variable [..., *shape_v] -> [..., d] in natural variable order."""
    return tf.concat([
        reshape_tail(t, t.shape.rank - len(s), [size(s)])
        for t, s in zip(per_variable, variable_shapes)], axis=-1)
