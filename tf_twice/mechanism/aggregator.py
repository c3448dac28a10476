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

* **The step keys** (``StepKeys``): the Philox key of every logical step,
  from which all masks and all noise are derived. Whoever knows them can
  recompute the noise and subtract it, so they are NEVER part of a model
  artifact: ``StepKeys`` is deliberately not trackable (no TF checkpoint,
  SavedModel, ``.keras``, ``.h5`` or ``get_config`` can reach it), a new
  process draws its keys from OS entropy, and a seeded stream follows its
  seed only from a fresh start (step 0, the weights it was wrapped with); a
  resumed or forked run takes OS entropy, never a replay.
  Bit-reproducible seeded runs save and load the stream explicitly in a
  separate, secret run-state file (``save``/``load``).
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
import json
import math
import os
from typing import List, Optional, Sequence

import dp_accounting
import tensorflow as tf

from tf_twice import _validate
from tf_twice import _files as files
from tf_twice import config as config_lib
from tf_twice.mechanism import basis as basis_lib
from tf_twice.mechanism import hybrid
from tf_twice.mechanism import precision
from tf_twice.mechanism import randomness

__all__ = ['PrivateAggregator', 'StepKeys', 'RANDOM_STATE_FORMAT',
           'state_fingerprint']

RANDOM_STATE_FORMAT = 'tf_twice.SecretRandomState'
_MAX_SEED = 2**63  # Seeds are in [0, 2**63), as in tf_twice.sampling.
# Second word of the SipHash key that positions a seeded stream.
_STREAM_DOMAIN = 0x54776963654B6579  # 'TwiceKey'



def _entropy_generator() -> tf.random.Generator:
    """A generator keyed by OS entropy, or a clear error where TensorFlow's
    op determinism forbids it."""
    try:
        return tf.random.Generator.from_non_deterministic_state()
    except RuntimeError as e:
        raise ValueError(
            'seed=None draws the secret noise keys from OS entropy, which '
            'TensorFlow refuses while op determinism is enabled '
            '(tf.config.experimental.enable_op_determinism). Pass seed= a '
            'secret integer in [0, 2**63) used for one run only (e.g. '
            'secrets.randbits(63)): anyone who learns it can replay the '
            'noise. Or leave op determinism off.') from e


def state_fingerprint(variables: Sequence[tf.Variable],
                      step: tf.Tensor) -> tf.Tensor:
    """int64 words that change with the weights and the step count.

    Per variable: the bits of its sum and of one fixed pseudo-random
    projection (float64), plus the step. Restored, loaded or assigned weights
    give other words, so a seeded stream positioned by them is another one.
    """
    words = [tf.cast(step, tf.int64)]
    for variable in variables:
        flat = tf.reshape(tf.cast(variable, tf.float64), [-1])
        projection = tf.sin(tf.range(1, tf.size(flat) + 1, dtype=tf.float64))
        for value in (tf.reduce_sum(flat), tf.reduce_sum(flat * projection)):
            words.append(tf.bitcast(value, tf.int64))
    return tf.stack(words)


class StepKeys:
    """The stream of per-step Philox keys; never part of a model artifact.

    Not a ``tf.Module`` and not trackable, so Keras does not put it in
    ``weights``, checkpoints, SavedModels or configs; it is neither copied
    (a deep copy gets a fresh OS-entropy stream) nor pickled. Under a
    distribution strategy keys are drawn in cross-replica context.

    Args:
      seed: None (default): keys from OS entropy, never reproducible. An
        integer: a reproducible stream for experiments. It is positioned at
        its first draw: from a fresh start (step count 0 and the weights the
        model had when wrapped by ``DPModel``, ``record_start``) by a keyed hash of the
        seed and the model's weights (``state_fingerprint``), so the same
        seed on the same initial model gives the same run; from anything
        else (a resumed or forked run, weights loaded or assigned after
        wrapping) by OS entropy, so no two runs from one checkpoint share
        noise.
        Only an explicitly loaded run state (``load``) continues a stream.
        A seed must be secret and used for one run only: the same seed on
        the same weights and other data gives the same noise.
      event: the ``DpEvent`` of every step that draws a key from this
        stream (its aggregator's config is frozen); None for a mechanism
        without one (``non_private``). A ledger charges a stream's steps
        only if this is its own event.
    """

    def __init__(self, seed: Optional[int] = None, *,
                 event: Optional[dp_accounting.DpEvent] = None) -> None:
        self.event = event
        self._seed = (None if seed is None else
                      _validate.integer('seed', seed, 0, _MAX_SEED - 1))
        with tf.init_scope():
            self._generator = (_entropy_generator() if seed is None
                               else tf.random.Generator.from_seed(seed))
            # An unseeded stream is positioned from birth; a seeded one at
            # its first draw (by the model's state) or by ``set_state``.
            self._positioned = tf.Variable(
                seed is None, trainable=False, name='step_keys_positioned')
            # The model's state words when it was compiled (record_start).
            self._start = None
            # Keys drawn: one per logical step, never rewound by a restore
            # (the ledger counts steps with it).
            self._draws = tf.Variable(0, dtype=tf.int64, trainable=False,
                                      name='step_keys_draws')
        # Draws that some ledger accounts (charged, then bound to the
        # weights; `PrivacyLedger`) or that are exempt (the trials of an audit, whose weights are restored): a
        # ledger seeing this stream for the first time charges every draw
        # after it, so steps that ran before any ledger saw the model are
        # not lost.
        self.accounted_draws = 0
        # Of those, draws whose steps the weights do not hold (an audit's
        # trials): a ledger need not cover them.
        self.exempt_draws = 0
        # The draw count from which on steps ran on input that no check
        # showed to be Poisson-sampled (``mark_unverified``); None: none.
        self.unverified_from: Optional[int] = None

    def mark_unverified(self) -> None:
        """Records that the next steps run on input not known to be
        Poisson-sampled (e.g. ``fit`` without a ledger on fixed-size
        batches): no ledger charges them as its event, since the
        accountant's epsilon is not a bound for them, and the weights keep
        them."""
        if self.unverified_from is None:
            self.unverified_from = self.draws

    def __deepcopy__(self, memo):
        # A copy of the state would replay every later key: a copy is a new
        # OS-entropy stream instead (of the same mechanism's steps).
        return StepKeys(None, event=self.event)

    def __reduce__(self):
        raise TypeError(
            'StepKeys are secret and are not pickled; save_random_state '
            'writes them to a secret file on purpose.')

    @property
    def seeded(self) -> bool:
        """Whether the stream started from a user seed."""
        return self._seed is not None

    @property
    def draws(self) -> int:
        """Keys drawn so far in this process (one per logical step)."""
        return int(self._draws.numpy())

    def record_start(self, fingerprint: tf.Tensor) -> None:
        """Records the model's state words when it was wrapped: a seeded
        stream follows its seed only if its first step starts there."""
        self._start = tf.constant(fingerprint.numpy())

    def _seeded_state(self, fingerprint: tf.Tensor) -> tf.Tensor:
        """Philox state [0, 0, key] of the seed and the model's state."""
        text = tf.strings.reduce_join(tf.strings.as_string(fingerprint),
                                      separator=',')
        # SipHash keyed by the seed: a key from the seed and the state only.
        key = tf.strings.to_hash_bucket_strong(
            text, 2**62, key=[self._seed, _STREAM_DOMAIN])
        zero = tf.constant(0, tf.int64)
        return tf.stack([zero, zero, tf.cast(key, tf.int64)])

    def _draw(self, fingerprint: Optional[tf.Tensor]) -> tf.Tensor:
        if self._seed is not None:
            if fingerprint is None:
                raise ValueError('a seeded stream needs the model\'s state '
                                 '(fingerprint) at its first draw.')
            # The seed decides the stream only for a fresh start: the state
            # recorded when the model was wrapped (``record_start``), at
            # step 0. Any other first draw (a resume, a fork of a checkpoint,
            # weights loaded after wrapping) takes OS entropy, so two runs
            # from one checkpoint never share noise.
            fresh = tf.constant(False)
            if self._start is not None and self._start.shape == (
                    fingerprint.shape):
                fresh = tf.logical_and(
                    tf.equal(fingerprint[0], 0),
                    tf.reduce_all(tf.equal(fingerprint, self._start)))
            start = tf.where(fresh, self._seeded_state(fingerprint),
                             tf.raw_ops.NonDeterministicInts(
                                 shape=[3], dtype=tf.int64))
            # Computed at every step but used only at the first: a select,
            # not a tf.cond, which cross-replica contexts do not support.
            state = tf.where(self._positioned, self._generator.state, start)
            with tf.control_dependencies([
                    self._generator.state.assign(state),
                    self._positioned.assign(True)]):
                key = randomness.draw_step_key(self._generator)
        else:
            key = randomness.draw_step_key(self._generator)
        with tf.control_dependencies([key]):
            self._draws.assign_add(1)
        return tf.identity(key)

    def next_key(self, fingerprint: Optional[tf.Tensor] = None) -> tf.Tensor:
        """Draws the Philox key of one logical step (uint64, shape [1]).

        ``fingerprint`` holds the model's state words
        (``state_fingerprint``); a seeded stream needs it at its first draw.
        In a replica context the key is drawn once, in cross-replica
        context, and every replica gets the same one (a generator drawn from
        in replica context of a strategy would give each replica a stream
        of its own, different from the single-device one, even for R = 1).
        """
        context = tf.distribute.get_replica_context()
        if context is None:
            return self._draw(fingerprint)

        def draw(strategy, words):
            # Mirrored variables give every replica the same words.
            if words is not None:
                words = strategy.experimental_local_results(words)[0]
            return self._draw(words)

        return context.merge_call(draw, args=(fingerprint,))

    def get_state(self) -> dict:
        """The stream's state: SECRET (it determines all future noise)."""
        if not bool(self._positioned.numpy()):
            raise ValueError('a seeded stream has no state before its first '
                             'step: save it after training has started.')
        return {'format': RANDOM_STATE_FORMAT, 'version': 1,
                'algorithm': int(self._generator.algorithm),
                'state': [int(v) for v in self._generator.state.numpy()]}

    def set_state(self, state: dict) -> None:
        """Continues the stream from ``get_state()``'s output."""
        if not isinstance(state, dict) or state.get(
                'format') != RANDOM_STATE_FORMAT or state.get('version') != 1:
            raise ValueError(
                f'state must be a {RANDOM_STATE_FORMAT} version 1 dict (from '
                'StepKeys.get_state or save_random_state); got '
                f'{str(state)[:80]!r}.')
        if state['algorithm'] != int(self._generator.algorithm):
            raise ValueError(
                f'state holds algorithm {state["algorithm"]}, this stream '
                f'uses {int(self._generator.algorithm)}.')
        values = state['state']
        size = int(self._generator.state.shape[0])
        if (not isinstance(values, list) or len(values) != size
                or not all(isinstance(v, int) for v in values)):
            raise ValueError(f'state["state"] must be a list of {size} '
                             'integers.')
        self._generator.state.assign(tf.constant(values, tf.int64))
        self._positioned.assign(True)

    def save(self, path: str, step: Optional[int] = None,
             weights: Optional[str] = None) -> None:
        """Writes the SECRET run state to ``path`` (atomically, mode 0600).

        Anyone holding this file can recompute the masks and noise of every
        later step and subtract them from released weights: keep it as
        secret as the training data, apart from checkpoints and models,
        and delete it when the run is done. ``step`` (the training step the
        state belongs to) and ``weights`` (a digest of the weights it
        belongs to) are recorded so that ``load`` can refuse the file
        anywhere else.
        """
        state = self.get_state()
        if step is not None:
            state['step'] = int(step)
        if weights is not None:
            state['weights'] = str(weights)
        files.atomic_write_json(os.fspath(path), state)

    def load(self, path: str, step: Optional[int] = None,
             weights: Optional[str] = None) -> None:
        """Continues the stream from a file written by ``save``.

        Raises:
          ValueError: the file was saved at another ``step`` or with other
            ``weights`` (e.g. an older file beside a newer checkpoint, or
            another run's), or records no ``step`` or ``weights`` where they
            are given (a file of an earlier version): the next steps would
            reuse the keys, i.e. the noise, of steps whose updates are
            already in released weights, and two releases with the same
            noise reveal their difference.
        """
        with open(os.fspath(path)) as f:
            state = json.load(f)
        if not isinstance(state, dict):
            state = {}
        where = None
        saved = state.get('step')
        if ((step is not None and saved is None)
                or (weights is not None and state.get('weights') is None)):
            # Written by an earlier version (or edited): it cannot be
            # matched with this model, so it might continue another point.
            where = ('without a record of the step and weights it belongs '
                     'to, so it cannot be matched with this model')
        elif step is not None and int(saved) != int(step):
            where = f'at step {saved}, but this model is at step {int(step)}'
        elif weights is not None and state['weights'] != weights:
            # The same step count is not the same point of a run: a
            # recompile restarts the optimizer's count, and runs forked from
            # one checkpoint share it.
            where = 'with other weights than this model\'s'
        if where is not None:
            raise ValueError(
                f'The random state in {os.fspath(path)!r} was saved {where}: '
                'its next steps would reuse the noise of steps already in '
                'released weights. Load the checkpoint saved with that state '
                '(load_weights first, then load_random_state), or leave the '
                'state unloaded (fresh OS entropy).')
        self.set_state(state)


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
        self._keys = StepKeys(seed, event=(
            None if config.non_private else config.dp_event()))

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

    def set_basis(self, basis: basis_lib.HybridBasis) -> None:
        """``BasisHolder.set_basis``; while ``awaiting_basis``, gives the
        mechanism its basis, whose block dimensions must be the config's
        (the event the ledger may have accounted already)."""
        if not self._awaiting_basis:
            super().set_basis(basis)
            return
        hybrid.check_block_params(self._config, basis)
        self._config.with_dimensions(basis.block_dimensions)  # Must agree.
        scope = (self._strategy.scope() if self._strategy is not None
                 and not tf.distribute.has_strategy()
                 else contextlib.nullcontext())
        with scope:
            self._basis_variables = hybrid.BasisVariables(basis)
        self._awaiting_basis = False

    def _basis_and_matrices(self, variables: Sequence[tf.Variable]):
        self.require_basis()
        basis = self.basis
        if basis is None:
            return None, None
        hybrid.check_basis_matches_variables(basis, variables)
        return basis, self._basis_variables.variables

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
        basis, matrices = self._basis_and_matrices(variables)
        chunk = hybrid.block_sums(per_example_grads, self._config,
                                  basis=basis, matrices=matrices,
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
        basis, matrices = self._basis_and_matrices(variables)
        context, _ = _replica_context()
        if context is not None:
            sums = context.all_reduce(tf.distribute.ReduceOp.SUM, sums)
        update = hybrid.noisy_update(
            sums, self._config, basis=basis, matrices=matrices, key=key,
            noise_dtype=precision.accumulation_dtype(
                *(v.dtype for v in variables)))
        update = [tf.cast(u, tf.as_dtype(v.dtype))
                  for u, v in zip(update, variables)]
        if context is None:
            return update
        first = tf.equal(context.replica_id_in_sync_group, 0)
        return [tf.where(first, u, tf.zeros_like(u)) for u in update]
