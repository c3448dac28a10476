"""Principal-subspace bases for hybrid clipping, learned from public data.

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

Learning (``learn_basis``) follows the paper's "Iterative Principal Space
Approximation from Public Samples with Power Method": for each block a random
start, a few power iterations U <- orth((M^T M) U), then deflation of the
public per-example gradient matrix M before the next block. The
orthonormalisation spans the same subspace as the paper's Gram-Schmidt/QR;
it is done with small Gram matrices (eigen-decomposition, then a Cholesky
pass), which is several times faster than Householder QR on tall matrices.

Privacy. A basis must depend only on public data and on the current model
(itself a DP output, so using it is post-processing). Nothing in this module
reads private data; the clip budgets built on a basis
(``tf_twice.hybrid.plan_blocks``) come from public gradients or from the user,
never from private statistics. Given such a basis, the released pair (noisy coefficient
sums, noisy residual sum) is a Gaussian mechanism on clipped coordinates; the
guarantee does not even need U to be orthonormal, but the meaning of the
blocks (a disjoint split of the gradient) does, so it is checked on
construction.
"""

from __future__ import annotations

import json
import math
import numbers
import types
import warnings
from typing import (Any, Callable, List, Mapping, NamedTuple, Optional,
                    Sequence, Tuple, Union)

import numpy as np
from scipy import linalg
import tensorflow as tf

from tf_twice import _keras

__all__ = [
    'BasisRefresh',
    'DEFAULT_ORTHONORMALITY_TOLERANCE',
    'DEFAULT_POWER_ITERATIONS',
    'HybridBasis',
    'Projection',
    'basis_memory_bytes',
    'group_matrices',
    'groups_by_layer',
    'learn_basis',
    'partition_variables',
    'public_gradient_matrices',
    'public_per_example_gradients',
    'split_group_ranks',
]

# Max |U_g^T U_g - I| accepted on construction. Bases learned here are
# orthonormalised in float64 and stored in float32 (error ~1e-7); the slack
# admits user bases orthonormalised in float32.
DEFAULT_ORTHONORMALITY_TOLERANCE = 1e-4
# Power iterations per block. The error of a block's subspace shrinks like
# (s_{r+1} / s_r)^(2t) in the singular values s of the public matrix.
DEFAULT_POWER_ITERATIONS = 3
# A direction whose singular value in a power iterate is below this times the
# largest is treated as absent: the public matrix has no more rank there (and
# the float32 products cannot resolve it).
_RANK_TOLERANCE = 1e-6
_FORMAT_VERSION = 1
_RANK_SPLITS = ('sqrt', 'proportional', 'equal')

ArrayLike = Union[np.ndarray, tf.Tensor]


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


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(
            f'{name} must be an integer >= {minimum}; got {value!r}.')
    if value < minimum:
        raise ValueError(
            f'{name} must be an integer >= {minimum}; got {value}.')
    return int(value)


def _check_groups(groups: Sequence[Sequence[int]],
                  num_variables: int) -> Tuple[Tuple[int, ...], ...]:
    """Checks that ``groups`` partitions range(num_variables)."""
    try:
        normalised = tuple(
            tuple(_check_int('groups entries', v, 0) for v in group)
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


def _check_shapes(
        variable_shapes: Sequence[Sequence[int]]) -> Tuple[Tuple[int, ...],
                                                           ...]:
    shapes = tuple(
        tuple(_check_int('variable_shapes entries', s, 1) for s in shape)
        for shape in variable_shapes)
    if not shapes:
        raise ValueError('variable_shapes must name at least one variable.')
    return shapes


def _size(shape: Sequence[int]) -> int:
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
        shapes = _check_shapes(variable_shapes)
        if groups is None:
            if len(shapes) != len(matrices):
                raise ValueError(
                    'groups is required unless there is one variable per '
                    f'group matrix; got {len(shapes)} variables and '
                    f'{len(matrices)} matrices.')
            groups = [[g] for g in range(len(matrices))]
        groups = _check_groups(groups, len(shapes))
        if len(groups) != len(matrices):
            raise ValueError(
                f'group_matrices must have one matrix per group '
                f'({len(groups)}); got {len(matrices)}.')
        ranks = tuple(
            tuple(_check_int('group_ranks entries', r, 0) for r in row)
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
        tolerance = float(orthonormality_tolerance)
        if not (tolerance > 0 and math.isfinite(tolerance)):
            raise ValueError(
                'orthonormality_tolerance must be a finite number > 0; got '
                f'{orthonormality_tolerance!r}.')
        dims = []
        for g, (m, group, row) in enumerate(zip(matrices, groups, ranks)):
            d_g = sum(_size(shapes[v]) for v in group)
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
        group = _check_int('group', group, 0)
        block = _check_int('block', block, 0)
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
        if len(per_variable) != self.num_variables:
            raise ValueError(
                f'per_variable must have {self.num_variables} tensors (one '
                f'per variable); got {len(per_variable)}.')
        flat = []
        for v, t in enumerate(per_variable):
            t = tf.convert_to_tensor(t)
            shape = self._variable_shapes[v]
            lead = t.shape.rank - len(shape)
            if lead < 0 or tuple(t.shape[lead:]) != shape:
                raise ValueError(
                    f'per_variable[{v}] must end in shape {shape}; got '
                    f'{t.shape}.')
            flat.append(_reshape_tail(t, lead, [_size(shape)]))
        return [flat[group[0]] if len(group) == 1 else
                tf.concat([flat[v] for v in group], axis=-1)
                for group in self._groups]

    def unflatten(self, per_group: Sequence[ArrayLike]) -> List[tf.Tensor]:
        """Per-group tensors [..., d_g] -> per-variable [..., *shape_v]."""
        per_group = self._check_per_group('per_group', per_group)
        out: List[Optional[tf.Tensor]] = [None] * self.num_variables
        for group, t in zip(self._groups, per_group):
            sizes = [_size(self._variable_shapes[v]) for v in group]
            pieces = tf.split(t, sizes, axis=-1) if len(group) > 1 else [t]
            for v, piece in zip(group, pieces):
                out[v] = _reshape_tail(piece, piece.shape.rank - 1,
                                       list(self._variable_shapes[v]))
        return out

    def split_flat(self, x: ArrayLike) -> List[tf.Tensor]:
        """[..., d] in natural order (variables 0..V-1) -> per group."""
        x = tf.convert_to_tensor(x)
        if x.shape.rank is None or x.shape[-1] != self.dim:
            raise ValueError(f'x must have last dimension d = {self.dim}; got '
                             f'shape {x.shape}.')
        sizes = [_size(s) for s in self._variable_shapes]
        pieces = tf.split(x, sizes, axis=-1) if len(sizes) > 1 else [x]
        return [pieces[group[0]] if len(group) == 1 else
                tf.concat([pieces[v] for v in group], axis=-1)
                for group in self._groups]

    def merge_flat(self, per_group: Sequence[ArrayLike]) -> tf.Tensor:
        """Per group [..., d_g] -> [..., d] in natural variable order."""
        per_variable = self.unflatten(per_group)
        return tf.concat([
            _reshape_tail(t, t.shape.rank - len(s), [_size(s)])
            for t, s in zip(per_variable, self._variable_shapes)], axis=-1)

    def _check_per_group(self, name: str,
                         per_group: Sequence[ArrayLike]) -> List[tf.Tensor]:
        if len(per_group) != self.num_groups:
            raise ValueError(
                f'{name} must have {self.num_groups} tensors (one per group); '
                f'got {len(per_group)}.')
        out = []
        for g, t in enumerate(per_group):
            t = tf.convert_to_tensor(t)
            if t.shape.rank is None or t.shape.rank < 1 or (
                    t.shape[-1] != self._group_dims[g]):
                raise ValueError(
                    f'{name}[{g}] must have last dimension d_g = '
                    f'{self._group_dims[g]}; got shape {t.shape}.')
            out.append(t)
        return out

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
        per_group = self._check_per_group('flat_per_group', flat_per_group)
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
        residual = self._check_per_group('residual', residual)
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
            out.append(r + _times(a, tf.cast(u, r.dtype), transpose=True))
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
        meta = {
            'format_version': _FORMAT_VERSION,
            'groups': [list(g) for g in self._groups],
            'variable_shapes': [list(s) for s in self._variable_shapes],
            'group_ranks': [list(r) for r in self._group_ranks],
            'orthonormality_tolerance': self._tolerance,
            'metadata': dict(self._metadata),
        }
        arrays = {f'group_{g}': m.numpy()
                  for g, m in enumerate(self._matrices)}
        arrays['meta'] = np.array(json.dumps(meta))
        if isinstance(path_or_file, (str, bytes)) or hasattr(
                path_or_file, '__fspath__'):
            with open(path_or_file, 'wb') as f:
                np.savez(f, **arrays)
        else:
            np.savez(path_or_file, **arrays)

    @classmethod
    def load(cls, path_or_file,
             orthonormality_tolerance: Optional[float] = None
             ) -> 'HybridBasis':
        """Reads a basis written by ``save``; re-checks every guarantee."""
        with np.load(path_or_file, allow_pickle=False) as data:
            meta = json.loads(str(data['meta']))
            if meta.get('format_version') != _FORMAT_VERSION:
                raise ValueError(
                    'path_or_file holds an unknown basis format version '
                    f'{meta.get("format_version")!r}.')
            matrices = [data[f'group_{g}']
                        for g in range(len(meta['groups']))]
        return cls(
            matrices, meta['group_ranks'], groups=meta['groups'],
            variable_shapes=meta['variable_shapes'],
            orthonormality_tolerance=(
                meta['orthonormality_tolerance']
                if orthonormality_tolerance is None
                else orthonormality_tolerance),
            metadata=meta['metadata'])


def _reshape_tail(t: tf.Tensor, lead: int, tail: List[int]) -> tf.Tensor:
    """Reshapes t to t.shape[:lead] + tail, keeping static shapes."""
    if lead == 0:
        return tf.reshape(t, tail)
    if lead == 1:
        return tf.reshape(t, [-1] + tail)
    return tf.reshape(t, tf.concat([tf.shape(t)[:lead], tail], 0))


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


# Grouping and rank allocation.


def partition_variables(variable_sizes: Sequence[int],
                        num_groups: int) -> List[List[int]]:
    """Splits variables 0..V-1 into ``num_groups`` contiguous groups.

    Cuts are placed where the cumulative size is nearest to multiples of
    d / num_groups, so groups are as equal in size as whole variables allow;
    every group is non-empty.
    """
    sizes = [_check_int('variable_sizes entries', s, 1)
             for s in variable_sizes]
    num_groups = _check_int('num_groups', num_groups, 1)
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
    ranks = [_check_int('ranks entries', r, 1) for r in ranks]
    dims = np.array([_check_int('group_dims entries', d, 1)
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


# Public per-example gradients.


def _as_per_variable(public_gradients, variable_shapes) -> List[np.ndarray]:
    if callable(public_gradients):
        public_gradients = public_gradients()
    if isinstance(public_gradients, (np.ndarray, tf.Tensor)):
        matrix = np.asarray(public_gradients, dtype=np.float32)
        if matrix.ndim != 2:
            raise ValueError(
                'public_gradients as one array must be 2-D [k_pub, d]; got '
                f'shape {matrix.shape}.')
        if variable_shapes is None:
            return [matrix]
        shapes = _check_shapes(variable_shapes)
        sizes = [_size(s) for s in shapes]
        if sum(sizes) != matrix.shape[1]:
            raise ValueError(
                f'variable_shapes must cover d = {matrix.shape[1]} '
                f'coordinates; they cover {sum(sizes)}.')
        pieces = np.split(matrix, np.cumsum(sizes)[:-1], axis=1)
        return [p.reshape((-1,) + s) for p, s in zip(pieces, shapes)]
    per_variable = [np.asarray(t, dtype=np.float32) for t in public_gradients]
    if not per_variable:
        raise ValueError('public_gradients must hold at least one variable.')
    if variable_shapes is not None:
        shapes = _check_shapes(variable_shapes)
        if [t.shape[1:] for t in per_variable] != list(shapes):
            raise ValueError(
                'variable_shapes must match the public gradients; got '
                f'{variable_shapes!r}.')
    return per_variable


def group_matrices(per_variable: Sequence[ArrayLike],
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
    groups = _check_groups(groups, len(arrays))
    return [np.ascontiguousarray(np.concatenate(
        [arrays[v].reshape(n, -1) for v in group], axis=1))
        for group in groups]


def _per_example_loss(loss) -> Callable[[tf.Tensor, tf.Tensor], tf.Tensor]:
    if isinstance(loss, tf.keras.losses.Loss):
        config = loss.get_config()
        config['reduction'] = _keras.NO_REDUCTION
        return type(loss).from_config(config)
    if callable(loss):
        return loss
    raise ValueError(
        'per_example_loss must be a callable (y_true, y_pred) -> per-example '
        f'losses or a tf.keras.losses.Loss; got {loss!r}.')


def public_per_example_gradients(
        model: tf.keras.Model,
        per_example_loss,
        x,
        y,
        *,
        batch_size: int = 256,
        training: bool = True) -> List[np.ndarray]:
    """Per-example gradients of PUBLIC examples at the current model.

    Runs forward and backward passes per example under ``tf.vectorized_map``
    (O(n), like the DP model's step) in chunks of ``batch_size``.

    Args:
      model: a built or buildable Keras model; gradients are taken w.r.t.
        ``model.trainable_variables`` (their order is the variable order of
        the basis). Per-example gradients need no BatchNorm (use
        GroupNorm/LayerNorm).
      per_example_loss: (y_true, y_pred) -> [B] losses, or a Keras ``Loss``
        (its reduction is set to none). The model's regularisation losses are
        added to every example, as in the DP step.
      x, y: public inputs and labels (x may be a nest of arrays).
      batch_size: examples per vectorised chunk, >= 1.
      training: the ``training`` flag of the forward pass.

    Returns:
      One float32 array [n, *shape_v] per trainable variable.
    """
    batch_size = _check_int('batch_size', batch_size, 1)
    loss_fn = _per_example_loss(per_example_loss)
    x = tf.nest.map_structure(tf.convert_to_tensor, x)
    y = tf.convert_to_tensor(y)
    n = int(y.shape[0])
    if not model.built:
        model(tf.nest.map_structure(lambda t: t[:1], x), training=False)
    variables = model.trainable_variables
    if not variables:
        raise ValueError('model has no trainable variables.')

    @tf.function
    def chunk_gradients(xc, yc):
        def one_example(args):
            xi, yi = args
            xi = tf.nest.map_structure(lambda t: tf.expand_dims(t, 0), xi)
            with tf.GradientTape() as tape:
                prediction = model(xi, training=training)
                loss = tf.reduce_sum(loss_fn(tf.expand_dims(yi, 0),
                                             prediction))
                if model.losses:
                    loss += tf.cast(tf.add_n(model.losses), loss.dtype)
            grads = tape.gradient(
                loss, variables,
                unconnected_gradients=tf.UnconnectedGradients.ZERO)
            return [tf.convert_to_tensor(g) for g in grads]

        return tf.vectorized_map(one_example, (xc, yc))

    chunks = [[] for _ in variables]
    for start in range(0, n, batch_size):
        grads = chunk_gradients(
            tf.nest.map_structure(lambda t: t[start:start + batch_size], x),
            y[start:start + batch_size])
        for v, g in enumerate(grads):
            chunks[v].append(g.numpy().astype(np.float32, copy=False))
    return [np.concatenate(c, axis=0) for c in chunks]


def public_gradient_matrices(
        model: tf.keras.Model,
        per_example_loss,
        x,
        y,
        *,
        groups: Optional[Sequence[Sequence[int]]] = None,
        batch_size: int = 256,
        training: bool = True) -> List[np.ndarray]:
    """``public_per_example_gradients`` flattened per group: [n, d_g] each."""
    return group_matrices(
        public_per_example_gradients(model, per_example_loss, x, y,
                                     batch_size=batch_size,
                                     training=training), groups)


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
    per_variable = _as_per_variable(public_gradients, variable_shapes)
    n = per_variable[0].shape[0]
    if n < 1 or any(t.shape[0] != n for t in per_variable):
        raise ValueError(
            'public_gradients must hold the same k_pub >= 1 examples for '
            f'every variable; got shapes {[t.shape for t in per_variable]}.')
    if not all(np.all(np.isfinite(t)) for t in per_variable):
        raise ValueError('public_gradients must be finite.')
    shapes = [tuple(t.shape[1:]) for t in per_variable]
    sizes = [_size(s) for s in shapes]
    if groups is None:
        groups = [list(range(len(per_variable)))]
    elif isinstance(groups, numbers.Integral) and not isinstance(groups,
                                                                 bool):
        groups = partition_variables(sizes, groups)
    groups = _check_groups(groups, len(per_variable))
    dims = [sum(sizes[v] for v in group) for group in groups]
    power_iterations = _check_int('power_iterations', power_iterations, 1)
    seed = _check_int('seed', seed, 0)
    if (ranks is None) == (group_ranks is None):
        raise ValueError('give exactly one of ranks and group_ranks.')
    if group_ranks is None:
        group_ranks = split_group_ranks(ranks, dims, rank_split)
    table = [[_check_int('group_ranks entries', r, 0) for r in row]
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


# Clip budgets (from public data or the user, never from private data).


# Refreshing the basis during training.


class BasisRefresh(tf.keras.callbacks.Callback):
    """Re-learns the basis from public data every ``every_steps`` steps.

    Before step 0, K, 2K, ... (``on_train_batch_begin``) it computes the
    per-example gradients of the PUBLIC examples at the current weights and
    runs ``learn_basis``; the result is in ``self.basis`` and is passed to
    ``on_refresh`` (e.g. to assign it to the variables the DP step reads).

    Privacy: the refresh reads only public data and the current model, which
    is itself the output of the DP training so far; the basis is therefore
    post-processing and costs no privacy. Do not give it private examples.
    Refresh k uses seed ``seed + k``, so a run is reproducible.

    Args:
      model: the model whose ``trainable_variables`` the basis covers (for a
        wrapped DP model, the inner model).
      public_data: (x, y) public examples.
      per_example_loss: as in ``public_per_example_gradients``.
      every_steps: K >= 1.
      on_refresh: optional callable(basis) run after each refresh.
      batch_size, training: as in ``public_per_example_gradients``.
      **learn_kwargs: ``learn_basis`` arguments (ranks, groups, ...).
    """

    def __init__(self,
                 model: tf.keras.Model,
                 public_data: Tuple[Any, Any],
                 per_example_loss,
                 every_steps: int,
                 *,
                 on_refresh: Optional[Callable[[HybridBasis], None]] = None,
                 batch_size: int = 256,
                 training: bool = True,
                 seed: int = 0,
                 **learn_kwargs):
        super().__init__()
        self._every = _check_int('every_steps', every_steps, 1)
        self._seed = _check_int('seed', seed, 0)
        self._batch_size = _check_int('batch_size', batch_size, 1)
        if 'seed' in learn_kwargs or 'public_gradients' in learn_kwargs:
            raise ValueError('learn_kwargs must not set seed or '
                             'public_gradients.')
        x, y = public_data
        self._basis_model = model
        self._x, self._y = x, y
        self._loss = per_example_loss
        self._on_refresh = on_refresh
        self._training = training
        self._learn_kwargs = learn_kwargs
        self._step = 0
        self.refresh_count = 0
        self.basis: Optional[HybridBasis] = None

    def refresh(self) -> HybridBasis:
        """Learns a basis now from the public data and current weights."""
        grads = public_per_example_gradients(
            self._basis_model, self._loss, self._x, self._y,
            batch_size=self._batch_size, training=self._training)
        self.basis = learn_basis(grads, seed=self._seed + self.refresh_count,
                                 **self._learn_kwargs)
        self.refresh_count += 1
        if self._on_refresh is not None:
            self._on_refresh(self.basis)
        return self.basis

    def on_train_batch_begin(self, batch, logs=None):
        if self._step % self._every == 0:
            self.refresh()

    def on_train_batch_end(self, batch, logs=None):
        self._step += 1
