"""Hybrid clipping in a training step: gradients -> blocks -> one aggregation.

Both training paths (``tf_twice.keras.DPModel`` and the optimizer classes in
``tf_twice.optimizers``) call ``block_sums`` on every physical microbatch and
``noisy_update`` once per logical batch, so the per-block step is defined
here only, on top of ``aggregation.clipped_masked_block_sums`` and
``aggregation.add_block_noise_and_normalize``. For per-example gradients g_i
and a ``HybridBasis`` U (principal blocks U_1..U_{m-1}, block-diagonal over
parameter groups):

1. a_i = U^T g_i (principal block j: the coefficients along U_j, one tensor
   per parameter group) and r_i = g_i - U a_i (the residual, one tensor of
   d_g natural coordinates per group);
2. block j is clipped to l2 <= c2_j, then every coordinate to c_inf_j
   (times s_j, the block's public scale, all 1 unless a re-plan set them:
   ``split_into_blocks``);
3. every coordinate of block j is kept with probability q2_j (the config's
   q2 unless the block sets its own; independent masks: each block draws
   from its own Philox streams);
4. sums over the batch (weights in [0, 1]);
5. N(0, (z_j c2_j)^2) on every coordinate of block j (principal blocks: on
   the r_j coefficients; residual: on all d natural coordinates);
6. update = (U a~ + r~), block j's sum divided by expected_batch_size *
   q2_j.

With no basis there is one block, g_i itself, and the step is exactly the
single-block aggregation (same numbers for the same key).

Guarantee: for a basis (and block scales) that depend only on public data
and the current model, one step releases (noisy coefficient sums, noisy
residual sum), up to the scales' post-processing, a twice-sampled Gaussian
mechanism whose per-example contribution lies in the hybrid set
{(s_1..s_m): ||s_j||_2 <= c2_j, ||s_j||_inf <= c_inf_j}; it is
exactly ``TwiceSampledGaussianDpEvent`` with the per-block tuples and
``block_dimensions = basis.block_dimensions`` (r_1..r_{m-1}, d). The update is
post-processing; the guarantee does not depend on U being orthonormal.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_twice import config as config_lib
from tf_twice.mechanism import aggregation
from tf_twice.mechanism import basis as basis_lib
from tf_twice.mechanism import precision

__all__ = [
    'BasisVariables',
    'BlockSums',
    'block_sums',
    'check_basis_matches_variables',
    'check_block_params',
    'noisy_update',
    'split_into_blocks',
    'zero_block_sums',
]

BlockSums = List[List[tf.Tensor]]


def check_block_params(config: config_lib.TwiceSamplingConfig,
                       basis: Optional[basis_lib.HybridBasis]) -> None:
    """Refuses a config whose blocks do not fit ``basis``.

    Without a basis the config must have one block; with a basis of m blocks
    it must have m (the principal blocks in order, then the residual).

    Raises:
      ValueError: naming the expected number of blocks.
    """
    if not isinstance(config, config_lib.TwiceSamplingConfig):
        raise ValueError('config must be a tf_twice TwiceSamplingConfig; got '
                         f'{type(config).__name__}.')
    if basis is None:
        if config.num_blocks != 1:
            raise ValueError(
                f'the config has {config.num_blocks} blocks, but no basis is '
                'given: use one Block, or basis=HybridBasis(...) (e.g. from '
                'learn_basis) for hybrid clipping.')
        return
    check_is_basis(basis)
    m = basis.num_blocks
    if config.num_blocks != m:
        raise ValueError(
            f'the config must have one Block per block of the basis: {m} '
            f'({m - 1} principal blocks, then the residual); got '
            f'{config.num_blocks}. Split a global l2 budget with '
            'tf_twice.hybrid.plan_blocks(config, basis, public_gradients, ...) '
            'to derive them from a one-block config.')


def check_is_basis(basis: Any) -> None:
    """Refuses anything but a ``HybridBasis``."""
    if not isinstance(basis, basis_lib.HybridBasis):
        raise ValueError('basis must be a tf_twice HybridBasis; got '
                         f'{type(basis).__name__}.')


def check_basis_matches_variables(basis: basis_lib.HybridBasis,
                                  variables: Sequence[tf.Variable]) -> None:
    """Refuses a basis whose variable shapes are not ``variables``' shapes."""
    shapes = tuple(tuple(int(s) for s in v.shape) for v in variables)
    if shapes != basis.variable_shapes:
        raise ValueError(
            'basis.variable_shapes must be the shapes of the trainable '
            f'variables, in order: {shapes}; got {basis.variable_shapes}. '
            'Learn the basis from gradients of this model\'s '
            'trainable_variables (public_per_example_gradients).')


class BasisVariables:
    """A ``HybridBasis`` held in fixed-shape, non-trainable tf.Variables.

    A traced training step reads U_g from ``variables``; ``assign`` writes a
    new basis of the same ``structure`` into them, so a basis refresh takes
    effect at the next step without retracing. The variables are plain
    attributes of this (untracked) object: they are not trainable weights
    and are not written to checkpoints.

    Args:
      basis: the initial basis.
      name: prefix of the variables' names.
    """

    def __init__(self, basis: basis_lib.HybridBasis,
                 name: str = 'hybrid_basis'):
        check_is_basis(basis)
        self._basis = basis
        with tf.init_scope():
            self._variables = tuple(
                tf.Variable(m, trainable=False, name=f'{name}_group_{g}')
                for g, m in enumerate(basis.group_matrices))
            self._block_scales = tf.Variable(
                np.ones(basis.num_blocks), dtype=tf.float64, trainable=False,
                name=f'{name}_block_scales')

    @property
    def basis(self) -> basis_lib.HybridBasis:
        """The basis last assigned (its structure is fixed)."""
        return self._basis

    @property
    def variables(self) -> Tuple[tf.Variable, ...]:
        """U_g per group, [d_g, k_g] float32."""
        return self._variables

    @property
    def block_scales(self) -> tf.Variable:
        """s_j per block, [m] float64 (``split_into_blocks``); all 1 until
        ``assign`` is given others."""
        return self._block_scales

    def assign(self, basis: basis_lib.HybridBasis,
               block_scales: Optional[Sequence[float]] = None) -> None:
        """Writes ``basis`` (and ``block_scales``, if given; else the
        current scales stay) into the variables.

        Raises:
          ValueError: ``basis`` is not a HybridBasis of the same structure
            (groups, variable shapes, ranks per group and block); a different
            structure would change the matrix shapes and the block
            dimensions of the step's DpEvent.
        """
        check_is_basis(basis)
        if basis.structure != self._basis.structure:
            raise ValueError(
                'basis must have the structure of the current one (same '
                'groups, variable_shapes and group_ranks): got group_ranks '
                f'{basis.group_ranks} and groups {basis.groups}, expected '
                f'{self._basis.group_ranks} and {self._basis.groups}. Learn '
                'it with the same ranks, groups and rank_split.')
        if block_scales is not None:
            block_scales = check_block_scales(block_scales, basis.num_blocks)
        for variable, matrix in zip(self._variables, basis.group_matrices):
            variable.assign(matrix)
        if block_scales is not None:
            self._block_scales.assign(block_scales)
        self._basis = basis


# The range of a block scale: far beyond a re-plan's (its clips and the
# plan's are within a factor 1e6 of the budget, so its scales too), and
# narrow enough that dividing an ordinary float32 gradient by one neither
# overflows nor flushes it.
BLOCK_SCALE_RANGE = (2.0**-40, 2.0**40)


def check_block_scales(block_scales: Sequence[float],
                       num_blocks: int) -> np.ndarray:
    """``block_scales`` as float64 [num_blocks], each in
    ``BLOCK_SCALE_RANGE``.

    Raises:
      ValueError: naming the argument and the allowed range.
    """
    low, high = BLOCK_SCALE_RANGE
    scales = np.asarray(block_scales, dtype=np.float64)
    if scales.shape != (num_blocks,) or not np.all(
            (scales >= low) & (scales <= high)):
        raise ValueError(
            f'block_scales must be {num_blocks} numbers in [2**-40, 2**40], '
            'one per block (principal blocks, then the residual); got '
            f'{block_scales!r}.')
    return scales


class BasisHolder:
    """``basis`` and ``set_basis`` for a training path (the fast path's model
    or an optimizer) whose hybrid basis lives in ``self._basis_variables``
    (a ``BasisVariables``, or None for one block)."""

    _basis_variables: Optional[BasisVariables]

    @property
    def basis(self) -> Optional[basis_lib.HybridBasis]:
        """The hybrid-clipping basis the next step uses (None: one block)."""
        holder = self._basis_variables
        return None if holder is None else holder.basis

    @property
    def block_scales(self) -> Optional[Tuple[float, ...]]:
        """s_j, the scales of the blocks' clips and noise the next step
        uses (``set_basis``; None: one block)."""
        holder = self._basis_variables
        return None if holder is None else tuple(
            float(s) for s in holder.block_scales.numpy())

    def set_basis(self, basis: basis_lib.HybridBasis, *,
                  block_scales: Optional[Sequence[float]] = None) -> None:
        """Uses ``basis`` from the next step on, without retracing.

        Assigns its matrices to the fixed-shape variables the traced step
        reads. Usable as ``BasisRefresh(..., on_refresh=holder.set_basis)``.
        The basis must come from public data and the current model only.
        ``block_scales`` (s_j > 0 per block; None keeps the current ones, at
        first all 1) rescale the blocks' clips at the same accounted event
        (``split_into_blocks``); they too must come from public data and the
        current model only (``tf_twice.hybrid.replanned_block_scales``).

        Raises:
          ValueError: built without a basis, or ``basis`` has another
            structure (groups, variable shapes, per-group ranks) than the
            current one (the step's DpEvent would change).
        """
        if self._basis_variables is None:
            raise ValueError(
                f'set_basis needs a {type(self).__name__} built with '
                'basis=...: its blocks and per-block parameters are fixed at '
                'construction.')
        self._basis_variables.assign(basis, block_scales)


def split_into_blocks(per_example_grads: Sequence[tf.Tensor],
                      basis: Optional[basis_lib.HybridBasis] = None,
                      matrices: Optional[Sequence[tf.Variable]] = None,
                      block_scales: Optional[tf.Tensor] = None
                      ) -> BlockSums:
    """Per-example gradients -> the blocks of step 1.

    Returns ``blocks[j]``, a list of tensors [B, ...]: with no basis the one
    block ``per_example_grads``; else principal block j as one [B, r_{g,j}]
    tensor per group, then the residual as one [B, d_g] tensor per group.
    ``matrices`` replaces the basis's matrices (see ``HybridBasis.project``).

    ``block_scales`` (s_j > 0, [m]) divides block j by s_j, and
    ``noisy_update`` multiplies its noisy sum by s_j: block j is then clipped
    at s_j c2_j (and s_j c_inf_j) with noise std z_j s_j c2_j, while the
    released sums are s_j times those of the config's mechanism run on the
    inputs a / s_j. For scales from public data and the current model (like
    the basis) that is post-processing of the config's event, so the scales
    re-split the clips at the same epsilon.
    """
    grads = [tf.convert_to_tensor(g) for g in per_example_grads]
    if basis is None:
        return [grads]
    # A group may join variables of different dtypes (a float64 layer next
    # to float32 ones), and a 16-bit projection would round the basis: the
    # blocks are formed in the dtype they are clipped and summed in.
    dtype = precision.accumulation_dtype(*(g.dtype for g in grads))
    grads = [tf.cast(g, dtype) for g in grads]
    projection = basis.project(basis.flatten(grads), matrices)
    blocks = ([list(c) for c in projection.coefficients]
              + [list(projection.residual)])
    if block_scales is None:
        return blocks
    return [[t / tf.cast(block_scales[j], t.dtype) for t in block]
            for j, block in enumerate(blocks)]


def zero_block_sums(variables: Sequence[tf.Variable],
                    basis: Optional[basis_lib.HybridBasis] = None
                    ) -> BlockSums:
    """Zero accumulators with the layout ``block_sums`` returns, in float64
    (``precision.BATCH_SUM_DTYPE``): chunks' sums are added to them in
    float64, and the noise too (``noisy_update``)."""
    dtype = precision.BATCH_SUM_DTYPE
    if basis is None:
        return [[tf.zeros(v.shape, dtype) for v in variables]]
    principal = [[tf.zeros([row[j]], dtype) for row in basis.group_ranks]
                 for j in range(basis.num_principal_blocks)]
    return principal + [[tf.zeros([d], dtype) for d in basis.group_dims]]


def block_sums(per_example_grads: Sequence[tf.Tensor],
               config: config_lib.TwiceSamplingConfig,
               *,
               basis: Optional[basis_lib.HybridBasis] = None,
               matrices: Optional[Sequence[tf.Variable]] = None,
               block_scales: Optional[tf.Tensor] = None,
               weights: Optional[tf.Tensor] = None,
               key: Optional[tf.Tensor] = None,
               example_offset=0,
               masks: Optional[Sequence[Sequence[tf.Tensor]]] = None,
               jit_compile: bool = True) -> BlockSums:
    """Steps 1-4 on one physical microbatch; add the results over chunks.

    Args:
      per_example_grads: one tensor [B, *var_shape] per trainable variable.
      config: the mechanism; one block per basis block.
      basis: the hybrid-clipping basis, or None (one block).
      matrices: the tf.Variables holding the basis (``BasisVariables``), or
        None to use ``basis.group_matrices``.
      block_scales: s_j per block (``split_into_blocks``), or None (all 1).
      weights, key, example_offset, masks, jit_compile: as in
        ``aggregation.clipped_masked_block_sums``.

    Returns:
      ``sums[j][k]``; every example contributes to block j a vector of l2
      norm <= c2_j with coordinates in [-c_inf_j, c_inf_j].
    """
    check_block_params(config, basis)
    blocks = split_into_blocks(per_example_grads, basis, matrices,
                               block_scales)
    return aggregation.config_block_sums(
        blocks, config, weights=weights, key=key,
        example_offset=example_offset, masks=masks, jit_compile=jit_compile)


def noisy_update(sums: BlockSums,
                 config: config_lib.TwiceSamplingConfig,
                 *,
                 basis: Optional[basis_lib.HybridBasis] = None,
                 matrices: Optional[Sequence[tf.Variable]] = None,
                 block_scales: Optional[tf.Tensor] = None,
                 key: Optional[tf.Tensor] = None,
                 noise: Optional[Sequence[Sequence[tf.Tensor]]] = None,
                 noise_dtype: tf.DType = precision.BATCH_SUM_DTYPE
                 ) -> List[tf.Tensor]:
    """Steps 5-6: per-block noise, normalisation, (U a~ + r~) per variable.

    Args:
      sums: the ``block_sums`` of a whole logical batch, added over its
        chunks in float64 (``zero_block_sums``).
      config, basis, matrices, block_scales: as in ``block_sums``.
      key: the step key (block j's noise uses block j's streams).
      noise: optional explicit N(0, 1) draws ``noise[j][k]`` (for tests).
      noise_dtype: as in ``aggregation.add_block_noise_and_normalize``.

    Returns:
      The update, one float64 tensor per trainable variable (in its
      shape); rounding it to the variable's dtype is post-processing.
    """
    check_block_params(config, basis)
    noisy = aggregation.config_noisy_block_sums(
        sums, config, key=key, noise=noise, noise_dtype=noise_dtype)
    if basis is None:
        return noisy[0]
    if block_scales is not None:  # Post-processing: see split_into_blocks.
        noisy = [[t * tf.cast(block_scales[j], t.dtype) for t in block]
                 for j, block in enumerate(noisy)]
    # Linear post-processing of the released pair.
    return basis.unflatten(basis.reconstruct(noisy[:-1], noisy[-1],
                                             matrices))
