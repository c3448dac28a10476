"""The hybrid-clipping basis: its structure, values, projections and files.

Hybrid clipping (the paper's "optimal noise for hybrid clipping" theorem and
its appendix "Algorithm Description of Hybrid Clipping with Twice Sampling")
splits the gradient space R^d into m blocks: m - 1 principal blocks spanned by
orthonormal columns U_1..U_{m-1}, whose coordinates are the coefficients
a_j = U_j^T g, and the residual block r = g - sum_j U_j a_j, kept in natural
coordinates (d of them). Each block is clipped, masked and noised separately.

Parameter groups. The model's trainable variables are partitioned into groups
and the basis is block-diagonal over them: group g (the concatenation of its
flattened variables, d_g coordinates) has its own blocks U_{g,1..m-1} with
r_{g,j} columns. Principal block j of the hybrid clipping is the union over
groups of U_{g,j}: an orthonormal set of r_j = sum_g r_{g,j} directions of
R^d, whose coefficient vector is the concatenation of the groups' a_{g,j}. A
single dense basis needs d * k floats (k = sum_j r_j; ResNet22 at k = 3,250:
3.8 GB); with g groups it needs sum_g d_g * k_g, which is d * k / g for equal
groups and an equal rank split.

This module holds a basis and applies it (``HybridBasis``: TensorFlow ops
usable in a traced step); ``basis_layout`` checks its structure and moves
tensors between per-variable, per-group and flat layouts, and ``basis_io`` is
its file format. Learning one from public gradients is host-side numpy in
``tf_twice.hybrid.learning``; computing those gradients from a Keras model is
``tf_twice.keras.basis_refresh``.

Privacy. A basis must depend only on public data and on the current model
(itself a DP output, so using it is post-processing). Given such a basis, the
released pair (noisy coefficient sums, noisy residual sum) is a Gaussian
mechanism on clipped coordinates; the guarantee does not even need U to be
orthonormal, but the meaning of the blocks (a disjoint split of the gradient)
does, so it is checked on construction.
"""

from __future__ import annotations

import json
import types
from typing import Any, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_twice import _validate
from tf_twice.mechanism import basis_io
from tf_twice.mechanism import basis_layout
from tf_twice.mechanism.basis_layout import ArrayLike
# Public here, where users import it from.
from tf_twice.mechanism.basis_layout import basis_memory_bytes

__all__ = [
    'DEFAULT_ORTHONORMALITY_TOLERANCE',
    'HybridBasis',
    'Projection',
    'basis_memory_bytes',
]

# Max |U_g^T U_g - I| accepted on construction. Bases learned by
# ``tf_twice.hybrid.learning`` are orthonormalised in float64 and stored in
# float32 (error ~1e-7); the slack admits user bases orthonormalised in
# float32.
DEFAULT_ORTHONORMALITY_TOLERANCE = 1e-4


class Projection(NamedTuple):
    """Coefficients and residual of gradients under a ``HybridBasis``.

    Attributes:
      coefficients: ``coefficients[j][g]`` is a [..., r_{g,j}] tensor, the
        coordinates of group g's vector along U_{g,j}. Principal block j of
        the hybrid clipping is the list ``coefficients[j]`` (over groups).
      residual: the residual block r = x - U a, one tensor per group
        ([..., d_g], from ``project``) or per variable ([..., *shape], from
        ``decompose``).
    """

    coefficients: List[List[tf.Tensor]]
    residual: List[tf.Tensor]


def _orthonormality_error(u: np.ndarray) -> float:
    """max |U^T U - I|, accumulated in float64 over row chunks."""
    k = u.shape[1]
    if k == 0:
        return 0.0
    gram = np.zeros((k, k))
    rows = max(1, 2**24 // k)  # about 128 MB of float64 per chunk
    for start in range(0, u.shape[0], rows):
        chunk = np.asarray(u[start:start + rows], dtype=np.float64)
        gram += chunk.T @ chunk
    gram[np.diag_indices(k)] -= 1.0
    return float(np.max(np.abs(gram)))


class HybridBasis:
    """An immutable block-diagonal basis of principal blocks per group.

    Guarantees (checked on construction, ValueError otherwise):
      * ``groups`` partitions the variable indices; group g's flat vector is
        the concatenation of its variables' flattened values, in the listed
        order, of dimension d_g = the sum of their sizes;
      * every group's matrix U_g = [U_{g,1} .. U_{g,m-1}] is [d_g, k_g]
        float32 with max |U_g^T U_g - I| <= ``orthonormality_tolerance``, so
        the blocks are orthonormal and mutually orthogonal, and the basis is
        block-diagonal over groups (groups are orthogonal by construction);
      * every principal block has total rank r_j = sum_g r_{g,j} >= 1.

    ``project`` and ``reconstruct`` are TensorFlow ops usable inside
    ``tf.function``; the reconstruction U a + r of a projection equals its
    input up to float rounding, whatever the tolerance, because the residual
    is defined as r = x - U a.

    Args:
      group_matrices: one [d_g, k_g] array per group, the concatenation of the
        group's principal blocks.
      group_ranks: ``group_ranks[g][j]`` = r_{g,j} >= 0, the columns of block
        j in group g; each row sums to k_g and all rows have m - 1 entries.
      groups: lists of variable indices partitioning 0..V-1; default: one
        group per matrix, group g being variable g.
      variable_shapes: the shape of every variable; default: variable g has
        shape (d_g,) (requires the default ``groups``).
      orthonormality_tolerance: the accepted max |U_g^T U_g - I|, > 0.
      metadata: JSON-serialisable facts kept with the basis (e.g. how it was
        learned); saved and loaded with it.
    """

    def __init__(self,
                 group_matrices: Sequence[ArrayLike],
                 group_ranks: Sequence[Sequence[int]],
                 *,
                 groups: Optional[Sequence[Sequence[int]]] = None,
                 variable_shapes: Optional[Sequence[Sequence[int]]] = None,
                 orthonormality_tolerance: float = (
                     DEFAULT_ORTHONORMALITY_TOLERANCE),
                 metadata: Optional[Mapping[str, Any]] = None):
        matrices = [np.asarray(m, dtype=np.float32) for m in group_matrices]
        if not matrices:
            raise ValueError('group_matrices must hold at least one matrix.')
        for g, m in enumerate(matrices):
            if m.ndim != 2:
                raise ValueError(
                    f'group_matrices[{g}] must be 2-D [d_g, k_g]; got shape '
                    f'{m.shape}.')
            if not np.all(np.isfinite(m)):
                raise ValueError(f'group_matrices[{g}] must be finite.')
        if variable_shapes is None:
            if groups is not None:
                raise ValueError(
                    'variable_shapes is required when groups is given.')
            variable_shapes = [(m.shape[0],) for m in matrices]
        shapes = basis_layout.check_shapes(variable_shapes)
        if groups is None:
            if len(shapes) != len(matrices):
                raise ValueError(
                    'groups is required unless there is one variable per '
                    f'group matrix; got {len(shapes)} variables and '
                    f'{len(matrices)} matrices.')
            groups = [[g] for g in range(len(matrices))]
        groups = basis_layout.check_groups(groups, len(shapes))
        if len(groups) != len(matrices):
            raise ValueError(
                f'group_matrices must have one matrix per group '
                f'({len(groups)}); got {len(matrices)}.')
        ranks = tuple(
            tuple(_validate.integer('group_ranks entries', r, 0) for r in row)
            for row in group_ranks)
        if len(ranks) != len(groups) or len({len(r) for r in ranks}) != 1:
            raise ValueError(
                'group_ranks must have one row per group, all of the same '
                'length (the number of principal blocks); got '
                f'{group_ranks!r}.')
        if not ranks[0]:
            raise ValueError('group_ranks must name at least one principal '
                             'block.')
        totals = [sum(row[j] for row in ranks) for j in range(len(ranks[0]))]
        if min(totals) < 1:
            raise ValueError(
                'every principal block needs total rank >= 1 over the '
                f'groups; got block ranks {totals}.')
        tolerance = _validate.positive('orthonormality_tolerance',
                                       orthonormality_tolerance)
        dims = []
        for g, (m, group, row) in enumerate(zip(matrices, groups, ranks)):
            d_g = sum(basis_layout.size(shapes[v]) for v in group)
            if m.shape != (d_g, sum(row)):
                raise ValueError(
                    f'group_matrices[{g}] must have shape (d_g, k_g) = '
                    f'({d_g}, {sum(row)}) from variable_shapes and '
                    f'group_ranks; got {m.shape}.')
            error = _orthonormality_error(m)
            if error > tolerance:
                raise ValueError(
                    f'group_matrices[{g}] is not orthonormal: max |U^T U - I| '
                    f'= {error:.3g} > orthonormality_tolerance = '
                    f'{tolerance:.3g}. Orthonormalise it (e.g. QR) first.')
            dims.append(d_g)
        metadata = dict(metadata or {})
        try:
            json.dumps(metadata)
        except (TypeError, ValueError) as err:
            raise ValueError(
                f'metadata must be JSON-serialisable; got {metadata!r}.'
            ) from err
        self._matrices = tuple(tf.constant(m) for m in matrices)
        self._group_ranks = ranks
        self._groups = groups
        self._variable_shapes = shapes
        self._group_dims = tuple(dims)
        self._tolerance = tolerance
        self._metadata = types.MappingProxyType(metadata)

    # Shapes and sizes.

    @property
    def groups(self) -> Tuple[Tuple[int, ...], ...]:
        """Variable indices of every group."""
        return self._groups

    @property
    def variable_shapes(self) -> Tuple[Tuple[int, ...], ...]:
        return self._variable_shapes

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    @property
    def num_variables(self) -> int:
        return len(self._variable_shapes)

    @property
    def num_principal_blocks(self) -> int:
        """m - 1, the blocks with a learned basis."""
        return len(self._group_ranks[0])

    @property
    def num_blocks(self) -> int:
        """m: the principal blocks and the residual."""
        return self.num_principal_blocks + 1

    @property
    def group_dims(self) -> Tuple[int, ...]:
        """d_g for every group."""
        return self._group_dims

    @property
    def dim(self) -> int:
        """d, the number of model parameters covered."""
        return sum(self._group_dims)

    @property
    def group_ranks(self) -> Tuple[Tuple[int, ...], ...]:
        """r_{g,j}: columns of block j in group g."""
        return self._group_ranks

    @property
    def ranks(self) -> Tuple[int, ...]:
        """r_j = sum_g r_{g,j}, the coordinates of principal block j."""
        return tuple(sum(row[j] for row in self._group_ranks)
                     for j in range(self.num_principal_blocks))

    @property
    def principal_rank(self) -> int:
        """k = sum_j r_j."""
        return sum(self.ranks)

    @property
    def block_dimensions(self) -> Tuple[int, ...]:
        """Coordinates released per block: (r_1, .., r_{m-1}, d).

        The residual is released in natural coordinates, so it has d
        coordinates (not d - k): these are the ``ranks`` to give the
        accountant and ``optimize_block_noise``.
        """
        return self.ranks + (self.dim,)

    @property
    def memory_floats(self) -> int:
        """sum_g d_g * k_g, the floats held (d * k / g for equal groups)."""
        return basis_memory_bytes(self._group_dims, self._group_ranks, 1)

    @property
    def memory_bytes(self) -> int:
        return 4 * self.memory_floats

    @property
    def orthonormality_tolerance(self) -> float:
        return self._tolerance

    @property
    def metadata(self) -> Mapping[str, Any]:
        return self._metadata

    @property
    def group_matrices(self) -> Tuple[tf.Tensor, ...]:
        """U_g = [U_{g,1} .. U_{g,m-1}], [d_g, k_g] float32, per group."""
        return self._matrices

    @property
    def structure(self) -> Tuple[Any, ...]:
        """(groups, variable_shapes, group_ranks): everything but the values.

        Two bases with the same structure have the same block dimensions and
        matrix shapes, so one can replace the other in the variables a traced
        training step reads (``tf_twice.mechanism.hybrid.BasisVariables``)
        without retracing and without changing the step's DpEvent.
        """
        return (self._groups, self._variable_shapes, self._group_ranks)

    def _resolve_matrices(self, matrices) -> Sequence[Any]:
        """``self.group_matrices``, or same-shaped replacements (e.g. the
        tf.Variables a traced step reads), checked against the structure."""
        if matrices is None:
            return self._matrices
        matrices = list(matrices)
        if len(matrices) != self.num_groups:
            raise ValueError(
                f'matrices must have one [d_g, k_g] matrix per group '
                f'({self.num_groups}); got {len(matrices)}.')
        for g, (m, d_g, row) in enumerate(
                zip(matrices, self._group_dims, self._group_ranks)):
            if tuple(m.shape) != (d_g, sum(row)):
                raise ValueError(
                    f'matrices[{g}] must have shape (d_g, k_g) = ({d_g}, '
                    f'{sum(row)}); got {tuple(m.shape)}.')
        return matrices

    def block(self, group: int, block: int) -> tf.Tensor:
        """U_{g,j}: the [d_g, r_{g,j}] columns of block j in group g."""
        group = _validate.integer('group', group, 0)
        block = _validate.integer('block', block, 0)
        if group >= self.num_groups or block >= self.num_principal_blocks:
            raise ValueError(
                f'group must be < {self.num_groups} and block < '
                f'{self.num_principal_blocks}; got {group}, {block}.')
        row = self._group_ranks[group]
        start = sum(row[:block])
        return self._matrices[group][:, start:start + row[block]]

    def __repr__(self) -> str:
        return (f'HybridBasis(dim={self.dim}, groups={self.num_groups}, '
                f'ranks={self.ranks}, memory_bytes={self.memory_bytes})')

    # Layout conversions. Leading (batch) dimensions are kept.

    def flatten(self, per_variable: Sequence[ArrayLike]) -> List[tf.Tensor]:
        """Per-variable tensors [..., *shape_v] -> per-group [..., d_g]."""
        return basis_layout.flatten(per_variable, self._groups,
                                    self._variable_shapes)

    def unflatten(self, per_group: Sequence[ArrayLike]) -> List[tf.Tensor]:
        """Per-group tensors [..., d_g] -> per-variable [..., *shape_v]."""
        return basis_layout.unflatten(
            basis_layout.check_per_group('per_group', per_group,
                                         self._group_dims),
            self._groups, self._variable_shapes)

    def split_flat(self, x: ArrayLike) -> List[tf.Tensor]:
        """[..., d] in natural order (variables 0..V-1) -> per group."""
        return basis_layout.split_flat(x, self._groups, self._variable_shapes)

    def merge_flat(self, per_group: Sequence[ArrayLike]) -> tf.Tensor:
        """Per group [..., d_g] -> [..., d] in natural variable order."""
        return basis_layout.merge_flat(self.unflatten(per_group),
                                       self._variable_shapes)

    # Projection.

    def project(self, flat_per_group: Sequence[ArrayLike],
                matrices: Optional[Sequence[Any]] = None) -> Projection:
        """Splits group vectors x_g [..., d_g] into the hybrid blocks.

        Returns ``Projection(coefficients, residual)`` with
        ``coefficients[j][g] = x_g U_{g,j}`` ([..., r_{g,j}]) and
        ``residual[g] = x_g - U_g a_g`` ([..., d_g]). With U orthonormal the
        residual is orthogonal to every block (up to the tolerance).

        ``matrices`` (optional) replaces ``group_matrices`` by tensors or
        tf.Variables of the same shapes, e.g. variables that a traced
        training step reads and that a basis refresh assigns. Their
        orthonormality is the caller's to keep (assign only values of a
        ``HybridBasis`` of the same ``structure``).
        """
        per_group = basis_layout.check_per_group('flat_per_group',
                                                 flat_per_group,
                                                 self._group_dims)
        coefficients: List[List[tf.Tensor]] = [
            [] for _ in range(self.num_principal_blocks)]
        residual = []
        for x, u, row in zip(per_group, self._resolve_matrices(matrices),
                             self._group_ranks):
            u = tf.cast(u, x.dtype)
            a = _times(x, u)
            residual.append(x - _times(a, u, transpose=True))
            for j, piece in enumerate(tf.split(a, list(row), axis=-1)):
                coefficients[j].append(piece)
        return Projection(coefficients, residual)

    def reconstruct(self, coefficients: Sequence[Sequence[ArrayLike]],
                    residual: Sequence[ArrayLike],
                    matrices: Optional[Sequence[Any]] = None
                    ) -> List[tf.Tensor]:
        """U a + r per group ([..., d_g]): the inverse of ``project``.

        Linear in both arguments, so it maps noisy coefficient sums and a
        noisy residual sum (post-processing) to a gradient-space update.
        ``matrices`` as in ``project``.
        """
        matrices = self._resolve_matrices(matrices)
        residual = basis_layout.check_per_group('residual', residual,
                                                self._group_dims)
        if len(coefficients) != self.num_principal_blocks:
            raise ValueError(
                f'coefficients must have {self.num_principal_blocks} blocks; '
                f'got {len(coefficients)}.')
        out = []
        for g, (r, u, row) in enumerate(
                zip(residual, matrices, self._group_ranks)):
            pieces = []
            for j in range(self.num_principal_blocks):
                if len(coefficients[j]) != self.num_groups:
                    raise ValueError(
                        f'coefficients[{j}] must have {self.num_groups} '
                        f'tensors (one per group); got '
                        f'{len(coefficients[j])}.')
                piece = tf.convert_to_tensor(coefficients[j][g], r.dtype)
                if piece.shape[-1] != row[j]:
                    raise ValueError(
                        f'coefficients[{j}][{g}] must have last dimension '
                        f'r_gj = {row[j]}; got shape {piece.shape}.')
                pieces.append(piece)
            a = tf.concat(pieces, axis=-1)
            # U a in U's dtype (float32, as U is stored): it has no more
            # precision than U, and in float64 it would cast U at every step.
            u = tf.convert_to_tensor(u)
            principal = _times(tf.cast(a, u.dtype), u, transpose=True)
            out.append(r + tf.cast(principal, r.dtype))
        return out

    def decompose(self, per_variable: Sequence[ArrayLike],
                  matrices: Optional[Sequence[Any]] = None) -> Projection:
        """``project`` on per-variable tensors; residual per variable.

        The residual comes back in variable shapes [..., *shape_v], so it is
        one more list of gradient-shaped tensors (the residual block), and
        each ``coefficients[j]`` is a list of tensors forming block j.
        ``matrices`` as in ``project``.
        """
        projection = self.project(self.flatten(per_variable), matrices)
        return Projection(projection.coefficients,
                          self.unflatten(projection.residual))

    def compose(self, coefficients: Sequence[Sequence[ArrayLike]],
                residual: Sequence[ArrayLike],
                matrices: Optional[Sequence[Any]] = None) -> List[tf.Tensor]:
        """Inverse of ``decompose``: U a + r in variable shapes."""
        return self.unflatten(
            self.reconstruct(coefficients, self.flatten(residual), matrices))

    # Persistence.

    def save(self, path_or_file) -> None:
        """Writes the basis as an .npz (exactly at the given path)."""
        basis_io.write(
            path_or_file, [m.numpy() for m in self._matrices],
            groups=self._groups, variable_shapes=self._variable_shapes,
            group_ranks=self._group_ranks,
            orthonormality_tolerance=self._tolerance,
            metadata=self._metadata)

    @classmethod
    def load(cls, path_or_file,
             orthonormality_tolerance: Optional[float] = None
             ) -> 'HybridBasis':
        """Reads a basis written by ``save``; re-checks every guarantee."""
        stored = basis_io.read(path_or_file)
        if orthonormality_tolerance is not None:
            stored['orthonormality_tolerance'] = orthonormality_tolerance
        return cls(stored.pop('group_matrices'), stored.pop('group_ranks'),
                   **stored)


def _times(x: tf.Tensor, u: tf.Tensor, transpose: bool = False) -> tf.Tensor:
    """x [..., a] times u [a, b] (or u^T), keeping leading dimensions."""
    if x.shape.rank == 2:
        return tf.matmul(x, u, transpose_b=transpose)
    # Other ranks: as rows of a matrix (tensordot would copy u^T).
    out = tf.matmul(tf.reshape(x, [-1, x.shape[-1]]), u, transpose_b=transpose)
    lead = tf.shape(x)[:-1]
    width = u.shape[0] if transpose else u.shape[1]
    result = tf.reshape(out, tf.concat([lead, [width]], 0))
    result.set_shape(x.shape[:-1].concatenate([width]))
    return result
