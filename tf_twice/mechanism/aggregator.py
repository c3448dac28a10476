"""The private aggregator: the one owner of a DP step's secrets and steps.

Every training path (``tf_twice.keras.DPModel``, alone or compiled with a
tf_twice DP optimizer, and either under a ``tf.distribute`` strategy) runs one
logical batch as

    key = aggregator.begin()
    sums = aggregator.zero_sums(variables)
    for each physical microbatch (rows offset..offset+P-1 of the batch):
        sums = aggregator.accumulate(sums, per_example_grads, weights, key,
                                     example_offset=offset)
    update = aggregator.finish(sums, key)

on top of ``tf_twice.mechanism.hybrid`` (clip, mask, sum per block; noise
and normalise). The aggregator owns the three things whose handling decides
whether the accountant's epsilon holds:

* **The step keys** (``step_keys.StepKeys``): the Philox key of every
  logical step, from which all masks and all noise are derived; never part
  of a model artifact.
* **Distribution**: under a ``tf.distribute`` strategy each replica clips and
  masks its share of the logical batch. The key is drawn ONCE per logical
  batch in cross-replica context and shared, masks are keyed by the global
  position of an example in the logical batch (``global_offset``), the
  replicas' float64 sums are added before the noise, and only replica 0
  returns the update (the others zeros); the optimizer's cross-replica SUM
  of the replicas' updates is then the single-device update, whatever the
  number of replicas R (noise std is the calibrated one, not sqrt(R) times
  it).
* **The basis** (``BasisVariables``, via ``hybrid.BasisHolder``): public,
  not checkpointed, swapped without retracing. A hybrid mechanism rebuilt
  from a model artifact (``awaiting_basis``) refuses every step until
  ``set_basis`` gives it a basis of the config's block dimensions: without
  one no step could run the config's event.

Guarantee: with Poisson-sampled logical batches at rate q1 (the config's),
each ``begin``..``finish`` is one ``config.dp_event()``; the update is
post-processing.
"""

from __future__ import annotations

import contextlib
import math
from typing import List, Optional, Sequence

import tensorflow as tf

from tf_twice import config as config_lib
from tf_twice.mechanism import basis as basis_lib
from tf_twice.mechanism import hybrid
from tf_twice.mechanism import precision
from tf_twice.mechanism.step_keys import StepKeys
from tf_twice.mechanism.step_keys import state_fingerprint

__all__ = ['PrivateAggregator']

def _replica_context():
    """(replica id, number of replicas) of the current replica context."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return None, 1
    return context, context.num_replicas_in_sync


def global_offset(local_size: tf.Tensor) -> tf.Tensor:
    """Position in the logical batch of this replica's first row.

    Replicas receive consecutive slices of each logical batch (in replica
    order), so replica r starts after the rows of replicas 0..r-1. Keying
    masks by this global position makes them independent of how many
    replicas share the batch.
    """
    context, replicas = _replica_context()
    if context is None:
        return tf.constant(0, tf.int32)
    rid = tf.cast(context.replica_id_in_sync_group, tf.int32)
    one_hot = tf.one_hot(rid, replicas, dtype=tf.int32) * tf.cast(
        local_size, tf.int32)
    sizes = context.all_reduce(tf.distribute.ReduceOp.SUM, one_hot)
    return tf.reduce_sum(sizes[:rid])


class PrivateAggregator(hybrid.BasisHolder):
    """Clips, masks, sums and noises per-example gradients of logical batches.

    Args:
      config: the mechanism (``TwiceSamplingConfig``), calibrated (or
        explicitly ``non_private``); one Block per basis block.
      basis: None (one block) or a ``HybridBasis`` learned from PUBLIC data;
        its block dimensions complete the config's blocks.
      seed: of the step keys (``StepKeys``); None uses OS entropy.
      awaiting_basis: for a config of several blocks given without a basis,
        as a model artifact rebuilds it (no artifact holds the basis): the
        config must then carry every block's dimension, and every step is
        refused until ``set_basis`` gives a basis of those dimensions.
    """

    def __init__(self, config: config_lib.TwiceSamplingConfig,
                 basis: Optional[basis_lib.HybridBasis] = None,
                 seed: Optional[int] = None, *,
                 awaiting_basis: bool = False) -> None:
        self._awaiting_basis = bool(
            awaiting_basis and basis is None
            and isinstance(config, config_lib.TwiceSamplingConfig)
            and config.num_blocks > 1 and config.dimensions is not None)
        if not self._awaiting_basis:
            hybrid.check_block_params(config, basis)
        # Where a basis given later creates its variables: in the strategy
        # the mechanism was built under, as one given now would (None: the
        # default strategy, which copies of the aggregator cannot hold).
        self._strategy = (tf.distribute.get_strategy()
                          if self._awaiting_basis
                          and tf.distribute.has_strategy() else None)
        if not config.is_calibrated:
            raise ValueError(
                'config has no noise_multiplier: calibrate it first '
                '(config.calibrate(target_epsilon=..., delta=..., steps=...)) '
                'or give noise_multiplier explicitly.')
        if basis is not None:
            config = config.with_dimensions(basis.block_dimensions)
        self._config = config
        # Untracked (see BasisVariables): the basis is not checkpointed.
        self._basis_variables = (None if basis is None else
                                 hybrid.BasisVariables(basis))
        self._keys = StepKeys(seed)

    @property
    def config(self) -> config_lib.TwiceSamplingConfig:
        """The mechanism every step runs (with the basis's dimensions)."""
        return self._config

    def dp_event(self):
        """The DpEvent of one ``begin``..``finish`` on Poisson batches."""
        return self._config.dp_event()

    @property
    def keys(self) -> StepKeys:
        """The secret stream of step keys."""
        return self._keys

    @property
    def awaiting_basis(self) -> bool:
        """Whether the config's hybrid basis has yet to come by
        ``set_basis`` (no step runs until then)."""
        return self._awaiting_basis

    def require_basis(self) -> None:
        """Refuses to run a step while ``awaiting_basis``.

        Raises:
          ValueError: saying how to give the basis.
        """
        if self._awaiting_basis:
            raise ValueError(
                f'the config has {self._config.num_blocks} blocks (hybrid '
                'clipping) but no basis: it was rebuilt from its config (a '
                'model artifact, from_config or clone_model), which never '
                'holds the basis. Before training '
                'call set_basis(basis) on the model (or on its tf_twice DP '
                'optimizer) with a basis learned from public data, of block '
                f'dimensions {self._config.dimensions}: e.g. the one it '
                'trained with, saved by HybridBasis.save and read back by '
                'tf_twice.mechanism.basis.HybridBasis.load(path).')

    def set_basis(self, basis: basis_lib.HybridBasis, *,
                  block_scales: Optional[Sequence[float]] = None) -> None:
        """``BasisHolder.set_basis``; while ``awaiting_basis``, gives the
        mechanism its basis, whose block dimensions must be the config's
        (the event the ledger may have accounted already)."""
        if not self._awaiting_basis:
            super().set_basis(basis, block_scales=block_scales)
            return
        hybrid.check_block_params(self._config, basis)
        self._config.with_dimensions(basis.block_dimensions)  # Must agree.
        scope = (self._strategy.scope() if self._strategy is not None
                 and not tf.distribute.has_strategy()
                 else contextlib.nullcontext())
        with scope:
            variables = hybrid.BasisVariables(basis)
            variables.assign(basis, block_scales)
        self._basis_variables = variables
        self._awaiting_basis = False

    def _basis_and_matrices(self, variables: Sequence[tf.Variable]):
        self.require_basis()
        basis = self.basis
        if basis is None:
            return None, None, None
        hybrid.check_basis_matches_variables(basis, variables)
        return (basis, self._basis_variables.variables,
                self._basis_variables.block_scales)

    def check_variables(self, variables: Sequence[tf.Variable]) -> None:
        """Refuses trainable variables that the mechanism's event does not
        describe.

        With a basis, its variable shapes must be theirs (the event's block
        dimensions are the basis's). Without, a dimension given in the
        config's one Block must be their number of coordinates: the
        accountant trusts it (a block of r <= d0 coordinates has a smaller
        worst case), so a dimension below the model's would make the
        reported epsilon too small.

        Raises:
          ValueError: naming both numbers.
        """
        if self._awaiting_basis:  # set_basis checks the basis's dimensions.
            return
        basis = self.basis
        if basis is not None:
            hybrid.check_basis_matches_variables(basis, variables)
            return
        dimension = self._config.blocks[0].dimension
        if dimension is None:
            return
        coordinates = sum(math.prod(int(s) for s in v.shape)
                          for v in variables)
        if dimension != coordinates:
            raise ValueError(
                f'the config\'s block has dimension={dimension}, but the '
                f'trainable variables have {coordinates} coordinates: the '
                'accountant would assume a per-example contribution spread '
                'over the wrong number of coordinates. Leave dimension=None '
                '(the accountant then needs none) or give the model\'s.')

    def begin(self, variables: Sequence[tf.Variable],
              step: tf.Tensor) -> tf.Tensor:
        """Starts a logical batch: its key, shared by all replicas.

        ``variables`` and ``step`` (the model's trainable variables and
        DP steps the weights hold) position a seeded stream at its first draw.
        The variables are checked against the mechanism first
        (``check_variables``, when the step is traced).
        """
        self.require_basis()
        self.check_variables(variables)
        fingerprint = (state_fingerprint(variables, step)
                       if self._keys.seeded else None)
        return self._keys.next_key(fingerprint)

    def zero_sums(self, variables: Sequence[tf.Variable]) -> hybrid.BlockSums:
        """Zero accumulators in the layout ``accumulate`` returns."""
        self.require_basis()
        return hybrid.zero_block_sums(variables, self.basis)

    def accumulate(self, sums: hybrid.BlockSums,
                   per_example_grads: Sequence[tf.Tensor],
                   variables: Sequence[tf.Variable], *, weights: tf.Tensor,
                   key: tf.Tensor, example_offset) -> hybrid.BlockSums:
        """Adds one physical microbatch's clipped masked sums to ``sums``.

        ``example_offset`` is the global position of the microbatch's first
        row in the logical batch (``global_offset`` plus the chunk offset).
        Each row is an example computed in isolation: a non-finite row
        contributes nothing and changes no other row.
        """
        basis, matrices, scales = self._basis_and_matrices(variables)
        chunk = hybrid.block_sums(per_example_grads, self._config,
                                  basis=basis, matrices=matrices,
                                  block_scales=scales,
                                  weights=weights, key=key,
                                  example_offset=example_offset)
        return [[s + tf.cast(c, s.dtype) for s, c in zip(block, chunk_block)]
                for block, chunk_block in zip(sums, chunk)]

    def finish(self, sums: hybrid.BlockSums, key: tf.Tensor,
               variables: Sequence[tf.Variable]) -> List[tf.Tensor]:
        """Noise (once per logical batch) and normalisation: the update.

        The noise is added to the float64 sums before anything is
        rounded: the update, in the variables' dtypes, is post-processing
        of the noisy sums. The noise is drawn in the gradients'
        accumulation dtype (float32 for a float32 model). Under a
        multi-replica strategy the replicas' float64 sums are added first
        (an all-reduce), replica 0 returns the noisy update and the others
        zeros, so the optimizer's cross-replica SUM of the replicas'
        updates is exactly replica 0's: one copy of the noise, and no
        replica's noise-free share rounded before the sum.
        """
        basis, matrices, scales = self._basis_and_matrices(variables)
        context, _ = _replica_context()
        if context is not None:
            sums = context.all_reduce(tf.distribute.ReduceOp.SUM, sums)
        update = hybrid.noisy_update(
            sums, self._config, basis=basis, matrices=matrices,
            block_scales=scales, key=key,
            noise_dtype=precision.accumulation_dtype(
                *(v.dtype for v in variables)))
        update = [tf.cast(u, tf.as_dtype(v.dtype))
                  for u, v in zip(update, variables)]
        if context is None:
            return update
        first = tf.equal(context.replica_id_in_sync_group, 0)
        return [tf.where(first, u, tf.zeros_like(u)) for u in update]
