"""What the l2 budget splits read of PUBLIC gradients, block by block.

Under a ``HybridBasis`` (principal blocks, then the residual), each public
example's gradient has one projection per block. ``public_block_statistics``
reduces a set of public per-example gradients to the few numbers per block
that ``budget_splits`` turns into l2 clips: the per-example projection norms
(their mean sets the 'projection_norms' split, a quantile the 'quantile'
split) and the alignment and energy of the mean direction per block (the
'variance_optimal' split). It reads the gradients through
``gradients.read_gradients``, as the rest of ``tf_twice.hybrid`` does.

Privacy: feed PUBLIC gradients only: these statistics set clip budgets, and
budgets computed from private gradients would leak them.
"""

from __future__ import annotations

import math
from typing import Optional

import attr
import numpy as np

from tf_twice import _validate
from tf_twice.hybrid import gradients as gradients_lib
from tf_twice.mechanism import basis as basis_lib

__all__ = [
    'PublicBlockStatistics',
    'public_block_norms',
    'public_block_statistics',
]


@attr.s(frozen=True)
class PublicBlockStatistics:
    """What the budget splits read of public gradients, per block.

    Blocks are the basis's principal blocks, then the residual (m in all).

    Attributes:
      per_example_norms: [k, m] projection norms ||a_ij|| of every public
        example, after the optional pre-clip of ``public_block_statistics``.
      alignments: [m] w_j = <mu_j, u_j>, with mu_j block j of the mean raw
        public gradient (the paper's "raw gradient mean" v_0) and u_j the
        mean over examples of a_ij / ||a_ij|| (their clipped mean per unit
        clip when every example is clipped).
      direction_energies: [m] v_j = ||u_j||^2.
    """

    per_example_norms: np.ndarray = attr.ib()
    alignments: np.ndarray = attr.ib()
    direction_energies: np.ndarray = attr.ib()

    @property
    def mean_norms(self) -> np.ndarray:
        """n_j: the mean public projection norm of block j, shape [m]."""
        return np.mean(self.per_example_norms, axis=0)


def public_block_statistics(basis: basis_lib.HybridBasis,
                            public_gradients,
                            *,
                            clip_norm: Optional[float] = None,
                            chunk_size: int = 256) -> PublicBlockStatistics:
    """Per-block statistics of PUBLIC gradients under ``basis``.

    Block j's projection of one example is a_j, the concatenation over groups
    of its coefficients (||a_j|| = ||U_j a_j|| for an orthonormal basis); the
    residual's is g - U a. Feed only PUBLIC gradients: the result sets clip
    budgets, and budgets computed from private gradients would leak them.

    Args:
      basis: the basis.
      public_gradients: per-variable arrays [k_pub, *shape_v] or a 2-D array
        [k_pub, d] in natural variable order.
      clip_norm: if given (> 0), each example is first scaled to l2 norm
        <= clip_norm before its norms are taken, as the DP step clips (and so
        that a few large public gradients do not dominate the norms); the
        alignments read the raw gradients (the scaling keeps directions).
      chunk_size: examples projected at a time (bounds memory).
    """
    chunk_size = _validate.integer('chunk_size', chunk_size, 1)
    if clip_norm is not None and not (clip_norm > 0 and math.isfinite(
            clip_norm)):
        raise ValueError(
            f'clip_norm must be a finite number > 0 or None; got {clip_norm}.')
    per_group = [np.asarray(t) for t in basis.flatten(
        gradients_lib.read_gradients(
            public_gradients, 'public_gradients', layout='per_variable',
            variable_shapes=basis.variable_shapes))]
    n = per_group[0].shape[0]
    norms = []
    raw_sums = None  # Per block, sum_i a_ij (one array per group).
    unit_sums = None  # Per block, sum_i a_ij / ||a_ij||.
    for start in range(0, n, chunk_size):
        chunk = [x[start:start + chunk_size] for x in per_group]
        projection = basis.project(chunk)
        blocks = [[np.asarray(a, np.float64) for a in block]
                  for block in projection.coefficients]
        blocks.append([np.asarray(r, np.float64)
                       for r in projection.residual])
        block_norms = np.stack(
            [np.sqrt(sum(np.sum(np.square(a), axis=1) for a in block))
             for block in blocks], axis=1)
        inverse = np.where(block_norms > 0, 1.0 / np.maximum(
            block_norms, 1e-300), 0.0)
        raw = [[np.sum(a, axis=0) for a in block] for block in blocks]
        unit = [[inverse[:, j] @ a for a in block]
                for j, block in enumerate(blocks)]
        if raw_sums is None:
            raw_sums, unit_sums = raw, unit
        else:
            raw_sums = [[s + x for s, x in zip(b, c)]
                        for b, c in zip(raw_sums, raw)]
            unit_sums = [[s + x for s, x in zip(b, c)]
                         for b, c in zip(unit_sums, unit)]
        if clip_norm is not None:
            # Projection is linear: scaling the example scales its norms.
            total = np.sqrt(sum(np.sum(np.square(x, dtype=np.float64),
                                       axis=1) for x in chunk))
            block_norms *= np.minimum(
                1.0, clip_norm / np.maximum(total, 1e-300))[:, None]
        norms.append(block_norms)
    alignments = np.array([sum(float(np.dot(m, u)) for m, u in zip(mb, ub))
                           for mb, ub in zip(raw_sums, unit_sums)]) / n**2
    energies = np.array([sum(float(np.dot(u, u)) for u in ub)
                         for ub in unit_sums]) / n**2
    return PublicBlockStatistics(np.concatenate(norms, axis=0), alignments,
                                 energies)


def public_block_norms(basis: basis_lib.HybridBasis,
                       public_gradients,
                       *,
                       clip_norm: Optional[float] = None,
                       chunk_size: int = 256) -> np.ndarray:
    """Mean public ||projection onto block j||, residual last: shape [m].

    The ``mean_norms`` of ``public_block_statistics`` (same arguments); they
    set the 'projection_norms' split (``split_l2_budget``).
    """
    return public_block_statistics(basis, public_gradients,
                                   clip_norm=clip_norm,
                                   chunk_size=chunk_size).mean_norms

