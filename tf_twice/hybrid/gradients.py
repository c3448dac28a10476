"""The one reader of per-example gradients handed to the host-side tools.

``learning.learn_basis``, ``block_statistics.public_block_statistics``,
``diagnostics.gradient_geometry`` and ``diagnostics.coordinate_significance``
take per-example gradients in either of two forms: one 2-D array [n, d]
(variables in natural order), or per-variable arrays [n, *shape_v] sharing n
(what ``tf_twice.keras.basis_refresh.public_per_example_gradients``
returns). ``read_gradients`` accepts both, checks them the same way, and
returns the layout its caller computes on.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import numpy as np
import tensorflow as tf

from tf_twice.mechanism import basis_layout

__all__ = ['LAYOUTS', 'read_gradients']

LAYOUTS = ('matrix', 'per_variable')


def read_gradients(
        gradients, name: str, *, layout: str,
        variable_shapes: Optional[Sequence[Sequence[int]]] = None
) -> Union[np.ndarray, List[np.ndarray]]:
    """Per-example gradients as float32 numpy arrays, checked.

    Args:
      gradients: a 2-D array or tensor [n, d], or a sequence of per-variable
        arrays [n, *shape_v].
      name: the argument's name, for the error messages.
      layout: ``'matrix'``: one [n, d] array, variables in natural order;
        ``'per_variable'``: a list of [n, *shape_v] arrays (a 2-D input is
        cut by ``variable_shapes``, or stays one variable of shape (d,)).
      variable_shapes: optional shapes that the variables must have.

    Raises:
      ValueError: unless every variable holds the same n >= 1 examples, the
        shapes agree with ``variable_shapes``, and every value is finite.
    """
    if layout not in LAYOUTS:
        raise ValueError(f'layout must be one of {LAYOUTS}; got {layout!r}.')
    if isinstance(gradients, (np.ndarray, tf.Tensor)):
        matrix = np.asarray(gradients, dtype=np.float32)
        if matrix.ndim != 2:
            raise ValueError(
                f'{name} as one array must be 2-D [n, d]; got shape '
                f'{matrix.shape}.')
        per_variable = [matrix]
        if variable_shapes is not None:
            per_variable = _cut(matrix, basis_layout.check_shapes(
                variable_shapes), name)
    else:
        per_variable = [np.asarray(t, dtype=np.float32) for t in gradients]
        if not per_variable:
            raise ValueError(f'{name} must hold at least one variable.')
        if variable_shapes is not None and (
                [t.shape[1:] for t in per_variable]
                != list(basis_layout.check_shapes(variable_shapes))):
            raise ValueError(
                f'variable_shapes must match the {name}; got '
                f'{variable_shapes!r}.')
    n = per_variable[0].shape[0] if per_variable[0].ndim else 0
    if n < 1 or any(t.ndim < 1 or t.shape[0] != n for t in per_variable):
        raise ValueError(
            f'{name} must hold the same n >= 1 examples for every variable; '
            f'got shapes {[t.shape for t in per_variable]}.')
    if not all(np.all(np.isfinite(t)) for t in per_variable):
        raise ValueError(f'{name} must be finite.')
    if layout == 'per_variable':
        return per_variable
    if len(per_variable) == 1 and per_variable[0].ndim == 2:
        return per_variable[0]
    return np.concatenate([t.reshape(n, -1) for t in per_variable], axis=1)


def _cut(matrix: np.ndarray, shapes, name: str) -> List[np.ndarray]:
    """[n, d] -> per-variable [n, *shape_v] views, in natural order."""
    sizes = [basis_layout.size(s) for s in shapes]
    if sum(sizes) != matrix.shape[1]:
        raise ValueError(
            f'variable_shapes must cover the d = {matrix.shape[1]} '
            f'coordinates of {name}; they cover {sum(sizes)}.')
    pieces = np.split(matrix, np.cumsum(sizes)[:-1], axis=1)
    return [p.reshape((-1,) + s) for p, s in zip(pieces, shapes)]
