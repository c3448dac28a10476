"""The step keys: the secret Philox key of every logical DP step.

Every mask and every noise draw of a step is derived from its key
(``randomness``). Whoever knows the keys can recompute the noise and
subtract it, so they are NEVER part of a model artifact: ``StepKeys`` is
deliberately not trackable (no TF checkpoint, SavedModel, ``.keras``,
``.h5`` or ``get_config`` can reach it), a new process draws its keys from
OS entropy, and a seeded stream follows its seed only from a fresh start
(step 0, the weights it was wrapped with); a resumed or forked run takes
OS entropy, never a replay. Bit-reproducible seeded runs save and load the
stream explicitly in a separate, secret run-state file (``save``/``load``).
"""

from __future__ import annotations

import json
import os
from typing import Optional, Sequence

import tensorflow as tf

from tf_twice import _validate
from tf_twice import _files as files
from tf_twice.mechanism import randomness

__all__ = ['StepKeys', 'RANDOM_STATE_FORMAT', 'state_fingerprint']

RANDOM_STATE_FORMAT = 'tf_twice.SecretRandomState'
_MAX_SEED = 2**63  # Seeds are in [0, 2**63), as in tf_twice.sampling.
# The weights of state_fingerprint's second sum: index * 48271 mod 2**31 - 1
# (Lehmer's multiplier and prime), below 2**31.
_FINGERPRINT_MULTIPLIER, _FINGERPRINT_MODULUS = 48271, 2**31 - 1
# Second word of the seed of the Philox chain that positions a seeded stream.
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

    Per variable: two integer sums of the 32-bit halves of its values in
    float64 (so the same values give the same words in any dtype), plain and
    weighted by a fixed pseudo-random sequence modulo a prime, plus the
    step; no sum overflows below 2**31 values (above, they wrap alike with
    and without XLA). Restored, loaded or assigned weights give other
    words, so a seeded stream positioned by them is another one. Integer
    sums do not depend on the order of the reduction (a float sum does), so
    a step compiled by XLA computes the same words as the eager
    ``record_start``.
    """
    words = [tf.cast(step, tf.int64)]
    for variable in variables:
        halves = tf.bitcast(tf.cast(variable, tf.float64), tf.int32)
        data = tf.bitwise.bitwise_and(
            tf.cast(tf.reshape(halves, [-1]), tf.int64), 0xFFFFFFFF)
        index = tf.range(1, tf.size(data, out_type=tf.int64) + 1)
        weights = (index * _FINGERPRINT_MULTIPLIER) % _FINGERPRINT_MODULUS
        words.append(tf.reduce_sum(data))  # < 2**32 per term.
        words.append(tf.reduce_sum(data * weights % _FINGERPRINT_MODULUS))
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
        model had when wrapped by ``DPModel``, ``record_start``) by a keyed
        hash of the seed and the model's weights (``state_fingerprint``), so
        the same seed on the same initial model gives the same run; from
        anything else (a resumed or forked run, weights loaded or assigned
        after wrapping) by OS entropy, so no two runs from one checkpoint
        share noise.
        Only an explicitly loaded run state (``load``) continues a stream.
        A seed must be secret and used for one run only: the same seed on
        the same weights and other data gives the same noise.
    """

    def __init__(self, seed: Optional[int] = None) -> None:
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
            # Where a seeded stream starts unless its first step is a fresh
            # start: OS entropy, drawn here because XLA has no op for it.
            self._entropy_state = None if seed is None else tf.Variable(
                tf.raw_ops.NonDeterministicInts(shape=[3], dtype=tf.int64),
                trainable=False, name='step_keys_entropy')
    def __deepcopy__(self, memo):
        # A copy of the state would replay every later key: a copy is a new
        # OS-entropy stream instead.
        return StepKeys(None)

    def __reduce__(self):
        raise TypeError(
            'StepKeys are secret and are not pickled; save_random_state '
            'writes them to a secret file on purpose.')

    @property
    def seeded(self) -> bool:
        """Whether the stream started from a user seed."""
        return self._seed is not None

    def record_start(self, fingerprint: tf.Tensor) -> None:
        """Records the model's state words when it was wrapped: a seeded
        stream follows its seed only if its first step starts there."""
        self._start = tf.constant(fingerprint.numpy())

    def _seeded_state(self, fingerprint: tf.Tensor) -> tf.Tensor:
        """Philox state [0, 0, key] of the seed and the model's state.

        A chain of stateless Philox draws keyed by the seed, one per state
        word: a key from the seed and the state only, in ops that XLA
        compiles (a DP step with ``jit_compile=True``).
        """
        seed = tf.constant([self._seed, _STREAM_DOMAIN], tf.int64)
        for k in range(int(fingerprint.shape[0])):
            seed = tf.random.experimental.stateless_fold_in(
                seed, fingerprint[k], alg='philox')
        key = tf.random.stateless_uniform([], seed, minval=None, maxval=None,
                                          dtype=tf.int64, alg='philox')
        zero = tf.constant(0, tf.int64)
        return tf.stack([zero, zero, key])

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
                             self._entropy_state)
            # Computed at every step but used only at the first: a select,
            # not a tf.cond, which cross-replica contexts do not support.
            state = tf.where(self._positioned, self._generator.state, start)
            with tf.control_dependencies([
                    self._generator.state.assign(state),
                    self._positioned.assign(True)]):
                key = randomness.draw_step_key(self._generator)
        else:
            key = randomness.draw_step_key(self._generator)
        return key

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
