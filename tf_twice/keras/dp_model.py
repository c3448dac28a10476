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

Saving and loading (no metric state, no step keys, the config) live in
``model_artifacts``. docs/ documents the rest once: the optimizer path
(keras.md), hybrid clipping (hybrid_clipping.md: the basis is in no
checkpoint; a rebuilt hybrid DPModel trains after ``set_basis``), seeded
runs (checkpoints.md) and replicas (distributed.md). With
``compile(jit_compile=True)`` XLA compiles the whole DP step; it drops the
step's run-time check of per-example weights, so ``fit`` checks a dataset's
weights before the step and the step gives any weight outside [0, 1] weight 0.
"""

from typing import Any, Dict, Optional, Sequence

import tensorflow as tf
# Keeps every gradient tape off the wrapped model's forward pass in `call`,
# including what it leaves beside its outputs (tf.stop_gradient sees only
# the tensors it is given).
from tensorflow.python.eager import record

from tf_twice import _keras
from tf_twice import _validate
from tf_twice import config as config_lib
from tf_twice.accounting import TwiceSampledGaussianDpEvent
from tf_twice.keras import dp_step
from tf_twice.keras import fit_checks
from tf_twice.keras import guards
from tf_twice.keras import ledger as ledger_lib
from tf_twice.keras import model_artifacts
from tf_twice.keras.model_artifacts import loss_mean
from tf_twice.keras import per_example
from tf_twice.keras import privacy_record
from tf_twice.keras.per_example import default_physical_batch_size
from tf_twice.mechanism import aggregator as aggregator_lib
from tf_twice.mechanism import basis as basis_lib
from tf_twice.mechanism import hybrid
from tf_twice.mechanism import step_keys

__all__ = ['DPModel', 'default_physical_batch_size']

# Training logs computed on private batches without noise carry this prefix.
NONPRIVATE_PREFIX = 'nonprivate_'


@tf.keras.utils.register_keras_serializable(package='tf_twice')
class DPModel(model_artifacts.ArtifactHygiene, tf.keras.Model):
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
            only, never privacy. None: ``default_physical_batch_size``
            (with ``hybrid`` when ``basis`` is given here; a basis that
            comes with a DP optimizer is not seen: pass 256 with one).
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
            physical_batch_size = default_physical_batch_size(
                model, config, hybrid=basis is not None)
        self.physical_batch_size = _validate.integer(
            'physical_batch_size', physical_batch_size, 1)
        self.inner_model = model
        # Its own weight, saved and restored with the others: the DP steps
        # the weights hold and the mechanism each ran (`privacy_record`).
        self.privacy_record = privacy_record.add_variable(self)
        # `set_input_checked`'s flag, not saved.
        with tf.init_scope():
            object.__setattr__(self, '_input_checked', tf.Variable(
                True, trainable=False, name='dp_input_checked'))
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
        object.__setattr__(self, '_example_loss_tracker', loss_mean())
        # The wrapped model's state words now: a seeded stream follows its
        # seed only from this state (weights loaded later, before or after
        # compile, start another stream). None for a model built later.
        object.__setattr__(self, '_initial_state_words', (
            step_keys.state_fingerprint(
                model.trainable_variables, tf.constant(0, tf.int64))
            if model.built else None))
        # `attach_ledger`'s: not saved, not tracked (a Keras callback).
        object.__setattr__(self, '_attached_ledger', None)
        self._example_loss = None

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

    def set_basis(self, basis: basis_lib.HybridBasis, *,
                  block_scales: Optional[Sequence[float]] = None) -> None:
        """Uses ``basis`` (and ``block_scales``: ``BasisHolder.set_basis``)
        from the next step on, without retracing
        (``PrivateAggregator.set_basis``); gives a DPModel rebuilt from an
        artifact the basis that no artifact holds."""
        aggregator = self._require_aggregator()
        hybrid.check_is_basis(basis)
        if self.inner_model.built:
            hybrid.check_basis_matches_variables(
                basis, self.inner_model.trainable_variables)
        aggregator.set_basis(basis, block_scales=block_scales)

    @property
    def steps_taken(self) -> tf.Tensor:
        """The DP steps these weights hold (``privacy_record``'s count)."""
        return self.privacy_record[0]

    def set_input_checked(self, checked: bool) -> None:
        """Whether the next steps' input is known to be Poisson (``fit``
        decides; custom loops vouch for theirs). Steps on unchecked input
        are recorded so, and no ledger later charges them."""
        self._input_checked.assign(bool(checked))

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

    def compile(self, optimizer='rmsprop', loss=None, metrics=None,
                **kwargs):
        guards.check_dp_optimizer(optimizer,
                                  has_config=self._own_aggregator is not None)
        unwrapped = _keras.without_loss_scaling(optimizer)
        if guards.is_dp_optimizer(unwrapped):
            # It may now be built (it refuses any other model's fit).
            unwrapped.bind_to_dp_model()
        self._example_loss = per_example.loss_fn(loss)
        kwargs['jit_compile'] = guards.check_jit_compile(
            kwargs.get('jit_compile'))
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
        try:  # end_fit undoes what check_fit sets, also when it refuses.
            fit_checks.check_fit(self, x, callbacks, args, kwargs,
                                 strict=not allow_non_poisson_input,
                                 nonprivate_prefix=NONPRIVATE_PREFIX)
            # After the checks, which read the Poisson marker map drops.
            x, args, kwargs = fit_checks.prepared_input(self, x, y, args,
                                                        kwargs)
            object.__setattr__(self, '_fit_element_spec',
                               x.element_spec if isinstance(
                                   x, tf.data.Dataset) else None)
            return super().fit(x, y, batch_size, epochs, verbose, callbacks,
                               *args, **kwargs)
        finally:
            object.__setattr__(self, '_fit_element_spec', None)
            fit_checks.end_fit(self, callbacks)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        """Keras 3's build before training under a strategy, from the
        dataset's element spec: Keras pulls the first batch and reduces it
        over the replicas to learn its shapes, which fails for a logical
        batch split into shares of unequal size and under
        MultiWorkerMirroredStrategy. (Keras 2 never calls this.)"""
        spec = getattr(self, '_fit_element_spec', None)
        if iterator is not None and data_batch is None and spec is not None:
            iterator, data_batch = None, spec
        return super()._maybe_symbolic_build(iterator=iterator,
                                             data_batch=data_batch)

    def train_on_batch(self, *args, **kwargs):
        """Refused: no ledger sees these steps, no check their input."""
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
        rows = per_example.rows_where(real)
        self._example_loss_tracker.update_state(
            rows(losses), sample_weight=rows(weights))
        valid = self._example_loss.valid_rows(y, predictions)
        if valid is not None:
            rows = per_example.rows_where(tf.logical_and(real, valid))
        _keras.update_compiled_metrics(
            self, rows(y), tf.nest.map_structure(rows, predictions),
            rows(weights) if weighted else None)

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
            step=self.privacy_record[0], on_chunk=on_chunk)
        self._apply_update(update, variables)
        privacy_record.count_step(
            self.privacy_record, update,
            privacy_record.step_words(aggregator, self._input_checked))
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
