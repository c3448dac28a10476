"""The framework-free half of `tf_twice.keras.PrivacyLedger`: a budget
charged from the record of the steps a model's weights hold.

`StepLedger` applies the ledger's one rule (`step_record.steps_to_charge`)
to the record its subclass reads from the model (`_model_record`), charges
the steps it adds to a `PrivacyBudget` (the state and its write-ahead file),
remembers the record it accepted, decides when training must stop, and keeps
the custom loops' write-ahead arithmetic (`reserve_steps`, `record_steps`).
The Keras callback adds what needs Keras: the hooks that read the record
around every execution of `fit`, the train function it blocks, the checks of
the model. TF-free, so every use of the rule is tested without TensorFlow.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Dict, Optional, Tuple

import dp_accounting

from tf_twice import _validate
from tf_twice.accounting import budget as budget_lib
from tf_twice.accounting import step_record

__all__ = ['BudgetView', 'StepLedger']

# The logger of the ledger users meet (`tf_twice.keras.ledger`).
_LOGGER = logging.getLogger('tf_twice.keras.ledger')


class BudgetView:
    """The budget's attribute `name` (a method is bound to it), read after
    charging the steps the model's record adds (unless not `sync`), so no
    reading misses a step that ran (`PrivacyBudget` documents each)."""

    def __init__(self, name: str, sync: bool = True):
        self._name, self._sync = name, sync

    def __get__(self, ledger, owner=None):
        if ledger is None:
            return self
        if self._sync:
            ledger._sync(strict=False)  # pylint: disable=protected-access
        return getattr(ledger.budget, self._name)


class StepLedger:
    """A `PrivacyBudget` charged from a model's step record; the base of
    `tf_twice.keras.PrivacyLedger`, which documents the arguments.

    A subclass gives `_model_record` (the model and its record) and may
    extend `_check_custom_loop`."""

    def _setup(self, budget: budget_lib.PrivacyBudget, *,
               verbose: int) -> None:
        self._budget = budget
        self._verbose = int(verbose)
        # Reading a record and charging its steps are one step for readers
        # on other threads: none sees steps read but not yet charged.
        self._charge_lock = threading.RLock()
        # (model, record) this ledger accepted last: steps that extend it
        # by this ledger's event ran while it watched (`step_record`).
        self._accepted: Tuple[Any, Optional[step_record.Record]] = (None,
                                                                     None)
        # A custom loop's record at its last reserve or record, and the
        # steps charged since: record_steps adds only what they miss.
        self._loop_mark: Optional[step_record.Record] = None
        self._record_charged = 0
        # Whether a fit opted in to steps on unchecked input (recorded so,
        # charged as the event: `allow_non_poisson_input`).
        self._unchecked_input_watched = False
        self._stopped_by_budget = False
        self._stopped_at_max_steps = False

    def _log_resumed(self) -> None:
        if not (self._budget.resumed and self._verbose):
            return
        _LOGGER.warning('PrivacyLedger: resumed %d steps from %s (epsilon '
                        '%.4g at delta %g).', self.steps, self.state_path,
                        self.epsilon, self.delta)
        history = self._budget.history()
        if history[-1][0] != self._budget.event_key:
            # Sound (composed), but rarely what a resume meant to do.
            _LOGGER.warning(
                'PrivacyLedger: the steps resumed from %s ran another '
                'mechanism than this ledger\'s event; both are accounted, '
                'composed (%d segment(s) so far).', self.state_path,
                len(history))

    def _model_record(self) -> Tuple[Any, Optional[step_record.Record]]:
        """The model this ledger accounts and its record (None: a model
        without one, whose steps are charged as they start)."""
        return None, None

    # --- the budget -------------------------------------------------------

    @property
    def budget(self) -> budget_lib.PrivacyBudget:
        """The TF-free state this ledger charges (steps, epsilon, file)."""
        return self._budget

    @property
    def event(self) -> dp_accounting.DpEvent:
        """The `DpEvent` of one step of the current run."""
        return self._budget.event

    delta = BudgetView('delta', sync=False)
    target_epsilon = BudgetView('target_epsilon', sync=False)
    orders = BudgetView('orders', sync=False)
    max_steps = BudgetView('max_steps', sync=False)
    state_path = BudgetView('state_path', sync=False)
    steps = BudgetView('steps')  # Resumed steps included.
    epsilon = BudgetView('epsilon')  # At `delta`, for every step taken.
    accountant = BudgetView('accountant')  # A copy holding every step.
    dp_event = BudgetView('dp_event')  # The composed event of every step.
    epsilon_after = BudgetView('epsilon_after')  # With k more steps.
    can_take = BudgetView('can_take')  # k more within both limits?
    remaining_steps = BudgetView('remaining_steps')  # Most within both.
    get_epsilon_and_optimal_order = BudgetView(
        'get_epsilon_and_optimal_order')

    @property
    def verbose(self) -> int:
        """0: no messages logged (on stopping, loading, attaching)."""
        return self._verbose

    @property
    def stopped_by_budget(self) -> bool:
        """Whether the last `fit` was stopped to stay within the target."""
        return self._stopped_by_budget

    @property
    def stopped_at_max_steps(self) -> bool:
        """Whether the last `fit` stopped because `max_steps` were taken."""
        return self._stopped_at_max_steps

    def get_state(self) -> Dict[str, Any]:
        """The ledger as a JSON-ready dict (`tf_twice.accounting.budget`)."""
        with self._charge_lock:
            self._sync(strict=False)
            return self._budget.get_state()

    def save(self, path: Optional[str] = None) -> None:
        """Writes the exact state atomically to `path` (or `state_path`)."""
        with self._charge_lock:
            self._sync(strict=False)
            self._budget.save(path)

    # --- the rule ---------------------------------------------------------

    def _sync(self, *, watch: bool = False, strict: bool = True) -> None:
        """Charges the steps the model's record adds to what this ledger
        accepted (`step_record.steps_to_charge`), so that no reading of the
        ledger misses a step that ran.

        The record is accepted (later steps extend it) when it adds steps
        or when steps start (``watch``: before a `fit` execution, a custom
        loop's `reserve_steps`), not by a reading before weights are loaded.

        Raises:
          ValueError: the record names steps this ledger cannot account. A
            reading (not ``strict``: `steps`, `epsilon`, `get_state`...)
            logs it instead, so the state can still be read and saved.
        """
        with self._charge_lock:  # The record read is the one charged.
            model, record = self._model_record()
            if record is None:
                return
            accepted_model, accepted = self._accepted
            history = ((step_record.event_words(key), count)
                       for key, count in self._budget.history())
            charge = step_record.steps_to_charge(
                history, accepted if accepted_model is model else None,
                record, step_record.event_words(self._budget.event_key),
                watched_words=([step_record.UNCHECKED_INPUT]
                               if self._unchecked_input_watched else []))
            if charge is None:
                message = step_record.refusal(
                    getattr(model, 'name', 'the model'), record,
                    self._budget.steps)
                if strict:
                    raise ValueError(message)
                if self._verbose:
                    _LOGGER.warning('%s This ledger\'s epsilon does not '
                                    'bound them.', message)
                return
            self._charge(charge)
            self._record_charged += charge
            if charge or watch:
                self._accepted = (model, record)

    def _charge(self, steps: int) -> None:
        if steps > 0:
            self._budget.charge(steps)

    def watch_unchecked_input(self, watch: bool = True) -> None:
        """Called by `DPModel.fit(allow_non_poisson_input=True)` on input
        that is not Poisson (and with False when it ends): this fit's
        steps, recorded as on unchecked input, are charged as the event
        (its epsilon does not hold for them, as that fit warns); no other
        ledger accepts them later."""
        self._unchecked_input_watched = bool(watch)

    def _note_stop(self, k: int) -> None:
        """Records (and logs once) why training stops before `k` more
        steps: `max_steps` reached, or the target would be exceeded."""
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

    # --- custom loops -----------------------------------------------------

    def reserve_steps(self, count: int = 1) -> None:
        """Write-ahead for custom loops: call BEFORE running `count` steps
        (the file then charges them, and up to `save_every_steps` ahead,
        as `fit` does), and `record_steps(count)` after they ran.

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
            self._check_custom_loop(watch=True)
            self._mark_loop()  # The loop's steps start here.
            if not self._budget.can_take(count):
                raise ValueError(
                    f'{count} more step(s) would exceed the ledger\'s limits '
                    f'(steps {self._budget.steps}, max_steps '
                    f'{self.max_steps}, target_epsilon '
                    f'{self.target_epsilon}): do not run them.')
            self._budget.reserve_ahead(count)

    def record_steps(self, count: int = 1) -> None:
        """Records `count` steps that happened (custom training loops), even
        past the target (check `can_take` and call `reserve_steps` first).
        For a DP model the steps its record added since the last reserve or
        record, and a reading charged (this call's or another's), count
        towards `count`, so no step is charged twice.
        """
        count = _validate.integer('count', count, 1)
        with self._charge_lock:  # Another thread's steps are not ours.
            charged_before = self._record_charged
            self._check_custom_loop()
            mark, record = self._loop_mark, self._model_record()[1]
            if mark is None or record is None:  # This call's reading only.
                shown = self._record_charged - charged_before
            else:
                shown = min(self._record_charged,
                            max(0, record.steps - mark.steps))
            self._charge(count - shown)
            self._mark_loop()

    def _mark_loop(self) -> None:
        self._loop_mark = self._model_record()[1]
        self._record_charged = 0

    def _check_custom_loop(self, watch: bool = False) -> None:
        """What a custom loop's every reserve and record checks: the
        model's record is accounted (the Keras ledger also checks the
        model, as `fit` does at its start)."""
        self._sync(watch=watch)
