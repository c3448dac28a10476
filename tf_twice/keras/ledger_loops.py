"""`PrivacyLedger`'s custom-loop API: the write-ahead and checks that `fit`'s
hooks give a `fit`, for loops that call `train_step` themselves.

    for batch in ledger.logical_batches(poisson_batches(...)):
        model.train_step(batch)

or, around steps whose input the ledger cannot see, `reserve_steps(k)`
before them and `record_steps(k)` after them.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

from tf_twice import _validate
from tf_twice.keras import guards
from tf_twice.keras import privacy_record

__all__ = ['CustomLoops']

_LOGGER = logging.getLogger('tf_twice.keras.ledger')


class CustomLoops:
    """A mixin of `PrivacyLedger` (its `_budget`, `_sync`, `_charge` and
    `_charge_lock`): its methods for custom training loops."""

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
            mark, record = self._loop_mark, privacy_record.read(
                getattr(self, 'model', None))
            if mark is None or record is None:  # This call's reading only.
                shown = self._record_charged - charged_before
            else:
                shown = min(self._record_charged,
                            max(0, record.steps - mark.steps))
            self._charge(count - shown)
            self._mark_loop()

    def _mark_loop(self) -> None:
        self._loop_mark = privacy_record.read(getattr(self, 'model', None))
        self._record_charged = 0

    def _check_custom_loop(self, watch: bool = False) -> None:
        """What `fit` checks at its start, for a custom loop's every
        reserve and record (a recompile may have changed the mechanism):
        the model runs this ledger's event and its record is accounted."""
        model = getattr(self, 'model', None)
        if model is None:
            return
        guards.check_ledger_event(self.event, model)
        self._sync(watch=watch)
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
