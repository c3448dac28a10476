"""Per-example gradient geometry: what hybrid clipping can exploit.

The numbers behind the paper's figure "Statistics of Per-sample Gradient of
ResNet22 on CIFAR 10 with Sparsification and Low-rank Approximation": for
each example, the l2 norm of its projection onto every principal block, the
residual after the low-rank projection (after each block in turn), the
residual after keeping only s coordinates (sparsification), and the
l-infinity norm; plus the coordinate-wise coefficient of variation. A stable
principal norm with a small l-infinity norm is the geometry that hybrid
clipping with an l-infinity bound captures at little clipping bias.

These are diagnostics: computed on private gradients they are NOT private and
must not be used to choose clip budgets (use public data for that, see
``tf_twice.hybrid.public_block_norms``). Pure numpy and TensorFlow; no plotting.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Union

import numpy as np
import tensorflow as tf

from tf_twice import _validate
from tf_twice.hybrid import gradients as gradients_lib
from tf_twice.mechanism import basis as basis_lib

__all__ = [
    'DEFAULT_QUANTILES',
    'GradientGeometry',
    'coordinate_significance',
    'gradient_geometry',
]

DEFAULT_QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


@dataclasses.dataclass(frozen=True)
class GradientGeometry:
    """Per-example geometry of n gradients (float64 arrays).

    Attributes:
      l2_norm: [n] ||g_i||_2 (after the optional clip).
      linf_norm: [n] ||g_i||_inf.
      top_s: the sparsification levels s, in the order given.
      sparsified_residual_norm: [n, len(top_s)]: the l2 norm of what is left
        of g_i after keeping s coordinates: its own s largest in magnitude,
        or the s most significant by a given (public) significance score.
      coordinate_cv: [d] |std / mean| of every coordinate over the examples
        (population std; inf where only the mean is 0, 0 for a constant
        coordinate).
      block_norms: [n, m-1] ||projection of g_i onto principal block j|| (the
        coefficients over all groups), or None without a basis.
      principal_norm: [n] norm of the projection onto all principal blocks.
      cumulative_residual_norm: [n, m-1]: ||g_i - sum_{l<=j} U_l a_l||, the
        residual after the first j + 1 blocks.
      residual_norm: [n] the residual block's norm ||g_i - U a_i||.
    """

    l2_norm: np.ndarray
    linf_norm: np.ndarray
    top_s: tuple
    sparsified_residual_norm: np.ndarray
    coordinate_cv: np.ndarray
    block_norms: Optional[np.ndarray] = None
    principal_norm: Optional[np.ndarray] = None
    cumulative_residual_norm: Optional[np.ndarray] = None
    residual_norm: Optional[np.ndarray] = None

    def summary(self, quantiles: Sequence[float] = DEFAULT_QUANTILES
                ) -> Dict[str, Dict[str, Union[float, List[float]]]]:
        """Mean, std and quantiles of every per-example field.

        Columns of 2-D fields are summarised separately (lists, one entry per
        block or per s); ``coordinate_cv`` over its finite entries.
        """
        qs = np.asarray(quantiles, dtype=np.float64)
        if qs.ndim != 1 or np.any(qs < 0) or np.any(qs > 1):
            raise ValueError(
                f'quantiles must be numbers in [0, 1]; got {quantiles!r}.')
        out = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, np.ndarray):
                continue
            if field.name == 'coordinate_cv':
                value = value[np.isfinite(value)]
            if value.size == 0:
                continue
            stats = {'mean': np.mean(value, axis=0),
                     'std': np.std(value, axis=0)}
            for q, v in zip(qs, np.quantile(value, qs, axis=0)):
                stats[f'q{q:g}'] = v
            out[field.name] = {k: (v.tolist() if np.ndim(v) else float(v))
                               for k, v in stats.items()}
        return out


def coordinate_significance(public_gradients) -> np.ndarray:
    """Mean |coordinate| over PUBLIC examples, [d]: the paper's score for
    choosing which coordinates a sparsification keeps."""
    matrix = gradients_lib.read_gradients(public_gradients,
                                          'public_gradients', layout='matrix')
    return np.mean(np.abs(matrix, dtype=np.float64), axis=0)


def gradient_geometry(per_example_gradients,
                      basis: Optional[basis_lib.HybridBasis] = None,
                      *,
                      top_s: Sequence[int] = (),
                      significance: Optional[np.ndarray] = None,
                      clip_norm: Optional[float] = None,
                      chunk_size: int = 256) -> GradientGeometry:
    """Computes the per-example geometry of gradients.

    Args:
      per_example_gradients: [n, d] (variables in natural order) or
        per-variable arrays [n, *shape_v].
      basis: optional ``HybridBasis`` over the same d coordinates; enables
        the block, principal and residual norms.
      top_s: sparsification levels s in [0, d].
      significance: optional [d] score (e.g. ``coordinate_significance`` of
        public gradients): keep the s highest-scoring coordinates for every
        example, as in the paper. Default: every example keeps its own s
        largest coordinates (the best any s-sparse approximation can do).
      clip_norm: if given (> 0), each example is first scaled to l2 norm
        <= clip_norm (the paper clips to 1 before its statistics).
      chunk_size: examples processed at a time (bounds memory).
    """
    matrix = gradients_lib.read_gradients(
        per_example_gradients, 'per_example_gradients', layout='matrix')
    n, d = matrix.shape
    if basis is not None and d != basis.dim:
        raise ValueError(
            f'per_example_gradients must have d = {basis.dim} coordinates '
            f'(the basis); got {d}.')
    top_s = tuple(int(s) for s in top_s)
    if any(s < 0 or s > d for s in top_s):
        raise ValueError(f'top_s entries must be in [0, {d}]; got {top_s}.')
    if significance is not None:
        significance = np.asarray(significance, dtype=np.float64)
        if significance.shape != (d,):
            raise ValueError(
                f'significance must have shape ({d},); got '
                f'{significance.shape}.')
        # Stable order: ties broken by coordinate index.
        ranked = np.argsort(-significance, kind='stable')
    if clip_norm is not None and not (clip_norm > 0 and math.isfinite(
            clip_norm)):
        raise ValueError(
            f'clip_norm must be a finite number > 0 or None; got {clip_norm}.')
    chunk_size = _validate.integer('chunk_size', chunk_size, 1)

    m1 = basis.num_principal_blocks if basis is not None else 0
    l2 = np.empty(n)
    linf = np.empty(n)
    sparse = np.empty((n, len(top_s)))
    blocks = np.empty((n, m1))
    cumulative = np.empty((n, m1))
    residual = np.empty(n)
    if clip_norm is not None:
        norms = np.linalg.norm(matrix.astype(np.float64), axis=1)
        scale = np.minimum(1.0, clip_norm / np.maximum(norms, 1e-300))
        matrix = (matrix * scale[:, None]).astype(np.float32)
    for start in range(0, n, chunk_size):
        rows = slice(start, min(n, start + chunk_size))
        x = matrix[rows].astype(np.float64)
        l2[rows] = np.linalg.norm(x, axis=1)
        linf[rows] = np.max(np.abs(x), axis=1)
        if top_s:
            if significance is None:
                # Sum of the d - s smallest squares = what s-sparsity leaves.
                tail = np.concatenate([np.zeros((x.shape[0], 1)), np.cumsum(
                    np.sort(np.square(x), axis=1), axis=1)], axis=1)
                sparse[rows] = np.sqrt(tail[:, [d - s for s in top_s]])
            else:
                # tail[:, s] = sum of squares outside the s top-ranked.
                ordered = np.square(x[:, ranked])
                tail = np.concatenate([
                    np.cumsum(ordered[:, ::-1], axis=1)[:, ::-1],
                    np.zeros((x.shape[0], 1))], axis=1)
                sparse[rows] = np.sqrt(tail[:, list(top_s)])
        if basis is not None:
            blocks[rows], cumulative[rows], residual[rows] = _basis_norms(
                basis, matrix[rows])
    geometry = dict(l2_norm=l2, linf_norm=linf, top_s=top_s,
                    sparsified_residual_norm=sparse,
                    coordinate_cv=_coefficient_of_variation(matrix))
    if basis is not None:
        geometry.update(
            block_norms=blocks,
            principal_norm=np.sqrt(np.sum(np.square(blocks), axis=1)),
            cumulative_residual_norm=cumulative, residual_norm=residual)
    return GradientGeometry(**geometry)


def _squared_norms(tensors) -> np.ndarray:
    return sum(np.sum(np.square(np.asarray(t, dtype=np.float64)), axis=-1)
               for t in tensors)


def _basis_norms(basis: basis_lib.HybridBasis, x: np.ndarray):
    """Block norms [b, m-1], cumulative residuals [b, m-1], residual [b]."""
    per_group = basis.split_flat(x)
    projection = basis.project(per_group)
    blocks = np.stack([np.sqrt(_squared_norms(block))
                       for block in projection.coefficients], axis=1)
    # Peel the blocks off one at a time, directly (no norm subtraction, so
    # small residuals keep their accuracy).
    left = list(per_group)
    cumulative = []
    for j, block in enumerate(projection.coefficients):
        left = [r - tf.matmul(a, basis.block(g, j), transpose_b=True)
                for g, (r, a) in enumerate(zip(left, block))]
        cumulative.append(np.sqrt(_squared_norms(left)))
    residual = np.sqrt(_squared_norms(projection.residual))
    return blocks, np.stack(cumulative, axis=1), residual


def _coefficient_of_variation(matrix: np.ndarray) -> np.ndarray:
    """|std / mean| per column, two-pass in float64 over column chunks."""
    n, d = matrix.shape
    cv = np.empty(d)
    width = max(1, 2**22 // n)
    for start in range(0, d, width):
        cols = matrix[:, start:start + width].astype(np.float64)
        mean = cols.mean(axis=0)
        std = np.sqrt(np.mean(np.square(cols - mean), axis=0))
        with np.errstate(divide='ignore', invalid='ignore'):
            ratio = np.abs(std / mean)
        # 0 / 0 (a constant zero coordinate) counts as no dispersion.
        cv[start:start + width] = np.where(std == 0, 0.0, ratio)
    return cv
