"""`PrivacyLedger`: a Keras callback that accounts for every DP step.

Every train batch of `fit` is one logical batch, i.e. one DP step (see
`tf_twice.sampling`). The ledger charges each step's `DpEvent` (normally a
`TwiceSampledGaussianDpEvent`) to a `tf_twice.accounting.budget.PrivacyBudget`,
so at any time `ledger.epsilon` is the accountant's epsilon at `delta` for
exactly the steps taken, including those of earlier runs it was resumed from.
The budget holds the state and its file (format and write-ahead rules in
its module docstring); this module decides when Keras's steps are charged.

Guarantees:

* **Never past the budget.** With `target_epsilon`, no step runs whose
  composition would give epsilon > target_epsilon. After every step the
  ledger checks whether the next execution (`steps_per_execution` steps)
  still fits and, if not, sets `model.stop_training`, which Keras checks
  right after `on_train_batch_end`, before the next step. Keras ignores
  `stop_training` set before a step (e.g. when a resumed run has no budget
  left for even one step), so in `on_train_batch_begin` the ledger also
  swaps `model.train_function` for a no-op that runs no step and updates no
  weight; the original is restored in `on_train_end`. With
  `steps_per_execution` = k > 1 the run stops at a multiple of k
  (conservative).
* **Never forgets privacy spent.** With `state_path`, the state is written
  *before* steps run (write-ahead): before a step that the file does not
  yet cover, `save_every_steps` steps are charged ahead (capped by the
  budget) and the file written; at each epoch end and at the end of
  training the exact count is written. A crash over-counts by at most
  `save_every_steps` steps and never under-counts. A ledger whose
  `state_path` exists always loads it; a file whose segment counts do not
  add up (cut, or its steps edited), or whose history digest is not its
  segments', is refused (`tf_twice.accounting.ledger_state`). Custom loops
  get the same write-ahead from `reserve_steps` before their steps and
  `record_steps` after them, or from iterating `logical_batches(batches)`,
  which also checks their input as `fit` does.
* **Covers the weights.** Before the first step of every `fit` (and a
  custom loop's first `reserve_steps`/`record_steps`), a DP model is
  refused whose weights hold steps this ledger does not account: more
  optimizer steps or step keys than it charged (`step_control`), or a
  binding (`ledger_binding`, saved with the weights) to a history whose
  steps are not this ledger's first ones (a new ledger, a stale, edited
  or another run's state file). Its epsilon would not bound what the
  weights reveal. Each charge then updates the binding.
* **Accounts the mechanism that runs.** `PrivacyLedger.for_model` takes
  the event from the model (`DPModel.dp_event()`, derived from its
  `TwiceSamplingConfig`). At the start of every `fit` the ledger refuses a
  model that mixes examples (BatchNormalization, ...) and, for a DP model,
  any event other than the model's own (`guards.check_ledger_event`) or a
  config whose block dimension is not the model's; `DPModel.fit` also
  checks the input is Poisson-sampled from the config's n at its q1. A
  plain Keras model's steps are counted as the given event, which the
  caller vouches for.
* **Stops where the plan ends.** With `max_steps`, no step runs past that
  total (resumed steps included): training ends exactly where the noise
  was calibrated.

Logging: at each epoch end `logs['epsilon']` is set, so it reaches `History`
and every callback listed AFTER the ledger (put `TensorBoard`/`CSVLogger`
after it). With `log_dir`, the ledger also writes the scalar
`epoch_epsilon` itself (step = epoch) with `tf.summary`.

Steps are counted, for a tf_twice DP model, by its step keys
(`tf_twice.keras.step_control`), at the ledger's next hook or reading (its
`steps`, `epsilon`, `get_state`, `save`...), so no step that ran is missed.
They become accounted (no other ledger need charge them, nor a ledger of
another mechanism refuse them) once the ledger binds the weights (`fit`, a
custom loop, `bind_model`): a ledger that only reads them, its state too,
leaves them to the one that goes on.
Other models are charged in `on_train_batch_begin`, before their steps run
(`steps_per_execution` steps each time; on Keras 3 a final execution that
runs fewer is charged whole); their custom loops call `record_steps`.
The ledger uses Keras's public callback hooks, `model.stop_training` and
`model.train_function`, on Keras 2 and Keras 3 alike.
"""

from __future__ import annotations

import logging
import threading
from typing import (Any, Dict, Iterator, List, Mapping, Optional, Sequence,
                    Tuple)

import dp_accounting
import numpy as np
import tensorflow as tf

from tf_twice import _keras
from tf_twice import _validate
from tf_twice.accounting import budget as budget_lib
from tf_twice.accounting import TwiceSamplingRdpAccountant
from tf_twice.accounting.budget import STATE_FORMAT
from tf_twice.accounting.budget import STATE_VERSION
from tf_twice.keras import guards
from tf_twice.keras import ledger_binding
from tf_twice.keras import step_control

__all__ = ['PrivacyLedger', 'STATE_FORMAT', 'STATE_VERSION']

_LOGGER = logging.getLogger(__name__)


def ledgers_in(callbacks: Any) -> List['PrivacyLedger']:
    """The `PrivacyLedger`s among `fit`'s callbacks (list or CallbackList)."""
    return [c for c in guards.fit_callbacks(callbacks)
            if isinstance(c, PrivacyLedger)]


class PrivacyLedger(tf.keras.callbacks.Callback):
    """Counts DP steps of `fit`, reports epsilon, stops at a target, persists.

    See the module docstring for the guarantees (never past
    `target_epsilon`, never forgets privacy spent) and
    `tf_twice.accounting.budget` for the state format.

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
      state_path: None or a JSON file (e.g. beside the model checkpoints)
        in an existing, writable directory. Loaded if it exists, and kept up
        to date.
      save_every_steps: >= 1, how many steps each write-ahead charges: the
        file is written before every `save_every_steps`-th step (1: before
        every step), so a crash over-charges at most that many steps. Larger
        values only save I/O (each write is fsync'ed); they never
        under-charge.
      orders: RDP orders; default: those of the state file, else the
        accountant's.
      log_dir: None or a directory for a TensorBoard `epoch_epsilon` scalar.
      verbose: 0 silences the messages logged on stopping and loading.

    Raises:
      ValueError: for an argument outside its range, an event the accountant
        cannot compose, a `state_path` that cannot be written (a directory,
        a missing or read-only directory) or an unreadable state file; when
        `fit` starts, for a model with BatchNormalization or a tf_twice DP
        model whose parameters differ from the event's.
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
        if self._budget.resumed and self._verbose:
            _LOGGER.warning('PrivacyLedger: resumed %d steps from %s '
                            '(epsilon %.4g at delta %g).', self.steps,
                            self.state_path, self.epsilon, self.delta)
            segments = self._budget.get_state()['segments']
            if segments and budget_lib.event_from_json(
                    segments[-1]['event']) != event:
                # Sound (composed), but rarely what a resume meant to do.
                _LOGGER.warning(
                    'PrivacyLedger: the steps resumed from %s ran another '
                    'mechanism than this ledger\'s event (other noise, '
                    'rates or clips); both are accounted, composed: '
                    '%d segment(s) so far, this run\'s steps a new one.',
                    self.state_path, len(segments))

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
        """A ledger whose event is `model`'s own step, `model.dp_event()`.

        `model` is a `tf_twice.keras.DPModel` with a config (or compiled with
        a tf_twice DP optimizer): its event is derived from that
        `TwiceSamplingConfig` (n, q1, q2, clips and noise, per block with
        `block_dimensions = basis.block_dimensions` for hybrid clipping), so
        nothing is copied by hand. The other arguments are the
        constructor's.

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
        # A custom loop never calls set_model: its reserve_steps and
        # record_steps check and count this model's steps too.
        ledger.set_model(model)
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
        state's (event: its last segment's). Steps of a different event are
        composed with the state's, never replace them. `state_path`, if
        given, must not exist yet (its ledger would be lost otherwise: load
        it with `PrivacyLedger(..., state_path=...)` instead).

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
        self._budget = budget
        self._verbose = int(verbose)
        self._log_dir = log_dir
        self._writer = None
        # Steps a tf_twice DP model ran, read from its step keys.
        self._drawn_steps = step_control.DrawnStepCounter()
        # Counting and charging are one step for readers on other threads:
        # none sees steps counted but not yet charged.
        self._charge_lock = threading.RLock()
        # The model whose weights a custom loop's reserve or record checked.
        self._loop_checked_model = None
        # The model whose custom-loop input `logical_batches` checked.
        self._loop_input_checked_model = None
        # The model this ledger checked and bound to its run: each charge
        # updates its `ledger_binding`.
        self._bound_model = None
        self._stopped_by_budget = False
        self._stopped_at_max_steps = False
        # Whether this fit checked, before its first step, that the model's
        # optimizer steps are all charged (`_check_weights_covered`).
        self._weights_checked = True

    # --- the budget -------------------------------------------------------

    @property
    def budget(self) -> budget_lib.PrivacyBudget:
        """The TF-free state this ledger charges (steps, epsilon, file)."""
        return self._budget

    @property
    def event(self) -> dp_accounting.DpEvent:
        """The `DpEvent` of one step of the current run."""
        return self._budget.event

    @property
    def delta(self) -> float:
        return self._budget.delta

    @property
    def verbose(self) -> int:
        """0: no messages logged (on stopping, loading, attaching)."""
        return self._verbose

    @property
    def target_epsilon(self) -> Optional[float]:
        return self._budget.target_epsilon

    @property
    def orders(self) -> np.ndarray:
        return self._budget.orders

    @property
    def max_steps(self) -> Optional[int]:
        return self._budget.max_steps

    @property
    def state_path(self) -> Optional[str]:
        return self._budget.state_path

    @property
    def steps(self) -> int:
        """DP steps taken, including those of the runs resumed from."""
        self._sync()
        return self._budget.steps

    @property
    def epsilon(self) -> float:
        """The accountant's epsilon at `delta` for all steps taken."""
        self._sync()
        return self._budget.epsilon

    def get_epsilon_and_optimal_order(self) -> Tuple[float, float]:
        self._sync()
        return self._budget.get_epsilon_and_optimal_order()

    @property
    def accountant(self) -> TwiceSamplingRdpAccountant:
        """A copy of the accountant holding every step taken."""
        self._sync()
        return self._budget.accountant

    @property
    def dp_event(self) -> dp_accounting.DpEvent:
        """The composed `DpEvent` of every step taken."""
        self._sync()
        return self._budget.dp_event

    @property
    def stopped_by_budget(self) -> bool:
        """Whether the last `fit` was stopped to stay within the target."""
        return self._stopped_by_budget

    @property
    def stopped_at_max_steps(self) -> bool:
        """Whether the last `fit` stopped because `max_steps` were taken."""
        return self._stopped_at_max_steps

    def epsilon_after(self, extra_steps: int) -> float:
        """Epsilon if `extra_steps` more steps of `event` were taken."""
        self._sync()
        return self._budget.epsilon_after(extra_steps)

    def can_take(self, extra_steps: int = 1) -> bool:
        """Whether `extra_steps` more steps stay within `max_steps` and keep
        epsilon <= target_epsilon."""
        self._sync()
        return self._budget.can_take(extra_steps)

    def remaining_steps(self, limit: int = 10**9) -> Optional[int]:
        """Most further steps within the target and `max_steps` (capped at
        `limit`); None when there is neither."""
        self._sync()
        return self._budget.remaining_steps(limit)

    def reserve_steps(self, count: int = 1) -> None:
        """Write-ahead for custom loops: call BEFORE running `count` steps.

        With `state_path`, the file is written (unless it already covers
        them) charging the `count` steps, and up to `save_every_steps`
        ahead, before any of them runs, as `fit` does: a crash between the
        steps and `record_steps` then over-counts instead of losing them.
        Call `record_steps(count)` after they ran.

            for batch in batches:
                ledger.reserve_steps(1)
                model.train_step(batch)
                ledger.record_steps(1)

        Raises:
          ValueError: the steps would exceed `target_epsilon` or
            `max_steps` (nothing is reserved then).
        """
        count = _validate.integer('count', count, 1)
        with self._charge_lock:
            self._check_loop_event()
            self._sync()
            self._check_custom_loop_model()
            if not self._budget.can_take(count):
                raise ValueError(
                    f'{count} more step(s) would exceed the ledger\'s limits '
                    f'(steps {self._budget.steps}, max_steps '
                    f'{self.max_steps}, target_epsilon '
                    f'{self.target_epsilon}): do not run them.')
            self._budget.reserve_ahead(count)

    def record_steps(self, count: int = 1) -> None:
        """Records `count` steps that happened (custom training loops).

        Steps are recorded even past the target (they happened); check
        `can_take` before running them, and call `reserve_steps` before them
        so that the state file covers them while they run (without it, a
        crash between a step and this call loses the step from the file).
        For a tf_twice DP model this ledger has seen (`set_model` or a
        `fit`), the steps its step keys show are charged and `count` only
        adds what they do not show, so no step is charged twice.
        """
        count = _validate.integer('count', count, 1)
        with self._charge_lock:  # Another thread's steps are not ours.
            self._check_loop_event()
            before = self._budget.steps
            self._sync()
            missing = count - (self._budget.steps - before)
            self._charge_counted(missing)
            # After the charge: recording them is how steps another ledger
            # charged are charged here too.
            self._check_custom_loop_model()

    def _check_loop_event(self) -> None:
        """`fit` checks at its start that the model runs this ledger's
        event and holds no uncharged steps of another; a custom loop's
        every reserve and record does it here (a recompile may have changed
        the model's mechanism)."""
        model = getattr(self, 'model', None)
        if model is not None:
            guards.check_ledger_event(self.event, model)
            step_control.check_no_uncharged_steps_of_other_mechanisms(
                model, self.event)

    def _check_custom_loop_model(self) -> None:
        """`fit` checks at its start that this ledger covers the weights;
        a custom loop's first reserve or record does it here, and every one
        while the ledger is not bound to the model (e.g. after steps of
        another mechanism ran)."""
        model = getattr(self, 'model', None)
        if model is None:
            return
        if self._bound_model is not model:
            self._check_weights_covered()
        if self._loop_checked_model is not model:
            self._loop_checked_model = model
            if (self._verbose and getattr(model, 'key_streams', None)
                    and self._loop_input_checked_model is not model):
                _LOGGER.warning(
                    'PrivacyLedger: %s runs a custom loop, whose input this '
                    'ledger cannot see: its steps are charged as the '
                    'event\'s Poisson-sampled logical batches, so the '
                    'epsilon holds only if every batch given to train_step '
                    'is one of tf_twice.sampling.poisson_batches(...) for '
                    'this config (its n and rate), used once; iterate '
                    'ledger.logical_batches(batches) to have it checked.',
                    model.name)

    def logical_batches(self, batches: Any) -> Iterator[Any]:
        """A custom loop's steps, as `fit` runs them: yields each logical
        batch of ``batches`` after reserving its step, and records it after
        the loop body ran (write-ahead, `reserve_steps`).

            for batch in ledger.logical_batches(poisson_batches(...)):
                model.train_step(batch)

        ``batches`` must be `tf_twice.sampling.poisson_batches` of the
        model's config (its n and q1), checked before the first step as
        `fit` checks its input; the ledger cannot check what a loop gives
        `train_step` otherwise. Stops early when the next step would exceed
        `target_epsilon` or `max_steps`.

        Raises:
          ValueError: no model (`for_model` or `set_model`), a model
            without a config, a model on several replicas (`fit` splits
            each logical batch over them; this loop cannot), or input not
            known to be Poisson-sampled for it.
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
        self._loop_input_checked_model = model
        for batch in batches:
            if not self.can_take(1):
                return
            self.reserve_steps(1)
            yield batch
            self.record_steps(1)

    def get_state(self) -> Dict[str, Any]:
        """The ledger as a JSON-ready dict (`tf_twice.accounting.budget`)."""
        with self._charge_lock:
            self._sync()
            return self._budget.get_state()

    def save(self, path: Optional[str] = None) -> None:
        """Writes the exact state atomically to `path` (or `state_path`)."""
        with self._charge_lock:
            self._sync()
            self._budget.save(path)

    def bind_model(self, model: tf.keras.Model) -> None:
        """Takes `model` as this ledger's and checks, as `fit` does before
        its first step, that this ledger accounts every step its weights
        hold, then binds them to its history: the steps it charged are then
        accounted. A ledger that continues another's history
        (`from_state`) under another mechanism does this to take the steps
        it charged for the weights without training (a ledger that only
        reads, even its state, leaves them to the ledger that goes on).

        Raises:
          ValueError: the weights hold steps this ledger does not account.
        """
        self.set_model(model)
        with self._charge_lock:
            self._charge_drawn_keys()
            self._check_weights_covered()

    # --- Keras hooks ------------------------------------------------------

    def _steps_per_execution(self) -> int:
        return _keras.steps_per_execution(self.model)

    def _sync(self) -> None:
        """Charges the steps the model's step keys show it ran since the
        last charge, so that no reading of the ledger (its steps, epsilon,
        state or a saved copy) misses a step that ran, e.g. the step whose
        `on_train_batch_end` an exception in an earlier callback cut off,
        read before the next `fit`."""
        if getattr(self, 'model', None) is not None:
            self._charge_drawn_keys()

    def _check_weights_covered(self) -> None:
        """Refuses a model whose weights hold steps this ledger does not
        account; binds the weights to this ledger's history if not."""
        with self._charge_lock:
            step_control.check_weights_covered(
                self.model, self._budget.steps, self.event)
            ledger_binding.bind(self.model, self._budget)
            self._bound_model = self.model
            self._drawn_steps.mark_accounted(self.event)

    def _charge_drawn_keys(self, in_fit: bool = False) -> bool:
        """Charges the steps of this ledger's event that a tf_twice DP model
        ran since the last charge (`step_control.DrawnStepCounter`); False
        for a model without step keys.

        Steps of another mechanism (a DP optimizer replaced by a recompile,
        even one recompiled back since) are never charged as this event:
        their streams stay unaccounted for a ledger of their own event, and
        the weights' check refuses this ledger more steps until one is.

        Raises:
          ValueError: ``in_fit`` (a hook of a `fit` this ledger watches) and
            steps ran under another mechanism than this ledger's event: it
            cannot charge them, so training must not go on.
        """
        with self._charge_lock:
            drawn = self._drawn_steps.new_steps(
                self.model, self.event,
                bound=self._bound_model is not None
                and self._bound_model is self.model)
            if drawn is None:
                return False
            self._charge_counted(drawn.of_event)
            if drawn.of_other_events:
                self._bound_model = None
                message = (
                    f'PrivacyLedger: {drawn.of_other_events} step(s) of '
                    f'{self.model.name} ran under another mechanism than this '
                    'ledger\'s event; not charged here: this ledger\'s '
                    'epsilon does not cover them. With the model compiled '
                    'with that optimizer, PrivacyLedger.from_state('
                    'ledger.get_state(), event=model.dp_event()) charges '
                    'them once it binds the model (bind_model(model), a fit '
                    'or a custom loop) and composes them with this '
                    'ledger\'s steps.')
                if in_fit:
                    self.model.stop_training = True
                    raise ValueError(
                        f'{message} The mechanism changed during a fit this '
                        'ledger watches, which would leave its steps and '
                        'limits behind the weights: training stopped.')
                _LOGGER.warning(message)
            return True

    def _stop(self, k: int) -> None:
        self.model.stop_training = True
        budget = self._budget
        max_steps = budget.max_steps
        if max_steps is not None and budget.steps + k > max_steps:
            if self._verbose and not self._stopped_at_max_steps:
                # The plan's normal end: information, not a warning.
                _LOGGER.info('PrivacyLedger: stopping training after the '
                             'planned %d steps (max_steps).', budget.steps)
            self._stopped_at_max_steps = True
            return
        if not self._stopped_by_budget and self._verbose:
            _LOGGER.warning(
                'PrivacyLedger: stopping training after %d steps: %d more '
                'step(s) would raise epsilon from %.4g to %.4g > '
                'target_epsilon %.4g (delta %g).', budget.steps, k,
                budget.epsilon, budget.epsilon_after(k),
                budget.target_epsilon, budget.delta)
        self._stopped_by_budget = True

    def on_train_begin(self, logs=None):
        # Refused before any step runs, so nothing is charged for them.
        guards.check_no_example_mixing(self.model)
        guards.check_ledger_event(self.event, self.model)
        step_control.unblock_train_function(self.model)
        self._stopped_by_budget = False
        self._stopped_at_max_steps = False
        # Steps that ran unseen since the last hook (an interrupted fit, a
        # custom loop) are charged now.
        self._charge_drawn_keys()
        self._check_weights_covered()
        # Again before the first step: a callback after this one (e.g.
        # BackupAndRestore) may restore a checkpoint in its on_train_begin.
        self._weights_checked = False
        keys = getattr(getattr(self.model, 'aggregator', None), 'keys', None)
        if getattr(keys, 'seeded', False) and self._verbose:
            _LOGGER.warning(
                'PrivacyLedger: the model\'s masks and noise are SEEDED. The '
                'epsilon holds only if the seed is secret and used for this '
                'one run: the same seed on the same weights gives the same '
                'noise, and two releases with the same noise reveal their '
                'noise-free difference. Leave seed=None for a release.')

    def on_train_batch_begin(self, batch, logs=None):
        if not self._weights_checked:
            self._check_weights_covered()
            self._weights_checked = True
        k = self._steps_per_execution()
        if not self.can_take(k):
            self._stop(k)
            step_control.block_train_function(self.model)
            return
        self._budget.reserve_ahead(k)
        if not getattr(self.model, 'key_streams', None):
            # A model without step keys: its k steps are charged now,
            # before they run (a final execution that runs fewer is
            # charged whole).
            self._charge_counted(k)

    def on_train_batch_end(self, batch, logs=None):
        self._charge_drawn_keys(in_fit=True)
        k = self._steps_per_execution()
        if not self.can_take(k):
            self._stop(k)

    def _charge_counted(self, executed: int) -> None:
        if executed > 0:
            with self._charge_lock:
                self._budget.charge(executed)
                model = self._bound_model
                if model is not None and model is getattr(self, 'model',
                                                          None):
                    # Weights reloaded or charged by another ledger since
                    # the last charge are refused, never rebound.
                    ledger_binding.bind(model, self._budget)

    def on_epoch_end(self, epoch, logs=None):
        self._charge_drawn_keys()
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
        self._charge_drawn_keys()
        step_control.unblock_train_function(self.model)
        self._budget.write()
        if self._writer is not None:
            self._writer.flush()
