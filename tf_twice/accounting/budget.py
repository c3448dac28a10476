"""The privacy ledger's state, without TensorFlow: steps charged, their
epsilon, and the write-ahead state file.

`PrivacyBudget` composes DP steps in a `TwiceSamplingRdpAccountant` and keeps
them as segments (one event, a count). `tf_twice.keras.PrivacyLedger` is a
Keras callback over it; custom loops and other frameworks can use it alone.

Write-ahead: with `state_path`, `reserve_ahead(k)` writes the file BEFORE k
steps run, charging `save_every_steps` steps ahead (never past the target or
`max_steps`), and `charge`/`write` write the exact count after. A crash
therefore over-counts by at most `save_every_steps` steps and never
under-counts. Writes are atomic (`tf_twice._files.atomic_write_json`), so a
crash mid-write leaves the previous file. An existing `state_path` is always
loaded: the privacy spent cannot be reset by a setting, only by choosing a
new file. Steps of another event (new noise, new q1) are composed with the
file's, never replace them.

Epsilon is RDP arithmetic on the segments: RDP composes additively
(Mironov 2017, arXiv:1702.07476, Prop. 1), so the curve of the steps
charged, with k more of `event`, is sum_i count_i * rdp(event_i), converted
with dp_accounting's `compute_epsilon` as the accountant itself does.

State file: `tf_twice.accounting.ledger_state`.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence
from typing import Tuple

import dp_accounting
import numpy as np

from tf_twice import _files as files
from tf_twice import _validate
from tf_twice.accounting import conversion as conversion_lib
from tf_twice.accounting import ledger_state
from tf_twice.accounting.accountant import TwiceSamplingRdpAccountant
# The state file's format, kept importable from here as before.
from tf_twice.accounting.ledger_state import STATE_FORMAT
from tf_twice.accounting.ledger_state import STATE_VERSION
from tf_twice.accounting.ledger_state import check_state_path
from tf_twice.accounting.ledger_state import event_from_json
from tf_twice.accounting.ledger_state import event_to_json

__all__ = ['PrivacyBudget', 'STATE_FORMAT', 'STATE_VERSION',
           'check_state_path', 'event_from_json', 'event_to_json']


def _largest_fitting(fits: Callable[[int], bool], limit: int) -> int:
    """The largest k in [0, limit] with fits(k), for `fits` true up to some
    k and false after: doubling, then one bisection (O(log k) calls)."""
    if limit == 0:
        return 0
    low, high = 0, 1  # fits(low) or low == 0; high not yet known.
    while fits(high):
        if high == limit:
            return limit
        low, high = high, min(2 * high, limit)
    while high - low > 1:  # fits(low) or low == 0; not fits(high).
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


class PrivacyBudget:
    """DP steps charged, their epsilon at `delta`, and their state file.

    Args:
      event: the `DpEvent` of ONE step, normally a
        `TwiceSampledGaussianDpEvent`; any event the
        `TwiceSamplingRdpAccountant` supports.
      delta: in (0, 1).
      target_epsilon: None or in (0, inf): `can_take` refuses steps that
        would exceed it.
      max_steps: None or an integer >= 0: `can_take` refuses steps past
        that total (loaded steps included).
      state_path: None or a JSON file, loaded if it exists.
      save_every_steps: >= 1, how many steps each write-ahead charges.
      orders: RDP orders; default: the state file's, else the accountant's.

    Raises:
      ValueError: an argument outside its range, an event the accountant
        cannot compose, a state_path that cannot be written, or an
        unreadable state file.
    """

    def __init__(self,
                 event: dp_accounting.DpEvent,
                 delta: float,
                 *,
                 target_epsilon: Optional[float] = None,
                 max_steps: Optional[int] = None,
                 state_path: Optional[str] = None,
                 save_every_steps: int = 10,
                 orders: Optional[Sequence[float]] = None):
        history = None
        if state_path is not None:
            state_path = check_state_path(state_path)
            if os.path.exists(state_path):
                history = ledger_state.read_state(state_path)
        self._setup(event, delta, target_epsilon=target_epsilon,
                    max_steps=max_steps, save_every_steps=save_every_steps,
                    orders=orders, history=history)
        self._state_path = state_path
        self.resumed = history is not None  # Loaded from `state_path`.

    @classmethod
    def from_state(cls, state: Mapping[str, Any], *,
                   event: Optional[dp_accounting.DpEvent] = None,
                   delta: Optional[float] = None,
                   target_epsilon: Optional[float] = None,
                   max_steps: Optional[int] = None,
                   state_path: Optional[str] = None,
                   save_every_steps: int = 10,
                   orders: Optional[Sequence[float]] = None
                   ) -> 'PrivacyBudget':
        """A budget that continues from `state` (a `get_state()` dict).

        `event`, `delta`, `target_epsilon` and `orders` default to the
        state's (event: its last segment's). `state_path`, if given, must not
        exist yet: its ledger would be lost otherwise.
        """
        if not isinstance(state, Mapping):
            raise ValueError('state must be a dict from get_state(); got '
                             f'{type(state).__name__}.')
        if event is None:
            segments = ledger_state.parse_segments(state)
            if not segments:
                raise ValueError('event is required: the state has no steps '
                                 'to take it from.')
            event = segments[-1][0]
        if state_path is not None:
            state_path = check_state_path(state_path)
            if os.path.exists(state_path):
                raise ValueError(
                    f'state_path={state_path!r} already holds a ledger; load '
                    'it with PrivacyLedger(event, delta, state_path=...) so '
                    'neither is lost.')
        budget = cls.__new__(cls)
        budget._setup(
            event, state.get('delta') if delta is None else delta,
            target_epsilon=(state.get('target_epsilon')
                            if target_epsilon is None else target_epsilon),
            max_steps=max_steps, save_every_steps=save_every_steps,
            orders=orders, history=state)
        budget._state_path = state_path
        budget._disk_steps = 0  # Nothing on disk yet.
        budget.resumed = False
        return budget

    def _setup(self, event, delta, *, target_epsilon, max_steps,
               save_every_steps, orders, history):
        if not isinstance(event, dp_accounting.DpEvent):
            raise ValueError('event must be a dp_accounting DpEvent (one DP '
                             'step, e.g. TwiceSampledGaussianDpEvent); got '
                             f'{type(event).__name__}.')
        self._delta = _validate.probability('delta', delta)
        self._target = (None if target_epsilon is None else
                        _validate.positive('target_epsilon', target_epsilon))
        self._max_steps = (None if max_steps is None else
                           _validate.integer('max_steps', max_steps, 0))
        self._save_every = _validate.integer('save_every_steps',
                                             save_every_steps, 1)
        segments = []
        if history is not None:
            segments = ledger_state.parse_segments(history)
            if orders is None and history.get('orders'):
                orders = history['orders']
        self._orders = TwiceSamplingRdpAccountant(orders).orders
        self._event = event
        self._key = ledger_state.event_key(event)  # Fails if unstorable.
        # Per event key, the event the key names and one step's RDP curve;
        # `_rdp_after` composes them.
        self._steps_of: Dict[str, Tuple[dp_accounting.DpEvent,
                                        np.ndarray]] = {}
        self._step_of(self._key)  # Refuses an unsupported event.
        self._segments: List[List[Any]] = []  # [key, event, count]
        self._steps = 0
        # A monitor thread may save or read the state while training charges
        # and writes ahead: each change and each write is one step.
        self._lock = threading.RLock()
        for past_event, count in segments:
            self.compose(past_event, count)
        self._disk_steps = self._steps  # Steps the state file charges.
        # Steps reserve_ahead announced that have not been charged yet: they
        # may be running, so no write may charge less than them.
        self._running = 0

    # --- accounting -------------------------------------------------------

    def _step_of(self, key: str) -> Tuple[dp_accounting.DpEvent,
                                          np.ndarray]:
        """(event, one step's RDP) of the event `key` names, rebuilt from the
        key as a state file stores it: every event of one key, in memory or
        loaded, is charged the same curve, in float64 (dp_accounting may
        compute an event holding numpy float32 fields in float32: up to 1e-5
        lower, relative, with NumPy 2)."""
        if key not in self._steps_of:
            event = ledger_state.event_from_json(json.loads(key))
            step = TwiceSamplingRdpAccountant(self._orders)
            if not step.supports(event):
                raise ValueError(
                    f'event {event} cannot be composed by '
                    'TwiceSamplingRdpAccountant (note that '
                    'TwiceSampledGaussianDpEvent must not be wrapped in '
                    'PoissonSampledDpEvent).')
            self._steps_of[key] = (event, step.compose(event, 1).rdp)
        return self._steps_of[key]

    def compose(self, event: dp_accounting.DpEvent, count: int) -> None:
        """Adds `count` >= 0 steps of `event` (in memory only)."""
        count = _validate.integer('count', count, 0)
        with self._lock:
            key = (self._key if event is self._event
                   else ledger_state.event_key(event))
            self._step_of(key)
            if key != self._key:
                # The file's segments lack this event: the next charge or
                # reserve_ahead must write, whatever the step counts say.
                self._disk_steps = -1
            if self._segments and self._segments[-1][0] == key:
                self._segments[-1][2] += count
            else:
                self._segments.append([key, event, count])
            self._steps += count

    @property
    def event(self) -> dp_accounting.DpEvent:
        """The `DpEvent` of one step of the current run."""
        return self._event

    @property
    def delta(self) -> float:
        return self._delta

    @property
    def target_epsilon(self) -> Optional[float]:
        return self._target

    @property
    def max_steps(self) -> Optional[int]:
        return self._max_steps

    @property
    def orders(self) -> np.ndarray:
        return self._orders.copy()

    @property
    def state_path(self) -> Optional[str]:
        return self._state_path

    @property
    def steps(self) -> int:
        """Steps charged, including those loaded."""
        return self._steps

    def history(self, extra_steps: int = 0) -> List[Tuple[str, int]]:
        """The steps charged as (event_key, count) segments, in order, then
        `extra_steps` more of `event` if any."""
        with self._lock:
            keyed = [(key, count) for key, _, count in self._segments]
        if extra_steps:
            keyed.append((self._key, extra_steps))
        return keyed

    @property
    def event_key(self) -> str:
        """`ledger_state.event_key` of `event`."""
        return self._key

    @property
    def accountant(self) -> TwiceSamplingRdpAccountant:
        """A new accountant holding every step charged, segment by segment
        (its RDP is this ledger's: bit for bit for one-step events such as
        `TwiceSampledGaussianDpEvent`, up to rounding for composed ones)."""
        accountant = TwiceSamplingRdpAccountant(self._orders)
        for key, count in ledger_state.merge_segments(self.history()):
            accountant.compose(self._step_of(key)[0], count)
        return accountant

    @property
    def dp_event(self) -> dp_accounting.DpEvent:
        """The composed `DpEvent` of every step charged."""
        return self.accountant.ledger

    def _rdp_after(self, extra_steps: int) -> np.ndarray:
        """sum_i count_i * rdp_i over the segments, `extra_steps` more of
        `event` joining its run: a function of the step counts, not of how
        they were charged, so a live ledger, the same ledger loaded from its
        file, and a calibration (steps * rdp) agree bit for bit. (Summing a
        step at a time drifted by rounding: a run calibrated to within 1e-15
        of its target was stopped one step short.)"""
        rdp = np.zeros(len(self._orders))
        # Merged as the state file holds them; empty runs dropped (0 * inf
        # would be nan).
        for key, count in ledger_state.merge_segments(
                self.history(extra_steps)):
            rdp = rdp + count * self._step_of(key)[1]
        return rdp

    def _epsilon_and_order_after(self,
                                 extra_steps: int) -> Tuple[float, float]:
        return conversion_lib.rdp_to_epsilon(
            self._orders, self._rdp_after(extra_steps), self._delta)

    def get_epsilon_and_optimal_order(self) -> Tuple[float, float]:
        return self._epsilon_and_order_after(0)

    @property
    def epsilon(self) -> float:
        """Epsilon at `delta` for every step charged."""
        return self._epsilon_and_order_after(0)[0]

    def epsilon_after(self, extra_steps: int) -> float:
        """Epsilon if `extra_steps` more steps of `event` were charged."""
        extra_steps = _validate.integer('extra_steps', extra_steps, 0)
        return self._epsilon_and_order_after(extra_steps)[0]

    def can_take(self, extra_steps: int = 1) -> bool:
        """Whether `extra_steps` more steps stay within `max_steps` and keep
        epsilon <= target_epsilon."""
        if self._max_steps is not None and (
                self._steps + extra_steps > self._max_steps):
            return False
        return self._target is None or (
            self.epsilon_after(extra_steps) <= self._target)

    def remaining_steps(self, limit: int = 10**9) -> Optional[int]:
        """Most further steps within the target and `max_steps` (capped at
        `limit`); None when there is neither."""
        limit = _validate.integer('limit', limit, 0)
        if self._max_steps is not None:
            limit = min(limit, max(0, self._max_steps - self._steps))
        if self._target is None:
            return None if self._max_steps is None else limit
        return _largest_fitting(self.can_take, limit)

    # --- the state file ---------------------------------------------------

    def get_state(self, reserve: int = 0) -> Dict[str, Any]:
        """The state as a JSON-ready dict (format in the module docstring),
        with `reserve` steps of `event` charged ahead."""
        with self._lock:
            keyed = self.history(reserve)
            digest = ledger_state.history_digest(keyed)
            # The reserve joins its event's run.
            segments = ledger_state.merge_segments(keyed)
            eps, order = self._epsilon_and_order_after(reserve)
            return {
                'format': STATE_FORMAT,
                'version': STATE_VERSION,
                'delta': self._delta,
                'orders': [float(o) for o in self._orders],
                'target_epsilon': self._target,
                'steps': self._steps + reserve,
                'reserved_steps': reserve,
                'history_digest': ledger_state.word_to_hex(digest),
                'segments': [{'event': json.loads(key), 'count': count}
                             for key, count in segments],
                'epsilon': float(eps),
                'optimal_order': float(order),
            }

    def _write(self, reserve: int) -> None:
        with self._lock:  # The file and _disk_steps agree.
            reserve = max(reserve, self._running)
            state = self.get_state(reserve)
            files.atomic_write_json(self._state_path, state)
            self._disk_steps = state['steps']

    def save(self, path: Optional[str] = None) -> None:
        """Writes the exact state atomically to `path`, or to `state_path`
        as `write` does (keeping steps that may be running)."""
        with self._lock:
            path = self._state_path if path is None else os.fspath(path)
            if path is None:
                raise ValueError('path is required when the ledger has no '
                                 'state_path.')
            if path == self._state_path:
                self._write(reserve=0)  # Keeps steps that may be running.
            else:
                files.atomic_write_json(path, self.get_state())

    def reserve_ahead(self, steps: int) -> None:
        """Before `steps` steps run: unless the file already covers them,
        writes it charging `save_every_steps` (at least `steps`) ahead,
        capped by the target and `max_steps`, never below `steps`."""
        with self._lock:
            self._running = steps
            if self._state_path is None or (
                    self._steps + steps <= self._disk_steps):
                return
            reserve = max(steps, self._save_every)
            room = self.remaining_steps(limit=reserve)
            if room is not None:
                # The file never charges past them.
                reserve = max(steps, room)
            self._write(reserve)

    def charge(self, count: int) -> None:
        """Charges `count` >= 1 steps of `event` that ran; the file is
        written when more ran than it charges."""
        with self._lock:
            self.compose(self._event, _validate.integer('count', count, 1))
            self._running = max(0, self._running - count)
            if (self._state_path is not None
                    and self._steps > self._disk_steps):
                self._write(reserve=0)

    def write(self) -> None:
        """Writes the exact count to `state_path` (if any), plus the steps
        announced by `reserve_ahead` and not charged yet (they may be
        running)."""
        with self._lock:
            if self._state_path is not None:
                self._write(reserve=0)
