"""Steps seen from outside `fit`: which ran, and keeping the next from running.

`PrivacyLedger` decides *when* steps are charged and stopped; this module
tells it *how many* ran, whether the weights hold steps it never saw, and
how to keep a step from running:

* `DrawnStepCounter` reads the model's step-key streams
  (`tf_twice.mechanism.step_keys.StepKeys`): one key is drawn per logical
  step and no restore or `fit` call rewinds the count, so the draws since
  the last reading are exactly the steps that ran, also those of a `fit`
  cut off by an exception or of a custom loop over `train_step`; each
  stream's event says which mechanism they ran.
* `check_weights_covered` compares the optimizer's step count (restored
  with a checkpoint) and the keys drawn in this process with the steps
  charged: more of either means the weights hold steps this ledger never
  accounted.
* `block_train_function` swaps `model.train_function` for a no-op, because
  Keras ignores `model.stop_training` set before a step (e.g. a resumed run
  with no budget left for even one step); `unblock_train_function` restores
  it.
"""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional

import dp_accounting
import numpy as np
import tensorflow as tf

from tf_twice import _keras

__all__ = ['DrawnStepCounter', 'DrawnSteps', 'block_train_function',
           'check_no_uncharged_steps_of_other_mechanisms',
           'check_weights_covered', 'unblock_train_function']

_BLOCKED_NAME = 'blocked_train_function'


class DrawnSteps(NamedTuple):
    """Steps a model ran since the last reading, by mechanism."""
    of_event: int  # Steps of the reader's event: it must charge them.
    of_other_events: int  # Steps of streams of another mechanism.


class DrawnStepCounter:
    """Counts the steps a tf_twice DP model drew keys for since last asked.

    Every step-key stream of the model (``DPModel.key_streams``: those of DP
    optimizers replaced by a recompile, then the current one) and every
    stream seen before is read, so no stream's steps are lost; streams are
    held strongly because a replaced stream's uncounted steps must still be
    read. Each stream carries the event of the steps drawn from it
    (``StepKeys.event``): only streams of the reader's event count as its
    steps, so steps of a replaced DP optimizer are never charged as the
    mechanism the model runs when the ledger is read. The streams of the
    counter's first sight start where the charges of earlier ledgers end
    (``StepKeys.accounted_draws``): steps that ran before any ledger saw
    the model (a ``fit`` without a ledger, a custom loop) are counted, steps
    another ledger charged are not; a stream seen later starts at 0 (it can
    only over-charge).
    """

    def __init__(self):
        # id(stream) -> [stream, draws already counted, exempt draws seen].
        self._counted: Dict[int, List[Any]] = {}

    def new_steps(self, model: tf.keras.Model,
                  event: dp_accounting.DpEvent, *,
                  bound: bool) -> Optional[DrawnSteps]:
        """Steps `model` ran since the last call; None without step keys.

        The caller must charge the returned ``of_event`` steps. If it is
        ``bound`` to the model (its ledger accounts the weights,
        `ledger_binding`), they are marked as accounted on their streams;
        a ledger that only reads does not mark them (`mark_accounted` does
        once it binds), so a ledger built just to look at a model's epsilon
        does not make its steps another ledger's to report. Steps of other
        events are left unaccounted, for a ledger of their own event. Calls
        from several threads must be serialised, with the charge
        (`PrivacyLedger` holds its charge lock): then each drawn step is
        returned by exactly one call.

        Raises:
          ValueError: a stream holds steps marked unverified (a `fit`
            without a ledger on input not known to be Poisson-sampled): the
            accountant's epsilon does not bound them and the weights keep
            them.
        """
        streams = getattr(model, 'key_streams', None)
        if not streams:
            return None
        first_sight = not self._counted
        for keys in streams:
            if id(keys) not in self._counted:
                # A stream seen later counts from 0, its audit trials too
                # (they are subtracted below).
                start, exempt = ((min(keys.draws,
                                      getattr(keys, 'accounted_draws', 0)),
                                  _exempt(keys)) if first_sight else (0, 0))
                self._counted[id(keys)] = [keys, start, exempt]
        for keys, _, _ in self._counted.values():
            marked = getattr(keys, 'unverified_from', None)
            if marked is not None and keys.draws > marked:
                raise ValueError(
                    f'{keys.draws - marked} step(s) of this model ran on '
                    'input that was not checked to be Poisson-sampled (a fit '
                    'without a PrivacyLedger on fixed-size or shuffled '
                    'batches): the accountant\'s epsilon is not a bound for '
                    'them, and the weights keep them, so this ledger cannot '
                    'account the model. Train from a fresh model with '
                    'fit(poisson_batches(...), callbacks=[ledger]).')
        of_event = of_other_events = 0
        for entry in self._counted.values():
            keys, counted, exempt_seen = entry
            # Read once: a step finishing on another thread between two
            # reads would be marked counted without being returned.
            draws, exempt = keys.draws, _exempt(keys)
            # An audit's trials since the last reading are not steps the
            # weights hold (never below 0: counting them is safe).
            executed = max(0, draws - counted - (exempt - exempt_seen))
            entry[1], entry[2] = draws, exempt
            if keys.event == event:
                of_event += executed
            else:
                of_other_events += executed
        if bound:
            self.mark_accounted(event)
        return DrawnSteps(of_event, of_other_events)

    def mark_accounted(self, event: dp_accounting.DpEvent) -> None:
        """Marks the draws counted so far on streams of ``event`` as
        accounted: the ledger that counted them now accounts the weights,
        so a ledger seeing these streams for the first time does not charge
        them again, and one of another event no longer refuses them."""
        for keys, counted, _ in self._counted.values():
            if keys.event == event:
                keys.accounted_draws = max(
                    getattr(keys, 'accounted_draws', 0), counted)


def _exempt(keys: Any) -> int:
    return getattr(keys, 'exempt_draws', 0)


def check_no_uncharged_steps_of_other_mechanisms(
        model: tf.keras.Model, event: dp_accounting.DpEvent) -> None:
    """Refuses a ledger of ``event`` while ``model``'s weights hold steps
    of another mechanism that no ledger has charged.

    Step counts alone cannot show them: a ledger that charged more steps
    than ran (a write-ahead reservation a crash left, a resumed state file)
    has room for them. Their streams say which mechanism ran them.
    """
    uncharged = sum(
        max(0, keys.draws - getattr(keys, 'accounted_draws', 0))
        for keys in getattr(model, 'key_streams', None) or ()
        if keys.event != event)
    if uncharged:
        raise ValueError(
            f'{uncharged} step(s) of another mechanism (a DP optimizer '
            f'replaced since) ran on {model.name} and no ledger has '
            'charged them for the weights (a ledger that only read them, '
            'its epsilon or its state, has not); this ledger cannot account '
            'them, nor more steps of these weights. Charge them under their '
            'own event first: '
            'with the model compiled with that optimizer, '
            'PrivacyLedger.from_state(ledger.get_state(), '
            'event=model.dp_event()) composes them with this ledger\'s '
            'steps once it binds the model (bind_model(model), a fit or a '
            'custom loop).')


def check_weights_covered(model: tf.keras.Model, charged: int,
                          event: dp_accounting.DpEvent) -> None:
    """Refuses a DP model whose optimizer took more steps than `charged`.

    Within a process the step keys show every step; across processes only
    the state file does, and a checkpoint restores the optimizer's step
    count with the weights. More optimizer steps than charged steps means
    the weights hold steps the ledger never charged: a stale copy of the
    state file, another file, or a checkpoint trained beside another ledger.
    Its epsilon would not bound what the weights reveal. Within a process
    the model's step keys show every DP step it ran, also those of an
    optimizer a recompile replaced (whose step count the new optimizer
    does not carry): more steps drawn than charged means another ledger
    charged them. A plain Keras model's steps are the caller's to vouch
    for.
    """
    streams = getattr(model, 'key_streams', None)
    if not streams:
        return
    check_no_uncharged_steps_of_other_mechanisms(model, event)
    # An audit's trials drew keys, but their weights were restored.
    drawn = sum(keys.draws - _exempt(keys) for keys in streams)
    if drawn > charged:
        raise ValueError(
            f'{model.name} has run {drawn} DP steps in this process, but this '
            f'PrivacyLedger has charged only {charged}: the weights hold '
            f'{drawn - charged} step(s) it did not charge, charged by another '
            'ledger (e.g. before a recompile with a fresh optimizer) or run '
            'under another mechanism (a DP optimizer a recompile replaced). '
            'Keep training under the ledger that charged them or load its '
            'state file; to go on under another mechanism, continue that '
            'ledger\'s history (PrivacyLedger.from_state(other.get_state(), '
            'event=model.dp_event())); steps of this '
            'ledger\'s event can be charged here first with '
            f'ledger.record_steps({drawn - charged}).')
    iterations = getattr(getattr(model, 'optimizer', None), 'iterations',
                         None)
    if iterations is None:
        return
    # .numpy() reads a MirroredVariable too (np.asarray does not).
    taken = int(np.asarray(iterations.numpy() if hasattr(
        iterations, 'numpy') else iterations))
    if taken > charged:
        raise ValueError(
            f'{model.name}\'s optimizer has taken {taken} steps, but this '
            f'PrivacyLedger has charged only {charged}: the weights hold '
            f'{taken - charged} step(s) no ledger accounted here (a stale '
            'or another state file beside a newer checkpoint?). Load the '
            'state file that was written with these weights; if the steps '
            'ran under this event and are accounted nowhere, charge them '
            f'first with ledger.record_steps({taken - charged}); if they '
            'trained on public data only, compile with a fresh optimizer.')


def block_train_function(model: tf.keras.Model) -> None:
    """Makes `fit`'s next calls of `model.train_function` no-ops."""
    if getattr(model.train_function, '__name__', '') == _BLOCKED_NAME:
        return
    original = model.train_function

    def blocked_train_function(unused_iterator):
        # No step, no weight update, nothing read from the data; the logs
        # keep their keys (metrics as they stand).
        return _keras.metric_results(model)

    blocked_train_function.original = original
    model.train_function = blocked_train_function
    # Keras reads the metrics again at the epoch's end: those that no step
    # has built (Keras 3, before the first step) have no result.
    model.get_metrics_result = lambda: _keras.metric_results(model)


def unblock_train_function(model: tf.keras.Model) -> None:
    """Undoes `block_train_function` (nothing if it was not blocked)."""
    current = getattr(model, 'train_function', None)
    original = getattr(current, 'original', None)
    if original is not None and getattr(current, '__name__',
                                        '') == _BLOCKED_NAME:
        model.train_function = original
    if 'get_metrics_result' in vars(model):
        del model.get_metrics_result  # The class's method again.
