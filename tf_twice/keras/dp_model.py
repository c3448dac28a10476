"""The fast per-example training path: a Keras model with a DP train_step.

An optimizer only sees the batch loss, so tf_privacy's optimizers get
per-example gradients from ``tape.jacobian`` (O(B^2), and not isolated).
``DPModel.train_step`` takes them from ``tf_twice.keras.per_example``, one
forward and backward pass per example under ``tf.vectorized_map`` (O(B)),
and feeds them to its ``PrivateAggregator`` (``tf_twice.mechanism``). Each
dataset element is ONE logical batch ``(x, y)`` or ``(x, y, sample_weight)``;
``dp_step.private_update`` turns it into the noisy update (its docstring
states the input contract), which the compiled optimizer applies.

Privacy: the mechanism is the model's ``TwiceSamplingConfig``. With Poisson
sampling of its n examples at rate q1 (``expected_batch_size`` = n * q1)
each ``train_step`` is one (q1, q2)-twice-sampled Gaussian mechanism, exactly
``config.dp_event()`` (the paper's "Privacy Amplification from Twice
Sampling" theorem); the optimizer update is post-processing. The loss and
metrics of ``fit`` are computed on the private batch without noise and carry
the prefix ``nonprivate_`` so that nobody mistakes them for released values.
What ``fit`` refuses before any step is in ``fit_checks``.

docs/ documents the rest once: the optimizer path (a DPModel without a
config, compiled with a tf_twice DP optimizer: keras.md), hybrid clipping
(``basis=``, ``set_basis``: hybrid_clipping.md), the step keys that no
model artifact holds and the seeded runs (checkpoints.md), and the update
that is the same for any number of replicas (distributed.md). The basis is
NOT part of checkpoints: a resumed run relearns or reloads it (a hybrid
DPModel rebuilt from an artifact refuses to train until ``set_basis``).
``compile`` refuses ``jit_compile=True``: XLA drops the run-time check of
per-example weights and cannot compile the seeded step keys' hashing (the
clip-mask-sum kernels use XLA on their own).
"""

import contextlib
import hashlib
import importlib
import logging
from typing import Any, Dict, List, Optional

import numpy as np
import tensorflow as tf
# Keeps every gradient tape off the wrapped model's forward pass in `call`,
# including what it leaves beside its outputs (tf.stop_gradient sees only
# the tensors it is given).
from tensorflow.python.eager import record

from tf_twice import _keras
from tf_twice import _validate
from tf_twice import config as config_lib
from tf_twice.accounting import TwiceSampledGaussianDpEvent
from tf_twice.keras import class_weights
from tf_twice.keras import dp_step
from tf_twice.keras import fit_checks
from tf_twice.keras import guards
from tf_twice.keras import ledger as ledger_lib
from tf_twice.keras import ledger_binding
from tf_twice.keras import per_example
from tf_twice.keras.per_example import default_physical_batch_size
from tf_twice.mechanism import aggregator as aggregator_lib
from tf_twice.mechanism import basis as basis_lib
from tf_twice.mechanism import hybrid
from tf_twice.mechanism import step_keys

__all__ = ['DPModel', 'default_physical_batch_size']

_LOGGER = logging.getLogger(__name__)
# Training logs computed on private batches without noise carry this prefix.
NONPRIVATE_PREFIX = 'nonprivate_'


@tf.keras.utils.register_keras_serializable(package='tf_twice',
                                            name='LossMean')
class Mean(tf.keras.metrics.Mean):
    """Keras 2's mean, whose saved state loads as numpy values: Keras 2
    assigns a weights file's h5 datasets as they are, which a metric's
    variables under a tf.distribute strategy (summed over replicas on read,
    so divided on assignment) cannot take. Named ``Mean`` because Keras 2
    files name a metric's entry after its class (``metrics/mean``): files
    written with Keras's own mean load into it, and its files into them.
    Registered: a SavedModel names the class, and loading looks it up."""

    def load_own_variables(self, store) -> None:
        super().load_own_variables(
            {key: np.asarray(store[key]) for key in store.keys()})


def _loss_mean() -> tf.keras.metrics.Mean:
    """The mean per-example loss of ``fit``'s logs (Keras 3 saves no
    metric state)."""
    if _keras.IS_KERAS_3:
        return tf.keras.metrics.Mean(name='loss')
    return Mean(name='loss')


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
            a logical batch's last chunk holds what is left. Speed and memory
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
        if not tf.compat.v1.executing_eagerly_outside_functions():
            # TF1 graph mode: Keras trains an outer model there with
            # tf.gradients over the layers' symbolic losses, which `call`
            # does not stop; the DP step itself never ran there.
            raise ValueError(
                'DPModel needs TensorFlow 2 behaviour, and '
                'tf.compat.v1.disable_eager_execution() (or '
                'disable_v2_behavior()) has switched it off in this process.')
        kwargs.setdefault('name', f'dp_{model.name}')
        super().__init__(**kwargs)
        if not isinstance(model, tf.keras.Model):
            raise ValueError(
                f'model must be a tf.keras.Model, got {type(model).__name__}.')
        if isinstance(model, DPModel):
            # Its call passes no gradient: the outer steps would be noise.
            raise ValueError(
                'model must not be a DPModel: wrap its inner_model instead.')
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
        # Its own weights, saved and restored with the others: the DP steps
        # the weights hold and the ledger history that accounts them.
        self.steps_taken, self.ledger_binding = (
            ledger_binding.add_variables(self))
        # Built when the wrapped model is (so that saving and loading see
        # its weights).
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
        object.__setattr__(self, '_example_loss_tracker', _loss_mean())
        # The wrapped model's state words now: a seeded stream follows its
        # seed only from this state (weights loaded later, before or after
        # compile, start another stream). None for a model built later.
        object.__setattr__(self, '_initial_state_words', (
            step_keys.state_fingerprint(
                model.trainable_variables, tf.constant(0, tf.int64))
            if model.built else None))
        # Every step-key stream a step of this model was traced or run
        # with (`key_streams`): the ledger charges the steps they drew,
        # also those of an optimizer replaced since, however it was.
        object.__setattr__(self, '_stepped_streams', [])
        # `attach_ledger`'s: not saved, not tracked (a Keras callback).
        object.__setattr__(self, '_attached_ledger', None)
        self._example_loss = None

    if not _keras.IS_KERAS_3:

        @property
        def _trackable_saved_model_saver(self):
            # Keras 2's SavedModel loader revives a model that it cannot
            # rebuild from its config (tf_twice not imported, a wrapped
            # class Keras does not know) as a generic model whose fit
            # trains without DP: make that load fail instead.
            return _keras.restored_from_config_only(
                super()._trackable_saved_model_saver)

        # Keras 2 writes the state of every metric into .weights.h5, .keras
        # and SavedModel files (Keras 3 into none): computed on private
        # batches without noise (e.g. the exact sum of the sampled
        # examples' losses), it must not be in a released artifact. Saving
        # clears it however it is called (Keras cannot be kept from
        # writing its entries): here for SavedModels, in save_own_variables
        # for the other two. save and save_weights (and so ModelCheckpoint)
        # then put the running values of fit's logs back.

        def _trackable_children(self, save_type='checkpoint', **kwargs):
            if save_type == 'savedmodel':
                self._clear_metric_state()
            return super()._trackable_children(save_type, **kwargs)

        def save(self, *args, **kwargs):
            with self._metric_state_kept():
                return super().save(*args, **kwargs)

        def save_weights(self, *args, **kwargs):
            with self._metric_state_kept():
                return super().save_weights(*args, **kwargs)

    def _training_metrics(self) -> List[Any]:
        """The metrics that steps update: the loss tracker, the compiled
        metrics and those the wrapped model's layers add."""
        metrics = self.metrics + list(self.inner_model.metrics)
        return list({id(metric): metric for metric in metrics}.values())

    def _clear_metric_state(self) -> None:
        if not _keras.IS_KERAS_3:
            for metric in self._training_metrics():
                metric.reset_state()

    @contextlib.contextmanager
    def _metric_state_kept(self):
        variables = [variable for metric in self._training_metrics()
                     for variable in metric.variables]
        values = [variable.numpy() for variable in variables]
        try:
            yield
        finally:
            for variable, value in zip(variables, values):
                variable.assign(value)

    @property
    def aggregator(self) -> Optional[aggregator_lib.PrivateAggregator]:
        """The ``PrivateAggregator`` that runs the steps: the model's own, or
        that of the tf_twice DP optimizer it is compiled with."""
        if self._own_aggregator is not None:
            return self._own_aggregator
        optimizer = _keras.without_loss_scaling(
            getattr(self, 'optimizer', None))
        return (optimizer.aggregator if guards.is_dp_optimizer(optimizer)
                else None)

    def _require_aggregator(self) -> aggregator_lib.PrivateAggregator:
        aggregator = self.aggregator
        if aggregator is None:
            raise ValueError(f'This DPModel {guards.NO_MECHANISM}')
        return aggregator

    @property
    def config(self) -> Optional[config_lib.TwiceSamplingConfig]:
        """The mechanism the steps run (None until a model without its own
        config is compiled with a tf_twice DP optimizer)."""
        aggregator = self.aggregator
        return None if aggregator is None else aggregator.config

    @property
    def attached_ledger(self) -> Optional[ledger_lib.PrivacyLedger]:
        """The ``PrivacyLedger`` every ``fit`` runs with (``attach_ledger``;
        ``make_private`` attaches its own), or None."""
        return self._attached_ledger

    def attach_ledger(self, ledger: ledger_lib.PrivacyLedger) -> None:
        """Makes every later ``fit`` account its steps with ``ledger``.

        ``fit`` adds ``ledger`` to its callbacks when they hold no
        ``PrivacyLedger`` (and says so in one log line), and refuses
        callbacks holding another one: a forgotten ``callbacks=[ledger]``
        can then neither train past the ledger's ``max_steps`` or
        ``target_epsilon`` nor leave steps unaccounted.

        Raises:
          ValueError: ``ledger`` is not a PrivacyLedger of this model's
            event.
        """
        if not isinstance(ledger, ledger_lib.PrivacyLedger):
            raise ValueError('ledger must be a tf_twice.keras.PrivacyLedger; '
                             f'got {type(ledger).__name__}.')
        guards.check_ledger_event(ledger.event, self)
        object.__setattr__(self, '_attached_ledger', ledger)

    @property
    def basis(self) -> Optional[basis_lib.HybridBasis]:
        """The hybrid-clipping basis the next step uses (None: one block)."""
        aggregator = self.aggregator
        return None if aggregator is None else aggregator.basis

    def set_basis(self, basis: basis_lib.HybridBasis) -> None:
        """Uses ``basis`` from the next step on, without retracing
        (``PrivateAggregator.set_basis``); gives a DPModel rebuilt from an
        artifact the basis that no artifact holds."""
        aggregator = self._require_aggregator()
        hybrid.check_is_basis(basis)
        if self.inner_model.built:
            hybrid.check_basis_matches_variables(
                basis, self.inner_model.trainable_variables)
        aggregator.set_basis(basis)

    @property
    def key_streams(self) -> List[step_keys.StepKeys]:
        """Every step-key stream this model's steps may have drawn from,
        each once: those a step was traced or run with (`train_step`
        records them), then the current one. Recorded when the step is
        built, not at `compile`, so the streams of a DP optimizer replaced
        without a recompile (an assigned ``optimizer``, a `compile` that
        failed half-way) or still run by a train function Keras cached
        are read too."""
        aggregator = self.aggregator
        current = [] if aggregator is None else [aggregator.keys]
        earlier = [keys for keys in self._stepped_streams
                   if all(keys is not c for c in current)]
        return earlier + current

    def save_random_state(self, path: str) -> None:
        """Writes the SECRET state of the step keys to ``path``.

        Only for bit-reproducible seeded experiments that must resume
        exactly: anyone holding the file can recompute the noise of every
        later step and subtract it from released weights. Keep it apart
        from checkpoints and models, as secret as the training data.
        The file records the DP steps the weights hold and a digest of the
        weights, so that it only loads into a model at that step with those
        weights.
        """
        self._require_aggregator().keys.save(
            path, step=self._step_count(), weights=self._weights_digest())

    def load_random_state(self, path: str) -> None:
        """Continues the step keys from a ``save_random_state`` file.

        Raises:
          ValueError: the file was saved at another step count than the
            model's, or with other weights, or records neither (a file of
            an earlier version) (``StepKeys.load``).
        """
        self._require_aggregator().keys.load(
            path, step=self._step_count(), weights=self._weights_digest())

    def _step_count(self) -> int:
        return int(self.steps_taken.numpy())

    def _weights_digest(self) -> str:
        """SHA-256 of the wrapped model's weights and the DP steps they
        hold: a run state continues only the weights it was saved with.

        Raises:
          ValueError: the wrapped model is not built (its weights, e.g. a
            deferred checkpoint restore, are not there to compare).
        """
        if not self.inner_model.built:
            raise ValueError(
                f'{self.inner_model.name} is not built, so its weights cannot '
                'be matched with a random state file: call the model on a '
                'batch of inputs first (a TF-format checkpoint is restored '
                'then), and save or load the random state after that.')
        digest = hashlib.sha256()
        for value in self.inner_model.get_weights() + [
                self.steps_taken.numpy()]:
            value = np.ascontiguousarray(value)
            digest.update(f'{value.dtype.str}{value.shape}'.encode())
            digest.update(value.tobytes())
        return digest.hexdigest()

    def dp_event(self) -> TwiceSampledGaussianDpEvent:
        """The DpEvent of one ``train_step`` on Poisson batches: derived
        from the config (``TwiceSamplingConfig.dp_event``), per block with
        ``block_dimensions = basis.block_dimensions`` for hybrid clipping.

        Raises:
          ValueError: no mechanism yet, or a non_private config.
        """
        return self._require_aggregator().dp_event()

    def call(self, inputs, training=None, mask=None):
        # Only train_step trains the weights (it never calls this): a
        # gradient or a state update taken through the DPModel (an outer
        # model's fit, a GradientTape loop) would be a non-private update
        # no ledger charges. So the wrapped model runs in inference mode
        # (no dropout; `fit` refuses layers that write statistics of their
        # inputs in either mode), and neither its outputs nor the losses its
        # layers add (activity_regularizer, add_loss) carry a gradient:
        # no tape records the pass, and each of them is stopped for a
        # gradient built from a traced graph (a tape around a tf.function
        # that calls this, tf.gradients). Keras then says "No gradients
        # provided". The wrapped model's own call is untouched.
        del training  # Always inference: see above.
        with record.stop_recording():
            outputs = self.inner_model(inputs, training=False)
        _keras.stop_gradient_of_added_losses(self.inner_model)
        return tf.nest.map_structure(tf.stop_gradient, outputs)

    def export(self, filepath, *args, **kwargs):
        """As Keras's ``Model.export``. On Keras 3 an ``input_signature``
        that is not given is that of the batches ``fit`` trained on, else
        of the wrapped functional model's inputs: Keras records none for a
        model that only ``fit`` runs (its steps call the wrapped model)."""
        # Keras 3's export(filepath, format, verbose, input_signature):
        # three positional arguments after filepath give it.
        if (_keras.IS_KERAS_3 and len(args) < 3
                and kwargs.get('input_signature') is None):
            signature = _keras.export_input_signature(self, self.inner_model)
            if signature is not None:
                kwargs['input_signature'] = signature
        return super().export(filepath, *args, **kwargs)

    def compile(self, optimizer='rmsprop', loss=None, metrics=None,
                **kwargs):
        guards.check_dp_optimizer(optimizer,
                                  has_config=self._own_aggregator is not None)
        unwrapped = _keras.without_loss_scaling(optimizer)
        if guards.is_dp_optimizer(unwrapped):
            # It may now be built (it refuses any other model's fit).
            unwrapped.bind_to_dp_model()
        self._example_loss = per_example.loss_fn(loss)
        guards.check_no_xla(kwargs.get('jit_compile', False))
        kwargs['jit_compile'] = False
        super().compile(optimizer=optimizer, loss=loss, metrics=metrics,
                        **kwargs)
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
        if self.inner_model.built:
            # Weights loaded before the first step (load_weights, .keras,
            # BackupAndRestore) restore the optimizer's state only if it
            # has its variables.
            _keras.build_optimizer(self.optimizer,
                                   self.inner_model.trainable_variables)

    def compile_from_config(self, config: Dict[str, Any]) -> None:
        """Compiles from ``get_compile_config()`` when a ``.keras`` file is
        loaded (``compile`` creates the optimizer's variables, so that its
        saved state is restored with the weights)."""
        self.compile(**tf.keras.utils.deserialize_keras_object(config))

    def save_own_variables(self, store) -> None:
        self._clear_metric_state()  # Before Keras saves the metrics.
        super().save_own_variables(store)
        _keras.save_legacy_optimizer(getattr(self, 'optimizer', None), store)

    def load_own_variables(self, store) -> None:
        own, saved = _keras.split_legacy_optimizer(store)
        if len(own):  # None in a file from before the binding: unbound.
            super().load_own_variables(own)
        optimizer = getattr(self, 'optimizer', None)
        if optimizer is not None:
            _keras.load_legacy_optimizer(optimizer, saved, self.inner_model)
        elif saved:
            _LOGGER.warning('DPModel: not compiled yet, so the file\'s '
                            'optimizer state was not loaded.')

    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose='auto',
            callbacks=None, *args, allow_non_poisson_input: bool = False,
            **kwargs):
        """``tf.keras.Model.fit``, checked against its privacy ledgers.

        Each element of ``x`` is one logical batch, i.e. one DP step. A
        ledger attached to the model (``attach_ledger``; ``make_private``
        attaches its own) is added to ``callbacks`` when they hold no
        ledger. When a ``PrivacyLedger`` is among ``callbacks``, before any
        step runs:

        * ``x`` must be Poisson-sampled logical batches
          (``tf_twice.sampling.poisson_batches``) of the config's n examples
          at its rate q1: the accountant's epsilon is not a bound for arrays
          batched by ``fit`` or ``shuffle().batch()`` pipelines, so they are
          refused (ValueError);
        * the ledger's event must be this model's ``dp_event()``;
        * no callback may act on a ``nonprivate_*`` log (e.g.
          ``EarlyStopping(monitor='nonprivate_loss')``): those are the
          private batch's loss and metrics without noise.

        ``class_weight`` is applied by tf_twice, not Keras
        (``tf_twice.keras.class_weights``): each example's weight is
        multiplied by its class's weight in [0, 1], and a label without one
        gets weight 0 instead of aborting the step that sampled it.

        Without a ledger, ``fit`` trains as ``tf.keras.Model.fit`` does and
        NOTHING IS ACCOUNTED: no epsilon holds unless the caller accounts
        the steps (and their sampling) by other means. On input that is
        not Poisson-sampled for the config it warns
        (``NonPoissonInputWarning``; not for a ``non_private`` config):
        no epsilon holds for those steps, and no ledger accepts the
        weights afterwards.

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
        callbacks = fit_checks.with_attached_ledger(self, callbacks)
        fit_checks.check_fit(self, x, callbacks, args, kwargs,
                             strict=not allow_non_poisson_input,
                             nonprivate_prefix=NONPRIVATE_PREFIX)
        # After the checks, which read the Poisson marker that map drops.
        x, args, kwargs = class_weights.apply_class_weight(x, y, args, kwargs)
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

    def _update_metrics(self, y, predictions, losses, weights,
                        weighted: bool) -> None:
        """Updates loss and compiled metrics on the rows of weight > 0.

        Keras applies sample weights only to ``weighted_metrics``, so zero-
        weight (padding) rows are removed rather than down-weighted. The loss
        is the weighted mean of the per-example losses. The compiled metrics
        also skip rows whose class index is outside the classes (NaN loss,
        no contribution): they read the raw labels, and a sparse
        cross-entropy metric would abort the step that sampled such a
        record, revealing that it was sampled.
        """
        real = weights > 0
        self._example_loss_tracker.update_state(
            tf.boolean_mask(losses, real),
            sample_weight=tf.boolean_mask(weights, real))
        valid = self._example_loss.valid_rows(y, predictions)
        if valid is not None:
            real = tf.logical_and(real, valid)
        y_real = tf.boolean_mask(y, real)
        predictions = tf.nest.map_structure(
            lambda t: tf.boolean_mask(t, real), predictions)
        _keras.update_compiled_metrics(
            self, y_real, predictions,
            tf.boolean_mask(weights, real) if weighted else None)

    def _apply_update(self, update, variables) -> None:
        optimizer = _keras.without_loss_scaling(self.optimizer)
        apply = getattr(optimizer, 'apply_private_update', None)
        if apply is not None:  # A tf_twice DP optimizer.
            apply(update, variables)
        else:
            optimizer.apply_gradients(zip(update, variables))

    def train_step(self, data):
        if self._example_loss is None:
            raise ValueError('DPModel must be compiled before training.')
        aggregator = self._require_aggregator()
        # In Python, so at every trace and eager call: the stream this
        # step draws from, whatever replaces the optimizer later.
        if all(aggregator.keys is not keys for keys in self._stepped_streams):
            self._stepped_streams.append(aggregator.keys)
        x, y, sample_weight = tf.keras.utils.unpack_x_y_sample_weight(data)
        if y is None:
            raise ValueError('DPModel.train_step needs targets y.')
        y = tf.convert_to_tensor(y)
        x = tf.nest.map_structure(tf.convert_to_tensor, x)
        if not self.inner_model.built:
            per_example.build(self.inner_model, x)
            self.built = True
        # `call` never runs in training; a SavedModel traces it with these
        # specs, any batch size (Poisson batches vary).
        _keras.record_call_inputs(self, tf.nest.map_structure(
            lambda t: tf.TensorSpec([None] + t.shape[1:], t.dtype), x))
        size = tf.shape(tf.nest.flatten(x)[0])[0]
        weights = per_example.example_weights(sample_weight, size,
                                               bounded=True)
        variables = self.inner_model.trainable_variables

        def on_chunk(yc, predictions, losses, wc):
            self._update_metrics(yc, predictions, losses, wc,
                                 sample_weight is not None)

        update = dp_step.private_update(
            aggregator, self.inner_model, self._example_loss, x, y, weights,
            size, variables, physical_batch_size=self.physical_batch_size,
            # Every DP step counts, also those an optimizer accumulates
            # (Keras 3's iterations count updates: a resumed seeded run
            # would have drawn a released step's masks and noise again).
            step=self.steps_taken, on_chunk=on_chunk)
        self._apply_update(update, variables)
        ledger_binding.count_step(self, update)
        # Computed on the private batch without noise: not private.
        return {f'{NONPRIVATE_PREFIX}{name}': value
                for name, value in self.get_metrics_result().items()}

    def test_step(self, data):
        if self._example_loss is None:
            raise ValueError('DPModel must be compiled before evaluation.')
        x, y, sample_weight = tf.keras.utils.unpack_x_y_sample_weight(data)
        y = tf.convert_to_tensor(y)
        y_pred = self.inner_model(x, training=False)
        losses = per_example.losses(self.inner_model, self._example_loss, y,
                                    y_pred)
        weights = per_example.example_weights(
            sample_weight, tf.shape(losses)[0], bounded=False)
        self._update_metrics(y, y_pred, losses, weights,
                             sample_weight is not None)
        return self.get_metrics_result()

    def get_config(self) -> Dict[str, Any]:
        """The wrapped model and the mechanism's public parameters.

        Holds no seed and no random state (docs/checkpoints.md). A model
        compiled with a DP optimizer keeps its mechanism in the optimizer's
        config.
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
        Without it (as Keras's loaders rebuild a hybrid DPModel) the model
        refuses to train until ``set_basis``: were this to raise instead,
        Keras 2's SavedModel loader would revive a generic model whose
        ``fit`` trains without DP.
        """
        config = dict(config)
        # Keras's own deserializer for layers and models: inside Keras 2's
        # SavedModel loader the generic one knows no Keras class
        # ('Unknown object: Sequential'), and the loader then revived a
        # generic model whose fit trains without DP.
        model = tf.keras.layers.deserialize(
            config.pop('model'), custom_objects=custom_objects)
        mechanism = config.pop('config', None)
        if mechanism is None:
            # Compiled with a tf_twice optimizer, which Keras's loaders look
            # up next; importing the module builds and registers it.
            importlib.import_module('tf_twice.optimizers')
            return cls(model, **config)
        mechanism = config_lib.TwiceSamplingConfig.from_dict(mechanism)
        if config.get('basis') is not None or mechanism.num_blocks == 1:
            return cls(model, mechanism, **config)
        seed = config.pop('seed', None)
        dp_model = cls(model, **config)
        dp_model._own_aggregator = aggregator_lib.PrivateAggregator(
            mechanism, seed=seed, awaiting_basis=True)
        return dp_model
