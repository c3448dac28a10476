"""The fast per-example training path: a Keras model with a DP train_step.

An optimizer only sees the batch loss, so tf_privacy's optimizers get
per-example gradients from ``tape.jacobian``, which back-propagates through
the whole batch once per example (O(B^2)). ``DPModel.train_step`` instead
runs the forward and backward pass of one example under
``tf.vectorized_map`` (O(B)) and feeds the per-example gradients to the same
``tf_twice.mechanism.aggregation`` as the optimizer classes.

Input contract: each dataset element is ONE logical batch ``(x, y)`` or
``(x, y, sample_weight)`` (weights in [0, 1]: 1 real, 0 padding) whose size
may change between steps, 0 included (an empty logical batch is a valid DP
step whose update is pure noise). The step pads it with zero-weight rows to a
multiple of ``physical_batch_size``, runs the physical microbatches in a
``tf.while_loop`` with static shapes, accumulates the clipped masked sums, adds
noise once and applies the update with the compiled (plain Keras) optimizer.

Privacy: the mechanism is the model's ``TwiceSamplingConfig``. With Poisson
sampling of its n examples at rate q1 (``expected_batch_size`` = n * q1)
each ``train_step`` is one (q1, q2)-twice-sampled Gaussian mechanism, exactly
``config.dp_event()`` (the paper's "Privacy Amplification from Twice
Sampling" theorem); the optimizer update is post-processing. Reported loss
and metrics are computed on the real examples without noise and are not
private.

Hybrid clipping: with ``basis=`` (a ``HybridBasis`` learned from PUBLIC
data, e.g. ``learn_basis``) and a config with one Block per basis block
(principal blocks, then the residual), every microbatch's per-example
gradients are split into the
basis's blocks, each block is clipped, masked and summed on its own, and
each gets its own noise (``tf_twice.mechanism.hybrid``, the same code as the
optimizer path). One step is then the multi-block
``TwiceSampledGaussianDpEvent`` with ``block_dimensions =
basis.block_dimensions``. The basis lives in fixed-shape non-trainable
variables: ``set_basis`` (e.g. ``BasisRefresh(...,
on_refresh=model.set_basis)``) changes it between steps without retracing.
The basis is NOT part of checkpoints (it is public data, possibly GBs): a
resumed run relearns it (``BasisRefresh`` refreshes at its first step) or
sets a saved one (``HybridBasis.save``/``load``, then ``set_basis``); any
public basis keeps the guarantee.

Accounting: ``DPModel.dp_event()`` is the ``TwiceSampledGaussianDpEvent``
of one step, derived from the config, and ``PrivacyLedger.for_model(model,
delta=...)`` builds a ledger from it (``tf_twice.keras.make_private`` wires
model, data and ledger in one call). When ``fit`` gets a ``PrivacyLedger``
among its callbacks it refuses input that is not Poisson-sampled from the
config's n at its q1 and a ledger whose event is not the model's
(``guards``), so the ledger's epsilon is for the training that runs.

Secrets: the step keys that determine every mask and all noise live in the
model's ``PrivateAggregator`` and are never part of a model artifact (TF
checkpoints, ``.weights.h5``, ``.h5``, ``.keras``, SavedModel,
``get_config``): whoever holds an artifact cannot recompute the noise. A new
process draws fresh keys from OS entropy; a seeded model follows its seed
only from a fresh start (step 0, the weights it was wrapped with), so
restored, loaded or assigned weights take OS entropy and a resumed or forked
run never replays noise. A bit-reproducible seeded run instead saves
and loads its stream in a separate, SECRET file (``save_random_state`` /
``load_random_state``).

Distribution: under a ``tf.distribute`` strategy (e.g. ``MirroredStrategy``
over several GPUs; build and compile the model in ``strategy.scope()``), each
replica clips and masks its share of a logical batch with masks keyed by the
example's global position, the shares' sums are added by the optimizer's
cross-replica sum and the noise is added once per logical batch: the update
equals the single-device one for any number of replicas.

Optimizer path (Keras 2 with tensorflow-privacy): compiling a DPModel with
a tf_twice DP optimizer (e.g. ``TwiceSamplingDPKerasSGDOptimizer``) takes the
mechanism from the optimizer and runs it here, on per-example gradients
computed in isolation. On Keras 3 give the config to DPModel and compile
with a plain Keras optimizer: the same mechanism.

Keras versions: the same code runs on Keras 2 (TensorFlow <= 2.15, or
tf-keras) and on Keras 3 with the TensorFlow backend (``tf_twice._keras``).
``compile`` defaults to ``jit_compile=False`` on both (XLA cannot compile
the seeded step keys' hashing, and was slower on CPU).

Training metrics: the loss and metrics of ``fit`` are computed on the
private batch without noise; their keys carry the prefix ``nonprivate_``
(e.g. ``nonprivate_loss``) so that nobody mistakes them for released values.
"""

import json
import logging
import math
import os
from typing import Any, Dict, List, Optional, Sequence

import tensorflow as tf

from tf_twice import _files as files
from tf_twice import _keras
from tf_twice import _validate
from tf_twice import config as config_lib
from tf_twice import sampling
from tf_twice.accounting import TwiceSampledGaussianDpEvent
from tf_twice.keras import guards
from tf_twice.keras import ledger as ledger_lib
from tf_twice.mechanism import aggregator as aggregator_lib
from tf_twice.mechanism import basis as basis_lib
from tf_twice.mechanism import hybrid

__all__ = ['DPModel', 'default_physical_batch_size']

_LOGGER = logging.getLogger(__name__)
# Training logs computed on private batches without noise carry this prefix.
NONPRIVATE_PREFIX = 'nonprivate_'
# Keys of a legacy optimizer's variables in the model's own .keras entry.
_LEGACY_OPTIMIZER_KEY = 'legacy_optimizer_'


def _per_example_loss_fn(loss: Any):
    """Returns f(y_true, y_pred) -> per-example losses [B] for ``loss``."""
    if loss is None:
        raise ValueError('DPModel.compile needs a loss, got loss=None.')
    if isinstance(loss, (dict, list, tuple)):
        raise ValueError(
            'DPModel supports a single loss (one model output), got '
            f'{type(loss).__name__}.')
    if not isinstance(loss, tf.keras.losses.Loss):
        loss = tf.keras.losses.get(loss)
    sparse = (isinstance(loss, tf.keras.losses.SparseCategoricalCrossentropy)
              or loss is tf.keras.losses.sparse_categorical_crossentropy)
    # Loss.call is the unreduced per-sample loss; the reduction setting is
    # irrelevant here because every example is reduced on its own.
    fn = loss.call if isinstance(loss, tf.keras.losses.Loss) else loss

    def per_example(y_true, y_pred):
        y_pred = tf.convert_to_tensor(y_pred)
        y_true = tf.cast(y_true, y_pred.dtype) if y_true.dtype.is_floating \
            else y_true
        invalid = None
        if (sparse and y_pred.shape[-1] is not None) or _are_class_indices(
                y_true, y_pred):
            # A label outside [0, classes) would abort the step (revealing
            # that the record was sampled) with an error listing the labels
            # of the batch; such a record contributes nothing instead.
            labels = tf.cast(y_true, tf.int64)
            valid = tf.logical_and(labels >= 0, labels < y_pred.shape[-1])
            y_true = tf.where(valid, y_true, tf.zeros_like(y_true))
            invalid = tf.logical_not(tf.reduce_all(tf.reshape(
                valid, [tf.shape(valid)[0], -1]), axis=1))
        values = tf.convert_to_tensor(fn(y_true, y_pred))
        values = tf.cast(values, tf.float32)
        if invalid is not None:
            # The constant branch has zero gradient: no contribution.
            values = tf.where(
                tf.reshape(invalid, [-1] + [1] * (values.shape.rank - 1)),
                tf.fill(tf.shape(values), float('nan')), values)
        if values.shape.rank is not None and values.shape.rank > 1:
            values = tf.reduce_mean(
                values, axis=list(range(1, values.shape.rank)))
        return values

    return per_example


def _are_class_indices(y_true: tf.Tensor, y_pred: tf.Tensor) -> bool:
    """Whether ``y_true`` holds class indices into ``y_pred``'s last axis:
    integer labels one rank below predictions over C > 1 classes (or with a
    trailing axis of 1), whatever the loss that reads them."""
    classes = y_pred.shape[-1] if y_pred.shape.rank else None
    if y_true.dtype.is_floating or classes is None or classes < 2:
        return False
    rank, pred_rank = y_true.shape.rank, y_pred.shape.rank
    return rank == pred_rank - 1 or (rank == pred_rank
                                     and y_true.shape[-1] == 1)


def _example_weights(sample_weight, size: tf.Tensor) -> tf.Tensor:
    """Per-example weights [B] (ones when there are none)."""
    if sample_weight is None:
        return tf.ones([size], tf.float32)
    sample_weight = tf.convert_to_tensor(sample_weight)
    shape = sample_weight.shape
    if shape.rank is not None and not (
            shape.rank == 1 or (shape.rank == 2 and shape[1] == 1)):
        raise ValueError(
            'sample_weight must hold one weight per example (shape [B] or '
            f'[B, 1]), got shape {shape}.')
    return tf.reshape(tf.cast(sample_weight, tf.float32), [-1])


def _ledgers(callbacks: Any) -> List[ledger_lib.PrivacyLedger]:
    """The `PrivacyLedger`s among `fit`'s callbacks (list or CallbackList)."""
    if callbacks is None:
        return []
    if isinstance(callbacks, tf.keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    return [c for c in tf.nest.flatten(callbacks)
            if isinstance(c, ledger_lib.PrivacyLedger)]


def _check_no_nonprivate_monitor(callbacks: Any) -> None:
    """Refuses callbacks that act on the noise-free training logs.

    ``EarlyStopping``, ``ReduceLROnPlateau``, ``ModelCheckpoint(
    save_best_only=True)`` and any callback with a ``monitor`` act on the
    value they monitor: on a ``nonprivate_*`` log (the loss and metrics of
    the private batch without noise) the number of steps, the learning
    rate or the checkpoint released would be a noise-free function of the
    private data, which no accountant covers.
    """
    if callbacks is None:
        return
    if isinstance(callbacks, tf.keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    for callback in tf.nest.flatten(callbacks):
        monitor = getattr(callback, 'monitor', None)
        if not (isinstance(monitor, str)
                and monitor.startswith(NONPRIVATE_PREFIX)):
            continue
        if isinstance(callback, tf.keras.callbacks.ModelCheckpoint) and (
                not getattr(callback, 'save_best_only', False)):
            continue  # Saves every time: the monitored value is not used.
        raise ValueError(
            f'{type(callback).__name__} monitors {monitor!r}, a loss or '
            'metric of the private batch without noise: its decisions (when '
            'to stop, the learning rate, which checkpoint to keep) would '
            'release private information that the PrivacyLedger does not '
            'account. Monitor \'epsilon\' or a metric of PUBLIC validation '
            'data (validation_data=...), or remove the callback.')


def _pad_rows(t: tf.Tensor, padded_size: tf.Tensor) -> tf.Tensor:
    rank = t.shape.rank
    if rank is None or rank == 0:
        raise ValueError(
            'every input, target and weight tensor needs a known rank >= 1 '
            f'(a leading batch dimension), got shape {t.shape}.')
    extra = padded_size - tf.shape(t)[0]
    return tf.pad(t, [[0, extra]] + [[0, 0]] * (rank - 1))


def _chunked(t: tf.Tensor, chunk: int) -> tf.Tensor:
    """[num_chunks * chunk, ...] -> [num_chunks, chunk, ...], static inner."""
    out = tf.reshape(t, tf.concat([[-1, chunk], tf.shape(t)[1:]], axis=0))
    out.set_shape([None, chunk] + t.shape[1:].as_list())
    return out


def _check_sharding(strategy: tf.distribute.Strategy, x: Any) -> None:
    """Refuses input that every worker of a multi-worker strategy reads whole.

    Each logical batch must be split over all replicas of all workers, so
    that every example is clipped and summed once. With auto-sharding OFF
    each worker processes every row itself and each example is counted once
    per worker: W times the sensitivity the accountant assumes.
    """
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return
    if isinstance(x, tf.data.Dataset) and (
            x.options().experimental_distribute.auto_shard_policy
            == tf.data.experimental.AutoShardPolicy.OFF):
        raise ValueError(
            'x has auto_shard_policy OFF under MultiWorkerMirroredStrategy: '
            'every worker would process every example of a logical batch, '
            'counting each example once per worker. Keep the default policy '
            '(AUTO, which splits each logical batch over all replicas), and '
            'give every worker the same dataset (poisson_batches with the '
            'same seed).')
    info = sampling.get_poisson_sampling_info(x)
    if info is not None and not _same_on_every_replica(
            strategy, (info.seed, info.start_step)):
        # Each worker would take its share of a DIFFERENT logical batch: the
        # union is no Poisson sample and an example may be summed twice.
        raise ValueError(
            'The workers\' poisson_batches have different seeds (or '
            'start_step): each worker would take its slice of a different '
            'logical batch, so an example could be summed more than once in '
            'a step. Build the dataset on every worker with the same SECRET '
            'seed (e.g. drawn once with secrets.randbits(63) and sent to the '
            'workers over a private channel).')


def _same_on_every_replica(strategy: tf.distribute.Strategy,
                           values: Sequence[int]) -> bool:
    """Whether the integers ``values`` are equal on every replica."""
    # 16-bit words are exact in float32.
    words = tf.constant([[(int(v) >> shift) & 0xFFFF for v in values
                          for shift in (0, 16, 32, 48)]], tf.float32)

    @tf.function
    def gather():
        return strategy.run(lambda: tf.distribute.get_replica_context()
                            .all_gather(words, axis=0))

    gathered = strategy.experimental_local_results(gather())[0].numpy()
    return bool((gathered == gathered[:1]).all())


# The per-example gradients of one physical batch, [P, d] floats, should stay
# in the last-level cache: DP throughput of the reference CNN (d = 79,530)
# fell 38 % from P = 64 (20 MB) to P = 256 (81 MB), non-private did not.
_CACHE_BYTES = 32 * 2**20
_PHYSICAL_RANGE = (8, 256)


def default_physical_batch_size(
        model: tf.keras.Model,
        config: Optional[config_lib.TwiceSamplingConfig] = None) -> int:
    """The physical batch size DPModel uses when none is given.

    The largest power of two P in [8, 256] whose [P, d] float32 per-example
    gradients fit in 32 MiB (d: the model's trainable parameters; 64 for a
    model not built yet), and no larger than the expected logical batch
    rounded up to a power of two (larger chunks would be mostly padding).
    Speed and memory only: it never changes the released values' law.
    """
    low, high = _PHYSICAL_RANGE
    size = 64
    if model.built:
        d = max(1, sum(math.prod(v.shape) for v in model.trainable_variables))
        size = 2**max(0, math.floor(math.log2(max(1, _CACHE_BYTES // (4 * d)))))
    if config is not None:
        size = min(size, 2**math.ceil(math.log2(config.expected_batch_size)))
    return int(min(high, max(low, size)))


def _check_poisson_input(x: Any, config: config_lib.TwiceSamplingConfig, *,
                         strict: bool) -> None:
    """Refuses input that is not Poisson sampling of the config's n at its
    q1 (warns instead when not ``strict``)."""
    info = guards.check_poisson_input(
        x, example_sampling_rate=config.example_sampling_rate, strict=strict)
    if info is not None and info.num_examples != config.num_examples:
        raise ValueError(
            f'The dataset samples from {info.num_examples} examples but the '
            f'config has num_examples={config.num_examples}: the accounted q1 '
            'and n would not be those of the training.')


def _is_dp_optimizer(optimizer: Any) -> bool:
    return isinstance(getattr(optimizer, 'aggregator', None),
                      aggregator_lib.PrivateAggregator)


@tf.keras.utils.register_keras_serializable(package='tf_twice')
class DPModel(tf.keras.Model):
    """Wraps a Keras model so that ``fit`` runs twice-sampling DP-SGD.

    Either give the mechanism here (a ``TwiceSamplingConfig``) and compile
    with a plain Keras optimizer (e.g. ``tf.keras.optimizers.SGD``), or give
    no config and compile with a tf_twice DP optimizer, which then carries
    it. The loss must be computable per example. ``predict``/``evaluate`` act
    on the wrapped model.

    Guarantee: fed Poisson-sampled logical batches of the config's n
    examples (one per step, ``tf_twice.sampling.poisson_batches``), each step
    is the ``dp_event()`` mechanism; T steps are (epsilon, delta)-DP with the
    epsilon of T compositions of that event (what ``PrivacyLedger`` reports).
    With ``basis=`` (hybrid clipping) that event has one block per basis
    block; the basis must depend on public data and the current model only.
    """

    def __init__(
        self,
        model: tf.keras.Model,
        config: Optional[config_lib.TwiceSamplingConfig] = None,
        *,
        physical_batch_size: Optional[int] = None,
        seed: Optional[int] = None,
        basis: Optional[basis_lib.HybridBasis] = None,
        **kwargs,
    ) -> None:
        """Initialises the wrapper.

        Args:
          model: the Keras model to train; no layer may mix examples.
          config: the mechanism (``tf_twice.TwiceSamplingConfig``),
            calibrated; with a basis, one Block per basis block (principal
            blocks, then the residual). None: the mechanism comes from the
            tf_twice DP optimizer given to ``compile``.
          physical_batch_size: examples per vectorized chunk (an int >= 1);
            logical batches are padded to a multiple of it. Speed and memory
            only, never privacy. None: ``default_physical_batch_size``.
          seed: of the step keys (masks and noise), for experiments; None
            (default) uses OS entropy. Never saved with the model.
          basis: None (one block), or a ``HybridBasis`` over the model's
            trainable variables learned from PUBLIC data only.
          **kwargs: passed to ``tf.keras.Model`` (e.g. ``name``).

        Raises:
          ValueError: an argument outside its range, or a config whose
            blocks do not fit the basis.
        """
        kwargs.setdefault('name', f'dp_{model.name}')
        super().__init__(**kwargs)
        if not isinstance(model, tf.keras.Model):
            raise ValueError(
                f'model must be a tf.keras.Model, got {type(model).__name__}.')
        guards.check_no_example_mixing(model)
        if config is not None and not isinstance(
                config, config_lib.TwiceSamplingConfig):
            raise ValueError('config must be a tf_twice.TwiceSamplingConfig '
                             f'or None; got {type(config).__name__}.')
        if physical_batch_size is None:
            physical_batch_size = default_physical_batch_size(model, config)
        self.physical_batch_size = _validate.integer(
            'physical_batch_size', physical_batch_size, 1)
        self.inner_model = model
        # The wrapper has no weights of its own: it is built when the
        # wrapped model is (so that saving and loading see its weights).
        self.built = model.built
        # A plain attribute of a non-trackable object: Keras puts neither the
        # step keys nor the basis into weights, checkpoints or configs.
        self._own_aggregator = None
        if config is not None:
            if basis is not None and model.built:
                hybrid.check_basis_matches_variables(
                    basis, model.trainable_variables)
            self._own_aggregator = aggregator_lib.PrivateAggregator(
                config, basis, seed)
        elif basis is not None or seed is not None:
            raise ValueError(
                'basis and seed need a config; with a tf_twice DP optimizer '
                'give them to the optimizer.')
        # Not attributes Keras tracks: the tracker's state must not show up
        # in ``weights`` or the saved weights of the wrapped model.
        object.__setattr__(self, '_example_loss_tracker',
                           tf.keras.metrics.Mean(name='loss'))
        # The wrapped model's state words now: a seeded stream follows its
        # seed only from this state (weights loaded later, before or after
        # compile, start another stream). None for a model built later.
        object.__setattr__(self, '_initial_state_words', (
            aggregator_lib.state_fingerprint(
                model.trainable_variables, tf.constant(0, tf.int64))
            if model.built else None))
        # Step-key streams of DP optimizers replaced by a recompile: the
        # ledger still charges the steps they drew.
        object.__setattr__(self, '_retired_keys', [])
        self._example_loss = None

    @property
    def aggregator(self) -> Optional[aggregator_lib.PrivateAggregator]:
        """The ``PrivateAggregator`` that runs the steps: the model's own, or
        that of the tf_twice DP optimizer it is compiled with."""
        if self._own_aggregator is not None:
            return self._own_aggregator
        optimizer = getattr(self, 'optimizer', None)
        return optimizer.aggregator if _is_dp_optimizer(optimizer) else None

    def _require_aggregator(self) -> aggregator_lib.PrivateAggregator:
        aggregator = self.aggregator
        if aggregator is None:
            raise ValueError(
                'This DPModel has no DP mechanism yet: give it a '
                'TwiceSamplingConfig, DPModel(model, config), or (Keras 2 '
                'with tensorflow-privacy) compile it with a tf_twice DP '
                'optimizer.')
        return aggregator

    @property
    def config(self) -> Optional[config_lib.TwiceSamplingConfig]:
        """The mechanism the steps run (None until a model without its own
        config is compiled with a tf_twice DP optimizer)."""
        aggregator = self.aggregator
        return None if aggregator is None else aggregator.config

    @property
    def basis(self) -> Optional[basis_lib.HybridBasis]:
        """The hybrid-clipping basis the next step uses (None: one block)."""
        aggregator = self.aggregator
        return None if aggregator is None else aggregator.basis

    def set_basis(self, basis: basis_lib.HybridBasis) -> None:
        """Uses ``basis`` from the next step on, without retracing
        (``PrivateAggregator.set_basis``)."""
        self._require_aggregator().set_basis(basis)

    @property
    def key_streams(self) -> List[aggregator_lib.StepKeys]:
        """Every step-key stream this model's steps have drawn from: those
        of DP optimizers replaced by a recompile, then the current one."""
        aggregator = self.aggregator
        current = [] if aggregator is None else [aggregator.keys]
        return list(self._retired_keys) + current

    def save_random_state(self, path: str) -> None:
        """Writes the SECRET state of the step keys to ``path``.

        Only for bit-reproducible seeded experiments that must resume
        exactly: anyone holding the file can recompute the noise of every
        later step and subtract it from released weights. Keep it apart
        from checkpoints and models, as secret as the training data.
        The file records the optimizer's step count, so that it only
        loads into a model at that step.
        """
        state = self._require_aggregator().keys.get_state()
        optimizer = getattr(self, 'optimizer', None)
        if optimizer is not None:
            state['step'] = int(optimizer.iterations.numpy())
        files.atomic_write_json(os.fspath(path), state)

    def load_random_state(self, path: str) -> None:
        """Continues the step keys from a ``save_random_state`` file.

        Raises:
          ValueError: the file was saved at another step count than the
            model's (e.g. an older file beside a newer checkpoint): the
            next steps would reuse the keys, i.e. the noise, of steps whose
            updates are already in the checkpoint.
        """
        keys = self._require_aggregator().keys
        with open(os.fspath(path)) as f:
            state = json.load(f)
        optimizer = getattr(self, 'optimizer', None)
        step = state.get('step') if isinstance(state, dict) else None
        if step is not None and optimizer is not None and int(step) != int(
                optimizer.iterations.numpy()):
            raise ValueError(
                f'The random state in {os.fspath(path)!r} was saved at step '
                f'{step}, but this model is at step '
                f'{int(optimizer.iterations.numpy())}: its next steps would '
                'reuse the noise of steps already in the weights. Load the '
                'checkpoint saved with that state (load_weights first, then '
                'load_random_state), or leave the state unloaded (fresh OS '
                'entropy).')
        keys.set_state(state)

    def dp_event(self) -> TwiceSampledGaussianDpEvent:
        """The DpEvent of one ``train_step`` on Poisson batches: derived
        from the config (``TwiceSamplingConfig.dp_event``), per block with
        ``block_dimensions = basis.block_dimensions`` for hybrid clipping.

        Raises:
          ValueError: no mechanism yet, or a non_private config.
        """
        return self._require_aggregator().dp_event()

    def call(self, inputs, training=None, mask=None):
        return self.inner_model(inputs, training=training)

    def compile(self, optimizer='rmsprop', loss=None, metrics=None,
                **kwargs):
        if _is_dp_optimizer(optimizer):
            if self._own_aggregator is not None:
                raise ValueError(
                    'This DPModel already has its DP mechanism (its config); '
                    'compile it with a plain Keras optimizer, not the DP '
                    f'optimizer {type(optimizer).__name__}, or build it '
                    'without a config.')
            if getattr(optimizer, '_num_microbatches', None) is not None:
                raise ValueError(
                    f'{type(optimizer).__name__} uses num_microbatches='
                    f'{optimizer._num_microbatches}: microbatched clipping '  # pylint: disable=protected-access
                    'is not covered by the twice-sampling analysis; use '
                    'num_microbatches=None (physical_batch_size splits '
                    'large batches without changing the records).')
        elif getattr(optimizer, '_was_dp_gradients_called',
                     None) is not None:
            raise ValueError(
                f'{type(optimizer).__name__} is a DP optimizer whose '
                'mechanism DPModel cannot run; compile with a plain Keras '
                'optimizer or a tf_twice DP optimizer.')
        elif self._own_aggregator is None:
            raise ValueError(
                'This DPModel has no DP mechanism: give it a '
                'TwiceSamplingConfig, DPModel(model, config), or (Keras 2 '
                'with tensorflow-privacy) compile it with a tf_twice DP '
                'optimizer.')
        self._example_loss = _per_example_loss_fn(loss)
        previous = self.aggregator
        # Keras 3's 'auto' would turn XLA on where there is a GPU.
        kwargs.setdefault('jit_compile', False)
        super().compile(optimizer=optimizer, loss=loss, metrics=metrics,
                        **kwargs)
        if previous is not None and previous is not self.aggregator:
            self._retired_keys.append(previous.keys)
        # A legacy optimizer creates its step counter on first use; the
        # traced step reads it (a seeded stream's position), so it must
        # exist before, in the strategy's scope.
        _ = self.optimizer.iterations
        if self._initial_state_words is not None:
            self.aggregator.keys.record_start(self._initial_state_words)
        basis = self.basis
        if basis is not None and self.inner_model.built:
            hybrid.check_basis_matches_variables(
                basis, self.inner_model.trainable_variables)
        self._build_optimizer()

    def _build_optimizer(self) -> None:
        """Creates the optimizer's variables (step count, slots) for the
        wrapped model's weights, so that weights loaded before the first
        step (``load_weights``, ``.keras``, ``BackupAndRestore``) restore
        the optimizer's state too: Keras skips the state of an optimizer
        that has no variables yet."""
        if not self.inner_model.built:
            return
        variables = self.inner_model.trainable_variables
        if _keras.is_legacy_optimizer(self.optimizer):
            self.optimizer._create_all_weights(variables)  # pylint: disable=protected-access
        else:
            self.optimizer.build(variables)

    def get_compile_config(self) -> Optional[Dict[str, Any]]:
        """The arguments of ``compile`` (Keras's record of them), so that a
        ``.keras`` file reloads compiled."""
        return super().get_compile_config()

    def compile_from_config(self, config: Dict[str, Any]) -> None:
        """Compiles from ``get_compile_config()`` when a ``.keras`` file is
        loaded (``compile`` creates the optimizer's variables, so that its
        saved state is restored with the weights)."""
        self.compile(**tf.keras.utils.deserialize_keras_object(config))

    def _legacy_optimizer_weights(self) -> Optional[List[tf.Variable]]:
        # Keras's .keras format saves only non-legacy optimizers; the state of
        # a legacy one (the tf_twice DP optimizers, Keras 2) is saved here.
        optimizer = getattr(self, 'optimizer', None)
        if _keras.is_legacy_optimizer(optimizer):
            return list(optimizer.weights)
        return None

    def save_own_variables(self, store) -> None:
        super().save_own_variables(store)
        weights = self._legacy_optimizer_weights()
        for i, variable in enumerate(weights or []):
            store[f'{_LEGACY_OPTIMIZER_KEY}{i}'] = variable.numpy()

    def load_own_variables(self, store) -> None:
        saved = sorted((k for k in store.keys()
                        if k.startswith(_LEGACY_OPTIMIZER_KEY)),
                       key=lambda k: int(k[len(_LEGACY_OPTIMIZER_KEY):]))
        own = {k: store[k] for k in store.keys()
               if not k.startswith(_LEGACY_OPTIMIZER_KEY)}
        super().load_own_variables(own)
        if saved and getattr(self, 'optimizer', None) is None:
            _LOGGER.warning('DPModel: not compiled yet, so the file\'s '
                            'optimizer state was not loaded.')
            return
        weights = self._legacy_optimizer_weights() or []
        if saved and not weights and self._legacy_optimizer_weights() \
                is not None and self.inner_model.built:
            # Not trained yet in this process: create the state to restore.
            self.optimizer._create_all_weights(  # pylint: disable=protected-access
                self.inner_model.trainable_variables)
            weights = self._legacy_optimizer_weights()
        if len(saved) != len(weights):
            raise ValueError(
                f'The file holds {len(saved)} optimizer variables, the '
                f'reloaded optimizer has {len(weights)}: it cannot resume '
                'the saved optimizer state. Load the weights into a model '
                'compiled as the saved one was.')
        for key, variable in zip(saved, weights):
            variable.assign(store[key])

    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose='auto',
            callbacks=None, *args, allow_non_poisson_input: bool = False,
            **kwargs):
        """``tf.keras.Model.fit``, checked against its privacy ledgers.

        Each element of ``x`` is one logical batch, i.e. one DP step. When a
        ``PrivacyLedger`` is among ``callbacks``, before any step runs:

        * ``x`` must be Poisson-sampled logical batches
          (``tf_twice.sampling.poisson_batches``) of the config's n examples
          at its rate q1: the accountant's epsilon is not a bound for arrays
          batched by ``fit`` or ``shuffle().batch()`` pipelines, so they are
          refused (ValueError);
        * the ledger's event must be this model's ``dp_event()``;
        * no callback may act on a ``nonprivate_*`` log (e.g.
          ``EarlyStopping(monitor='nonprivate_loss')``): those are the
          private batch's loss and metrics without noise.

        Without a ledger, ``fit`` trains as ``tf.keras.Model.fit`` does and
        NOTHING IS ACCOUNTED: no epsilon holds unless the caller accounts
        the steps (and their sampling) by other means.

        Args:
          x, y, batch_size, epochs, verbose, callbacks, *args, **kwargs: as
            in ``tf.keras.Model.fit``.
          allow_non_poisson_input: True downgrades the refusal of
            non-Poisson input to a ``NonPoissonInputWarning``, for
            experiments that claim no epsilon: the ledger's epsilon then
            DOES NOT HOLD for the run. Other events and other n are always
            refused.

        Raises:
          ValueError: see above, or a check of ``tf.keras.Model.fit``.
        """
        if not isinstance(allow_non_poisson_input, bool):
            raise ValueError('allow_non_poisson_input must be True or False; '
                             f'got {allow_non_poisson_input!r}.')
        self._require_aggregator()
        _check_sharding(self.distribute_strategy, x)
        for ledger in _ledgers(callbacks):
            guards.check_ledger_event(ledger.event, self)
            _check_poisson_input(x, self.config,
                                 strict=not allow_non_poisson_input)
            _check_no_nonprivate_monitor(callbacks)
        is_dataset = isinstance(x, tf.data.Dataset)
        if is_dataset and len(args) < 3:
            # Each element is one logical batch: there is nothing to
            # shuffle (Keras 3 warns about its default shuffle=True).
            kwargs.setdefault('shuffle', False)
        object.__setattr__(self, '_fit_element_spec',
                           x.element_spec if is_dataset else None)
        try:
            return super().fit(x, y, batch_size, epochs, verbose, callbacks,
                               *args, **kwargs)
        finally:
            object.__setattr__(self, '_fit_element_spec', None)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        """Keras 3's build of metrics, loss and optimizer before training
        under a distribution strategy, from the dataset's element spec.

        Keras pulls the first batch and reduces it over the replicas only
        to learn its shapes: that fails for a logical batch split into
        shares of unequal size, and under MultiWorkerMirroredStrategy. The
        spec gives the same shapes without reading data. (Keras 2 never
        calls this.)
        """
        spec = getattr(self, '_fit_element_spec', None)
        if iterator is not None and data_batch is None and spec is not None:
            iterator, data_batch = None, spec
        return super()._maybe_symbolic_build(iterator=iterator,
                                             data_batch=data_batch)

    def train_on_batch(self, *args, **kwargs):
        """Refused: no ledger sees these steps and no check sees their input.

        Train with ``fit`` on ``tf_twice.sampling.poisson_batches`` and a
        ``PrivacyLedger``; a custom loop calls ``train_step`` and charges
        each step with ``PrivacyLedger.record_steps``.
        """
        raise ValueError(
            'DPModel.train_on_batch is refused: its steps would be neither '
            'accounted by a PrivacyLedger nor checked for Poisson input. Use '
            'fit(poisson_batches(...), callbacks=[ledger]), or call '
            'train_step in a custom loop and charge each step with '
            'ledger.record_steps().')

    @property
    def metrics(self):
        # The per-example loss's tracker replaces Keras's (which would
        # average a batch loss that this model never computes).
        return [self._example_loss_tracker] + _keras.compiled_metrics(self)

    def _example_losses(self, y, y_pred) -> tf.Tensor:
        losses = self._example_loss(y, y_pred)
        regularization = self.inner_model.losses
        if regularization:
            losses += tf.cast(tf.add_n(regularization), losses.dtype)
        return losses

    def _ensure_built(self, x) -> None:
        # Variables cannot be created inside tf.vectorized_map, so an unbuilt
        # model is built here on one all-zero example.
        if self.inner_model.built:
            return
        for t in tf.nest.flatten(x):
            if not t.shape[1:].is_fully_defined():
                raise ValueError(
                    'Build the wrapped model before training (call it once '
                    'or give it an input shape); its input shape '
                    f'{t.shape} is not fully known.')
        self.inner_model(
            tf.nest.map_structure(
                lambda t: tf.zeros([1] + t.shape[1:].as_list(), t.dtype), x),
            training=False)
        self.built = True

    def _per_example_gradients(self, x, y):
        """Per-example gradients [P, *shape], losses [P], predictions.

        Each example runs its own forward and backward pass (vectorized), so
        its gradient depends on it alone: a NaN, inf or overflowing example
        cannot reach another example's row, as it would through the
        backward pass of one batched forward pass (0 * NaN = NaN).
        """
        variables = self.inner_model.trainable_variables

        def one_example(args):
            xi, yi = args
            xi = tf.nest.map_structure(lambda t: tf.expand_dims(t, 0), xi)
            yi = tf.expand_dims(yi, 0)
            with tf.GradientTape() as tape:
                prediction = self.inner_model(xi, training=True)
                loss = self._example_losses(yi, prediction)[0]
            grads = tape.gradient(
                loss, variables,
                unconnected_gradients=tf.UnconnectedGradients.ZERO)
            grads = [tf.convert_to_tensor(g) for g in grads]
            prediction = tf.nest.map_structure(lambda t: t[0], prediction)
            return grads, loss, prediction

        return tf.vectorized_map(one_example, (x, y))

    def _update_metrics(self, y, predictions, losses, weights,
                        weighted: bool) -> None:
        """Updates loss and compiled metrics on the rows of weight > 0.

        Keras applies sample weights only to ``weighted_metrics``, so zero-
        weight (padding) rows are removed rather than down-weighted. The loss
        is the weighted mean of the per-example losses.
        """
        real = weights > 0
        self._example_loss_tracker.update_state(
            tf.boolean_mask(losses, real),
            sample_weight=tf.boolean_mask(weights, real))
        y_real = tf.boolean_mask(y, real)
        predictions = tf.nest.map_structure(
            lambda t: tf.boolean_mask(t, real), predictions)
        _keras.update_compiled_metrics(
            self, y_real, predictions,
            tf.boolean_mask(weights, real) if weighted else None)

    def _apply_update(self, update, variables) -> None:
        apply = getattr(self.optimizer, 'apply_private_update', None)
        if apply is not None:  # A tf_twice DP optimizer.
            apply(update, variables)
        else:
            self.optimizer.apply_gradients(zip(update, variables))

    def train_step(self, data):
        if self._example_loss is None:
            raise ValueError('DPModel must be compiled before training.')
        aggregator = self._require_aggregator()
        x, y, sample_weight = tf.keras.utils.unpack_x_y_sample_weight(data)
        if y is None:
            raise ValueError('DPModel.train_step needs targets y.')
        y = tf.convert_to_tensor(y)
        x = tf.nest.map_structure(tf.convert_to_tensor, x)
        self._ensure_built(x)
        size = tf.shape(tf.nest.flatten(x)[0])[0]
        weights = _example_weights(sample_weight, size)
        chunk = self.physical_batch_size
        num_chunks = (size + chunk - 1) // chunk
        padded = num_chunks * chunk

        def to_chunks(t):
            return _chunked(_pad_rows(t, padded), chunk)

        x_chunks = tf.nest.map_structure(to_chunks, x)
        y_chunks = to_chunks(y)
        w_chunks = to_chunks(weights)

        variables = self.inner_model.trainable_variables
        key = aggregator.begin(variables, self.optimizer.iterations)
        # Masks are keyed by an example's position in the whole logical
        # batch, also when replicas share it.
        first_row = aggregator_lib.global_offset(size)

        def body(i, sums):
            xc = tf.nest.map_structure(lambda t: t[i], x_chunks)
            yc, wc = y_chunks[i], w_chunks[i]
            grads, losses, predictions = self._per_example_gradients(xc, yc)
            sums = aggregator.accumulate(
                sums, grads, variables, weights=wc, key=key,
                example_offset=first_row + i * chunk)
            self._update_metrics(yc, predictions, losses, wc,
                                 sample_weight is not None)
            return i + 1, sums

        _, sums = tf.while_loop(
            lambda i, _: i < num_chunks, body,
            (tf.constant(0), aggregator.zero_sums(variables)),
            parallel_iterations=1)
        update = aggregator.finish(sums, key, variables)
        self._apply_update(update, variables)
        # Computed on the private batch without noise: not private.
        return {f'{NONPRIVATE_PREFIX}{name}': value
                for name, value in self.get_metrics_result().items()}

    def test_step(self, data):
        if self._example_loss is None:
            raise ValueError('DPModel must be compiled before evaluation.')
        x, y, sample_weight = tf.keras.utils.unpack_x_y_sample_weight(data)
        y = tf.convert_to_tensor(y)
        y_pred = self.inner_model(x, training=False)
        losses = self._example_losses(y, y_pred)
        weights = _example_weights(sample_weight, tf.shape(losses)[0])
        self._update_metrics(y, y_pred, losses, weights,
                             sample_weight is not None)
        return self.get_metrics_result()

    def get_config(self) -> Dict[str, Any]:
        """The wrapped model and the mechanism's public parameters.

        Holds no seed and no random state (see the module docstring). A
        model compiled with a DP optimizer keeps its mechanism in the
        optimizer's config.
        """
        config = {
            'model': tf.keras.utils.serialize_keras_object(self.inner_model),
            'physical_batch_size': self.physical_batch_size,
            'name': self.name,
        }
        if self._own_aggregator is not None:
            config['config'] = self._own_aggregator.config.to_dict()
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Rebuilds a DPModel from ``get_config()``.

        The basis is not in the config (it can be GBs): for hybrid
        clipping pass it in as ``config['basis']``, e.g.
        ``DPModel.from_config({**config, 'basis': HybridBasis.load(path)})``.
        """
        config = dict(config)
        model = tf.keras.utils.deserialize_keras_object(
            config.pop('model'), custom_objects=custom_objects)
        if config.get('config') is not None:
            config['config'] = config_lib.TwiceSamplingConfig.from_dict(
                config['config'])
        return cls(model, **config)
