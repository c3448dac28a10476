"""Learning a hybrid-clipping basis from PUBLIC per-example gradients.

Host-side numpy: everything here runs between training steps on public data
and produces a ``tf_twice.mechanism.basis.HybridBasis``.

* Grouping: ``partition_variables`` (contiguous groups of about equal size),
  ``groups_by_layer`` (one group per Keras layer), ``split_group_ranks``
  (each principal block's rank over the groups) and ``group_matrices``
  (per-variable gradients -> one [k_pub, d_g] matrix per group).
* ``learn_basis`` follows the paper's "Iterative Principal Space
  Approximation from Public Samples with Power Method": for each block a
  random start, a few power iterations U <- orth((M^T M) U), then deflation of
  the public per-example gradient matrix M before the next block. The
  orthonormalisation spans the same subspace as the paper's Gram-Schmidt/QR;
  it is done with small Gram matrices (eigen-decomposition, then a Cholesky
  pass), which is several times faster than Householder QR on tall matrices.

Privacy. A basis must depend only on public data and on the current model
(itself a DP output, so using it is post-processing). Nothing in this module
reads private data; the clip budgets built on a basis
(``tf_twice.hybrid.plan_blocks``) come from public gradients or from the user,
never from private statistics. The public gradients of a Keras model come from
``tf_twice.keras.basis_refresh.public_per_example_gradients``.
"""

from __future__ import annotations

import numbers
import warnings
from typing import List, Optional, Sequence, Union

import numpy as np
from scipy import linalg
import tensorflow as tf

from tf_twice import _validate
from tf_twice.hybrid import gradients as gradients_lib
# The structure checks and sizes that HybridBasis applies, reused so that a
# learned basis is checked against the same rules as one built by hand.
from tf_twice.mechanism import basis_layout
from tf_twice.mechanism.basis import DEFAULT_ORTHONORMALITY_TOLERANCE
from tf_twice.mechanism.basis import HybridBasis

__all__ = [
    'DEFAULT_POWER_ITERATIONS',
    'group_matrices',
    'groups_by_layer',
    'learn_basis',
    'partition_variables',
    'split_group_ranks',
]

# Power iterations per block. The error of a block's subspace shrinks like
# (s_{r+1} / s_r)^(2t) in the singular values s of the public matrix.
DEFAULT_POWER_ITERATIONS = 3
# A direction whose singular value in a power iterate is below this times the
# largest is treated as absent: the public matrix has no more rank there (and
# the float32 products cannot resolve it).
_RANK_TOLERANCE = 1e-6
_RANK_SPLITS = ('sqrt', 'proportional', 'equal')


# Grouping and rank allocation.


def partition_variables(variable_sizes: Sequence[int],
                        num_groups: int) -> List[List[int]]:
    """Splits variables 0..V-1 into ``num_groups`` contiguous groups.

    Cuts are placed where the cumulative size is nearest to multiples of
    d / num_groups, so groups are as equal in size as whole variables allow;
    every group is non-empty.
    """
    sizes = [_validate.integer('variable_sizes entries', s, 1)
             for s in variable_sizes]
    num_groups = _validate.integer('num_groups', num_groups, 1)
    if num_groups > len(sizes):
        raise ValueError(
            f'num_groups must be <= the number of variables ({len(sizes)}); '
            f'got {num_groups}.')
    cumulative = np.cumsum(sizes)
    total = cumulative[-1]
    cuts = [0]
    for i in range(1, num_groups):
        target = total * i / num_groups
        # The cut after variable c - 1, leaving room for later groups.
        low = cuts[-1] + 1
        high = len(sizes) - (num_groups - i)
        best = min(range(low, high + 1),
                   key=lambda c: (abs(cumulative[c - 1] - target), c))
        cuts.append(best)
    cuts.append(len(sizes))
    return [list(range(a, b)) for a, b in zip(cuts[:-1], cuts[1:])]


def groups_by_layer(model: tf.keras.Model) -> List[List[int]]:
    """One group per top-level layer, as indices into
    ``model.trainable_variables``; layers without trainable variables are
    skipped, and variables owned by no layer form a last group."""
    # By identity: Keras 3 variables have no ref(); both versions give
    # the same variable objects through the model and its layers.
    index = {id(v): i for i, v in enumerate(model.trainable_variables)}
    groups, seen = [], set()
    for layer in model.layers:
        group = [index[id(v)] for v in layer.trainable_variables
                 if id(v) in index and index[id(v)] not in seen]
        if group:
            groups.append(sorted(group))
            seen.update(group)
    rest = [i for i in range(len(index)) if i not in seen]
    if rest:
        groups.append(rest)
    return groups


def split_group_ranks(ranks: Sequence[int], group_dims: Sequence[int],
                      rank_split: str = 'sqrt') -> List[List[int]]:
    """Splits each principal block's rank r_j over the groups.

    Block j gives group g a share of r_j proportional to sqrt(d_g)
    (``'sqrt'``, the split of the paper's released code), d_g
    (``'proportional'``) or 1 (``'equal'``; with equal groups the memory is
    then exactly d * k / g), rounded so that sum_g r_{g,j} = r_j exactly and
    capped so that no group gets more columns than it has coordinates.

    Returns:
      ``group_ranks[g][j]``.
    """
    ranks = [_validate.integer('ranks entries', r, 1) for r in ranks]
    dims = np.array([_validate.integer('group_dims entries', d, 1)
                     for d in group_dims], dtype=np.int64)
    if not ranks:
        raise ValueError('ranks must name at least one principal block.')
    if rank_split not in _RANK_SPLITS:
        raise ValueError(
            f'rank_split must be one of {_RANK_SPLITS}; got {rank_split!r}.')
    if sum(ranks) > dims.sum():
        raise ValueError(
            f'ranks must sum to at most d = {int(dims.sum())}; got '
            f'{sum(ranks)}.')
    weights = {'sqrt': np.sqrt(dims), 'proportional': dims.astype(float),
               'equal': np.ones(len(dims))}[rank_split]
    used = np.zeros(len(dims), dtype=np.int64)
    table = []
    for r in ranks:
        alloc = _apportion(r, weights, dims - used)
        used += alloc
        table.append(alloc)
    return [[int(table[j][g]) for j in range(len(ranks))]
            for g in range(len(dims))]


def _apportion(total: int, weights: np.ndarray,
               caps: np.ndarray) -> np.ndarray:
    """Integers summing to ``total``, ~proportional to weights, <= caps.

    Largest-remainder rounding; a group whose cap binds keeps its cap and
    the excess is spread again over the others.
    """
    alloc = np.zeros(len(caps), dtype=np.int64)
    remaining = total
    while remaining > 0:
        room = caps - alloc
        w = np.where(room > 0, weights, 0.0)
        quota = remaining * w / w.sum()
        floor = np.floor(quota).astype(np.int64)
        take = np.minimum(floor, room)
        alloc += take
        remaining -= int(take.sum())
        if np.any(take < floor):
            continue  # a cap bound: re-spread what it could not take
        # Leftover units to the largest remainders (ties: lower index).
        order = np.lexsort((np.arange(len(quota)), floor - quota))
        for g in order:
            if remaining == 0:
                break
            if caps[g] > alloc[g]:
                alloc[g] += 1
                remaining -= 1
    return alloc


# Public gradients as group matrices.


def group_matrices(per_variable: Sequence[basis_layout.ArrayLike],
                   groups: Optional[Sequence[Sequence[int]]] = None
                   ) -> List[np.ndarray]:
    """Per-variable [k, *shape_v] arrays -> per-group [k, d_g] float32.

    Group g's columns are its variables' flattened values, in the listed
    order (the layout of ``HybridBasis.flatten``); default: one group.
    """
    arrays = [np.asarray(t, dtype=np.float32) for t in per_variable]
    if not arrays:
        raise ValueError('per_variable must hold at least one array.')
    n = arrays[0].shape[0]
    if any(a.ndim < 1 or a.shape[0] != n for a in arrays):
        raise ValueError(
            'per_variable arrays must share the leading (example) dimension; '
            f'got shapes {[a.shape for a in arrays]}.')
    if groups is None:
        groups = [list(range(len(arrays)))]
    groups = basis_layout.check_groups(groups, len(arrays))
    return [np.ascontiguousarray(np.concatenate(
        [arrays[v].reshape(n, -1) for v in group], axis=1))
        for group in groups]


# Learning.


def _project_out(w: np.ndarray, basis: np.ndarray,
                 passes: int = 1) -> np.ndarray:
    """w - B (B^T w); a second pass removes what the first one's rounding
    left behind (classical Gram-Schmidt twice)."""
    if basis.shape[1]:
        for _ in range(passes):
            w = w - basis @ (basis.T @ w)
    return w


def _gram_orthonormalize(w: np.ndarray) -> np.ndarray:
    """Orthonormal columns spanning w, strongest first, rank-revealing.

    Q = W V diag(lambda)^(-1/2) over the eigenpairs of W^T W with
    sqrt(lambda) > _RANK_TOLERANCE * its largest; weaker directions are
    dropped (the float32 products that made W cannot resolve them). Uses
    only matrix products on the tall W (Householder QR of a 79,530 x 118
    matrix is memory-bound and ~10x slower); the result's orthogonality
    error is O(eps * cond(W)^2), which ``_cholesky_orthonormalize`` removes.
    """
    if w.shape[1] == 0:
        return w
    lam, vec = np.linalg.eigh(w.T @ w)
    lam, vec = lam[::-1], vec[:, ::-1]
    keep = lam > (_RANK_TOLERANCE**2) * lam[0] if lam[0] > 0 else (
        np.zeros(lam.shape, dtype=bool))
    return (w @ vec[:, keep]) / np.sqrt(lam[keep])


def _cholesky_orthonormalize(q: np.ndarray) -> np.ndarray:
    """Q L^-T for Q^T Q = L L^T: restores orthonormality of an almost
    orthonormal Q to rounding level, keeping each column's direction order
    (triangular, unlike an eigenvector rotation)."""
    if q.shape[1] == 0:
        return q
    chol = np.linalg.cholesky(q.T @ q)
    return linalg.solve_triangular(chol, q.T, lower=True).T


def _orthonormal_columns(w: np.ndarray, previous: np.ndarray,
                         rng: np.random.Generator, final: bool) -> np.ndarray:
    """Orthonormal columns spanning w's columns, orthogonal to ``previous``.

    Where w has less rank than columns (the public matrix is exhausted, or
    a group's gradients vanish), the missing columns are random unit
    directions orthogonal to everything before: any orthonormal completion
    is a valid basis. Intermediate power iterates only need a well
    conditioned span; a ``final`` one is made orthonormal and orthogonal to
    ``previous`` to rounding level.
    """
    r = w.shape[1]
    q = _gram_orthonormalize(_project_out(w, previous, 2 if final else 1))
    if q.shape[1] < r:
        taken = np.concatenate([previous, q], axis=1)
        fill = rng.standard_normal((w.shape[0], r - q.shape[1]))
        fill = _gram_orthonormalize(_project_out(fill, taken, 2))
        q = np.concatenate([q, fill], axis=1)
    if final:
        q = _cholesky_orthonormalize(_project_out(q, previous, 1))
    return q


def _learn_group(matrix: np.ndarray, ranks: Sequence[int], iterations: int,
                 rng: np.random.Generator) -> np.ndarray:
    """The paper's iterative principal space approximation on one group.

    ``matrix`` is M [k_pub, d_g]. Deflation M <- M - M U U^T is applied
    implicitly: with U orthogonal to the earlier blocks (projector P),
    M_defl^T M_defl U = (I - P) M^T M U, so projecting the iterate out of the
    earlier blocks equals iterating with the deflated matrix, without copying
    M (2.3 GB for 2,000 ResNet22 gradients). Products with M run in M's
    dtype (float32); orthonormalisation runs in float64.
    """
    d = matrix.shape[1]
    previous = np.zeros((d, 0))
    for r in ranks:
        if r == 0:
            continue
        u = _orthonormal_columns(rng.standard_normal((d, r)), previous, rng,
                                 final=False)
        for t in range(iterations):
            w = (matrix.T @ (matrix @ u.astype(matrix.dtype))).astype(
                np.float64)
            u = _orthonormal_columns(w, previous, rng,
                                     final=t == iterations - 1)
        previous = np.concatenate([previous, u], axis=1)
    return previous.astype(np.float32)


def learn_basis(
        public_gradients,
        ranks: Optional[Sequence[int]] = None,
        *,
        group_ranks: Optional[Sequence[Sequence[int]]] = None,
        groups: Union[None, int, Sequence[Sequence[int]]] = None,
        variable_shapes: Optional[Sequence[Sequence[int]]] = None,
        rank_split: str = 'sqrt',
        power_iterations: int = DEFAULT_POWER_ITERATIONS,
        seed: int = 0,
        orthonormality_tolerance: float = DEFAULT_ORTHONORMALITY_TOLERANCE
) -> HybridBasis:
    """Learns principal blocks from PUBLIC per-example gradients.

    The paper's "Iterative Principal Space Approximation from Public Samples
    with Power Method", per group g with public matrix M_g [k_pub, d_g]: for
    each block j a random Gaussian start [d_g, r_{g,j}], ``power_iterations``
    steps U <- orth((M_g^T M_g) U), then deflation of M_g by U before the
    next block. Blocks therefore approximate successive principal subspaces, in
    order, and are exactly orthogonal to earlier blocks (to rounding).

    Guarantees: the result passes ``HybridBasis``'s checks (orthonormal,
    mutually orthogonal blocks); it is a deterministic function of the
    public gradients, the arguments and ``seed`` (up to the floating-point
    summation order of the BLAS). It must be given public data only: then
    using it costs no privacy.

    Args:
      public_gradients: per-example gradients of public examples at the
        current model, as a list of per-variable arrays [k_pub, *shape_v] (see
        ``public_per_example_gradients``), a 2-D array [k_pub, d] (variables
        in natural order, cut by ``variable_shapes``; one variable of shape
        (d,) by default), or a callable returning either.
      ranks: r_j >= 1 per principal block, split over the groups by
        ``rank_split`` (see ``split_group_ranks``). A group gets at most d_g
        columns; ranks beyond the rank of its public matrix (at most k_pub)
        are filled with random orthonormal directions (a warning is issued).
      group_ranks: instead of ``ranks``, explicit r_{g,j} per group.
      groups: None (one group), an int (that many contiguous groups of about
        equal size, ``partition_variables``), or lists of variable indices.
      variable_shapes: shapes to cut a 2-D ``public_gradients`` into
        variables.
      rank_split: 'sqrt', 'proportional' or 'equal'.
      power_iterations: t >= 1 power iterations per block.
      seed: seed of the random starts.
      orthonormality_tolerance: passed to ``HybridBasis``.
    """
    if callable(public_gradients):
        public_gradients = public_gradients()
    per_variable = gradients_lib.read_gradients(
        public_gradients, 'public_gradients', layout='per_variable',
        variable_shapes=variable_shapes)
    n = per_variable[0].shape[0]
    shapes = [tuple(t.shape[1:]) for t in per_variable]
    sizes = [basis_layout.size(s) for s in shapes]
    if groups is None:
        groups = [list(range(len(per_variable)))]
    elif isinstance(groups, numbers.Integral) and not isinstance(groups,
                                                                 bool):
        groups = partition_variables(sizes, groups)
    groups = basis_layout.check_groups(groups, len(per_variable))
    dims = [sum(sizes[v] for v in group) for group in groups]
    power_iterations = _validate.integer('power_iterations', power_iterations,
                                         1)
    seed = _validate.integer('seed', seed, 0)
    if (ranks is None) == (group_ranks is None):
        raise ValueError('give exactly one of ranks and group_ranks.')
    if group_ranks is None:
        group_ranks = split_group_ranks(ranks, dims, rank_split)
    table = [[_validate.integer('group_ranks entries', r, 0) for r in row]
             for row in group_ranks]
    if len(table) != len(groups):
        raise ValueError(
            f'group_ranks must have one row per group ({len(groups)}); got '
            f'{len(table)}.')
    for g, row in enumerate(table):
        if sum(row) > dims[g]:
            raise ValueError(
                f'group_ranks[{g}] must sum to at most d_g = {dims[g]}; got '
                f'{sum(row)}.')
        if sum(row) > n:
            warnings.warn(
                f'group {g} asks for {sum(row)} principal directions from '
                f'{n} public examples; those beyond the rank of the public '
                'gradients are random orthonormal directions.',
                stacklevel=2)
    matrices = group_matrices(per_variable, groups)
    learned = []
    for g, (matrix, row) in enumerate(zip(matrices, table)):
        rng = np.random.default_rng(np.random.SeedSequence([seed, g]))
        learned.append(_learn_group(matrix, row, power_iterations, rng))
    return HybridBasis(
        learned, table, groups=groups, variable_shapes=shapes,
        orthonormality_tolerance=orthonormality_tolerance,
        metadata={'method': 'iterative_power', 'power_iterations':
                  power_iterations, 'seed': seed, 'num_public_examples': n,
                  'rank_split': rank_split if ranks is not None else None})
