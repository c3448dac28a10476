"""`PrivacyLedger`: a Keras callback that accounts for every DP step.

Every train batch of `fit` is one logical batch, one DP step
(`tf_twice.sampling`). The ledger charges each step's `DpEvent` to a
`tf_twice.accounting.budget.PrivacyBudget` (the TF-free state and its
write-ahead file), so `ledger.epsilon` is the accountant's epsilon at `delta`
for the steps taken, those of the runs it resumed from included.

Threat model (docs/guarantees.md): the epsilon bounds what whoever sees what
training releases (the model, checkpoints, logs) learns about any record,
when the public API is used as documented; misuse of Keras internals is
refused where the invariant below catches it, documented where it does not.

The invariant: a `DPModel`'s weights carry the record of what ran on them
(`privacy_record`: the steps and a digest of each step's mechanism, written
by the train step), and the ledger's history holds every step it names. At
every hook, custom-loop call and reading the ledger reads the record and
charges the steps it adds, or refuses the weights (`step_record`). So it
never misses a step that ran, never charges another mechanism's as its own,
and a checkpoint resumes with any state file that covers it.

Never past the budget: with `target_epsilon` or `max_steps`, no execution
(`steps_per_execution` steps) starts whose steps would exceed it (after a
step `model.stop_training`; before one, `model.train_function` swapped for a
no-op, since Keras ignores `stop_training` set then). Never forgets privacy
spent: with `state_path` the file is written before steps run, so a crash
over-counts, never under-counts. A plain Keras model (no record) is charged
before each execution; its caller vouches for the event. At each epoch end
`logs['epsilon']` is set for the callbacks after the ledger (and written to
`log_dir` as the scalar `epoch_epsilon`).

The rule, the budget it charges and the custom loops' arithmetic are
TF-free (`tf_twice.accounting.step_ledger.StepLedger`, this class's base);
this module adds what needs Keras: its hooks, the train function it watches
or blocks, the checks of the model.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, List, Mapping, Optional, Sequence, Tuple

import dp_accounting
import tensorflow as tf

from tf_twice import _keras
from tf_twice import _validate
from tf_twice.accounting import budget as budget_lib
from tf_twice.accounting import step_ledger
from tf_twice.accounting import step_record
from tf_twice.accounting.budget import STATE_FORMAT
from tf_twice.accounting.budget import STATE_VERSION
from tf_twice.keras import guards
from tf_twice.keras import privacy_record

__all__ = ['PrivacyLedger', 'STATE_FORMAT', 'STATE_VERSION']

_LOGGER = logging.getLogger(__name__)
_BLOCKED_NAME = 'blocked_train_function'
_WATCHED_NAME = 'watched_train_function'


def ledgers_in(callbacks: Any) -> List['PrivacyLedger']:
    """The `PrivacyLedger`s among `fit`'s callbacks (list or CallbackList)."""
    return [c for c in guards.fit_callbacks(callbacks)
            if isinstance(c, PrivacyLedger)]


class PrivacyLedger(step_ledger.StepLedger, tf.keras.callbacks.Callback):
    """Counts DP steps of `fit`, reports epsilon, stops at a target, persists.

    The module docstring states what it guarantees; `PrivacyBudget`, the
    state and its file.

    Args:
      event: the `DpEvent` of ONE step, normally
        `tf_twice.TwiceSampledGaussianDpEvent(...)`; any event the
        `TwiceSamplingRdpAccountant` supports.
      delta: in (0, 1).
      target_epsilon: None or in (0, inf); training stops before a step that
        would exceed it.
      max_steps: None or an integer >= 0: training stops before the step
        that would take the ledger's total (resumed steps included) past it,
        e.g. the number of steps the noise was calibrated for.
      state_path: None or a JSON file in an existing, writable directory;
        loaded if it exists, and kept up to date.
      save_every_steps: >= 1, how many steps each write-ahead charges (a
        crash over-charges at most that many; larger values save I/O).
      orders: RDP orders; default: those of the state file, else the
        accountant's.
      log_dir: None or a directory for a TensorBoard `epoch_epsilon` scalar.
      verbose: 0 silences the messages logged on stopping and loading.

    Raises:
      ValueError: an argument outside its range, an event the accountant
        cannot compose, a `state_path` that cannot be written or an
        unreadable state file; when `fit` starts, a model that mixes
        examples or whose event is not this one.
    """

    def __init__(self,
                 event: dp_accounting.DpEvent,
                 delta: float,
                 *,
                 target_epsilon: Optional[float] = None,
                 max_steps: Optional[int] = None,
                 state_path: Optional[str] = None,
                 save_every_steps: int = 10,
                 orders: Optional[Sequence[float]] = None,
                 log_dir: Optional[str] = None,
                 verbose: int = 1):
        super().__init__()
        self._setup(budget_lib.PrivacyBudget(
            event, delta, target_epsilon=target_epsilon, max_steps=max_steps,
            state_path=state_path, save_every_steps=save_every_steps,
            orders=orders), log_dir=log_dir, verbose=verbose)
        self._log_resumed()

    @classmethod
    def for_model(cls,
                  model: tf.keras.Model,
                  *,
                  delta: float,
                  target_epsilon: Optional[float] = None,
                  max_steps: Optional[int] = None,
                  state_path: Optional[str] = None,
                  save_every_steps: int = 10,
                  orders: Optional[Sequence[float]] = None,
                  log_dir: Optional[str] = None,
                  verbose: int = 1) -> 'PrivacyLedger':
        """A ledger of `model`'s own step, `model.dp_event()` (derived from
        its `TwiceSamplingConfig`, so nothing is copied by hand), given the
        model for custom loops. The other arguments are the constructor's.

        Raises:
          ValueError: `model` is not a tf_twice DP model, its config is
            non_private or not calibrated, or an argument of the
            constructor is outside its range.
        """
        dp_event = getattr(model, 'dp_event', None)
        if not callable(dp_event) or not hasattr(model, 'aggregator'):
            raise ValueError(
                'model must be a tf_twice.keras.DPModel; got '
                f'{type(model).__name__}. For other models build the DpEvent '
                'and call PrivacyLedger(event, delta, ...).')
        ledger = cls(dp_event(), delta, target_epsilon=target_epsilon,
                     max_steps=max_steps, state_path=state_path,
                     save_every_steps=save_every_steps, orders=orders,
                     log_dir=log_dir, verbose=verbose)
        config = getattr(model, 'config', None)
        if config is not None:
            _validate.warn_if_delta_not_small(ledger.delta,
                                              config.num_examples)
        ledger.set_model(model)  # A custom loop never calls set_model.
        return ledger

    @classmethod
    def from_state(cls, state: Mapping[str, Any], *,
                   event: Optional[dp_accounting.DpEvent] = None,
                   delta: Optional[float] = None,
                   target_epsilon: Optional[float] = None,
                   state_path: Optional[str] = None,
                   save_every_steps: int = 10,
                   orders: Optional[Sequence[float]] = None,
                   log_dir: Optional[str] = None,
                   verbose: int = 1) -> 'PrivacyLedger':
        """A ledger that continues from `state` (a `get_state()` dict).

        `event`, `delta`, `target_epsilon` and `orders` default to the
        state's (event: its last segment's); steps of another event are
        composed with the state's. `state_path`, if given, must not exist
        yet (load an existing file with `PrivacyLedger(state_path=...)`).

        Raises:
          ValueError: invalid state or arguments.
        """
        ledger = cls.__new__(cls)
        tf.keras.callbacks.Callback.__init__(ledger)
        ledger._setup(budget_lib.PrivacyBudget.from_state(
            state, event=event, delta=delta, target_epsilon=target_epsilon,
            state_path=state_path, save_every_steps=save_every_steps,
            orders=orders), log_dir=log_dir, verbose=verbose)
        return ledger

    def _setup(self, budget: budget_lib.PrivacyBudget, *, log_dir,
               verbose) -> None:
        super()._setup(budget, verbose=verbose)
        self._log_dir = log_dir
        self._writer = None
        self._loop_warned = False

    def _model_record(self) -> Tuple[Any, Optional[step_record.Record]]:
        model = getattr(self, 'model', None)
        return model, privacy_record.read(model)

    def bind_model(self, model: tf.keras.Model) -> None:
        """Takes `model` as this ledger's and checks now, as `fit` does
        before its first step, that this ledger accounts every step its
        weights' record holds (charging those it can, `step_record`).

        Raises:
          ValueError: the weights hold steps this ledger cannot account.
        """
        self.set_model(model)
        self._sync(watch=True)

    # --- Keras hooks ------------------------------------------------------

    def _steps_per_execution(self) -> int:
        return _keras.steps_per_execution(self.model)

    def _sync(self, *, watch: bool = False, in_fit: bool = False,
              strict: bool = True) -> None:
        """`StepLedger._sync`; a refusal in a `fit` (``in_fit``) stops
        training before it raises."""
        try:
            super()._sync(watch=watch, strict=strict)
        except ValueError:
            if in_fit:
                self.model.stop_training = True
            raise

    def _stop(self, k: int) -> None:
        self.model.stop_training = True
        self._note_stop(k)

    def on_train_begin(self, logs=None):
        # Refused before any step runs, so nothing is charged for them.
        guards.check_no_example_mixing(self.model)
        guards.check_ledger_event(self.event, self.model)
        _unwrap_train_function(self.model, (_BLOCKED_NAME,))
        self._stopped_by_budget = False
        self._stopped_at_max_steps = False
        # Steps that ran unseen (an interrupted fit, a custom loop) are
        # charged now.
        self._sync()
        if privacy_record.has_record(self.model):
            self._watch_train_function()
        keys = getattr(getattr(self.model, 'aggregator', None), 'keys', None)
        if getattr(keys, 'seeded', False) and self._verbose:
            _LOGGER.warning(
                'PrivacyLedger: the model\'s masks and noise are SEEDED. The '
                'epsilon holds only if the seed is secret and used for this '
                'one run: the same seed on the same weights gives the same '
                'noise, and two releases with the same noise reveal their '
                'noise-free difference. Leave seed=None for a release.')

    def _watch_train_function(self) -> None:
        """Reads the record right before and after each execution of this
        `fit`, before any callback: a callback that reloads weights (a
        rollback, BackupAndRestore after an exception that cut off a hook)
        cannot hide the steps that ran."""
        def watch(original):
            def watched_train_function(iterator):
                self._sync(watch=True, in_fit=True)
                try:
                    logs = original(iterator)
                except BaseException:
                    self._sync(strict=False)  # Steps of a cut execution.
                    raise
                self._sync(in_fit=True)
                return logs
            return watched_train_function
        # Every ledger of the fit watches: each over the other's wrapper.
        _swap_train_function(self.model, _WATCHED_NAME, watch, owner=self)

    def on_train_batch_begin(self, batch, logs=None):
        k = self._steps_per_execution()
        if not self.can_take(k):
            self._stop(k)
            _swap_train_function(self.model, _BLOCKED_NAME,
                                 lambda _: _blocked(self.model))
            return
        self._budget.reserve_ahead(k)
        if not privacy_record.has_record(self.model):
            # No record: its k steps are charged now, before they run (a
            # final execution that runs fewer is charged whole).
            self._charge(k)

    def on_train_batch_end(self, batch, logs=None):
        self._sync(in_fit=True)  # Also where Keras did not call ours.
        k = self._steps_per_execution()
        if not self.can_take(k):
            self._stop(k)

    def on_epoch_end(self, epoch, logs=None):
        eps = self.epsilon
        if logs is not None:
            logs['epsilon'] = eps
        if self._log_dir is not None:
            if self._writer is None:
                self._writer = tf.summary.create_file_writer(self._log_dir)
            with self._writer.as_default():
                tf.summary.scalar('epoch_epsilon', eps, step=epoch)
            self._writer.flush()
        self._budget.write()

    def on_train_end(self, logs=None):
        release_train_function(self.model)
        self._sync()
        self._budget.write()
        if self._writer is not None:
            self._writer.flush()

    # --- custom loops (reserve_steps, record_steps: StepLedger) -----------

    def _check_custom_loop(self, watch: bool = False) -> None:
        """What `fit` checks at its start, for a custom loop's every
        reserve and record (a recompile may have changed the mechanism):
        the model runs this ledger's event and its record is accounted."""
        model = getattr(self, 'model', None)
        if model is None:
            return
        guards.check_ledger_event(self.event, model)
        super()._check_custom_loop(watch=watch)
        if (self._verbose and not self._loop_warned
                and privacy_record.has_record(model)):
            self._loop_warned = True
            _LOGGER.warning(
                'PrivacyLedger: %s runs a custom loop, whose input this '
                'ledger cannot see: its steps are charged as the event\'s '
                'Poisson-sampled logical batches, so the epsilon holds only '
                'if every batch given to train_step is one of '
                'tf_twice.sampling.poisson_batches(...) for this config (its '
                'n and rate), used once; iterate ledger.logical_batches('
                'batches) to have it checked.', model.name)

    def logical_batches(self, batches: Any) -> Iterator[Any]:
        """A custom loop's steps, as `fit` runs them: yields each logical
        batch of ``batches`` after reserving its step, and records it after
        the loop body ran (write-ahead, `reserve_steps`).

            for batch in ledger.logical_batches(poisson_batches(...)):
                model.train_step(batch)

        ``batches`` must be `tf_twice.sampling.poisson_batches` of the
        model's config (its n and q1), checked as `fit` checks its input.
        Stops before a step that would exceed `target_epsilon` or
        `max_steps`.

        Raises:
          ValueError: no model (`for_model` or `set_model`) or one without a
            config or on several replicas (`fit` splits each logical batch
            over them; this loop cannot), or input not known to be
            Poisson-sampled for it.
        """
        model = getattr(self, 'model', None)
        config = getattr(model, 'config', None)
        if config is None:
            raise ValueError(
                'logical_batches needs the tf_twice DP model whose steps it '
                'accounts: build the ledger with PrivacyLedger.for_model('
                'model, ...) or call ledger.set_model(model) first.')
        replicas = getattr(getattr(model, 'distribute_strategy', None),
                           'num_replicas_in_sync', 1)
        if replicas > 1:
            raise ValueError(
                f'logical_batches yields whole logical batches, but '
                f'{model.name} runs on {replicas} replicas: strategy.run '
                'would give each replica the whole batch and sum every '
                'example once per replica. Train with fit, which splits each '
                'logical batch over the replicas, or split them yourself '
                '(experimental_distribute_dataset) around reserve_steps and '
                'record_steps.')
        guards.check_poisson_input(
            batches, example_sampling_rate=config.example_sampling_rate,
            num_examples=config.num_examples)
        self._loop_warned = True  # Its input is checked.
        for batch in batches:
            if not self.can_take(1):
                return
            self.reserve_steps(1)
            yield batch
            self.record_steps(1)


def _blocked(model: tf.keras.Model) -> Any:
    """A train function that runs no step (`target_epsilon` or
    `max_steps` reached)."""
    def blocked_train_function(unused_iterator):
        # No step, no weight update, nothing read from the data; the logs
        # keep their keys (metrics as they stand).
        return _keras.metric_results(model)
    # Keras reads the metrics again at the epoch's end: those that no step
    # has built (Keras 3, before the first step) have no result.
    model.get_metrics_result = lambda: _keras.metric_results(model)
    return blocked_train_function


def _swap_train_function(model: tf.keras.Model, name: str, make,
                         owner: Any = None) -> None:
    """Puts `make(current)`, named `name`, over `model.train_function`,
    which `fit` calls for each execution (once per `name` and `owner`)."""
    current = layer = model.train_function
    while getattr(layer, '__name__', '') in (_BLOCKED_NAME, _WATCHED_NAME):
        if layer.__name__ == name and layer.owner is owner:
            return
        layer = layer.original
    swapped = make(current)
    swapped.original, swapped.owner = current, owner
    model.train_function = swapped


def release_train_function(model: tf.keras.Model) -> None:
    """Gives `model` its own train function back, blocked or watched by a
    ledger (at the end of a fit, also one an exception ended)."""
    _unwrap_train_function(model, (_BLOCKED_NAME, _WATCHED_NAME))


def _unwrap_train_function(model: tf.keras.Model, names) -> None:
    """Removes the outer layers of `model.train_function` named in
    `names` (`_swap_train_function`'s)."""
    current = getattr(model, 'train_function', None)
    while getattr(current, '__name__', '') in names:
        current = model.train_function = current.original
    if _BLOCKED_NAME in names and 'get_metrics_result' in vars(model):
        del model.get_metrics_result  # The class's method again.
