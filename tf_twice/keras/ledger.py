"""`PrivacyLedger`: a Keras callback that accounts for every DP step.

Every train batch of `fit` is one logical batch, i.e. one DP step (see
`tf_twice.sampling`). The ledger composes each step's `DpEvent` (normally a
`TwiceSampledGaussianDpEvent`) in a `TwiceSamplingRdpAccountant`, so at any
time `ledger.epsilon` is the accountant's epsilon at `delta` for exactly the
steps taken, including those of earlier runs it was resumed from.

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
* **Never forgets privacy spent.** With `state_path`, the state is written as
  JSON *before* steps run (write-ahead): before a step that the file does
  not yet cover, the ledger charges `save_every_steps` steps ahead (capped by
  the budget) and writes the file; at each epoch end and at the end of
  training it writes the exact count. A crash therefore over-counts by at
  most `save_every_steps` steps and never under-counts. Writes are atomic
  (temporary file in the same directory, fsync, `os.replace`), so a crash
  mid-write leaves the previous file intact. A ledger whose `state_path`
  exists always loads it: the privacy spent cannot be reset by a setting,
  only by choosing a new file. If the file's events differ from the current
  one (new noise, new sampling rate), both are composed.

* **Accounts the mechanism that runs.** `PrivacyLedger.for_model` takes
  the event from the model (`DPModel.dp_event()`, derived from its
  `TwiceSamplingConfig`). At the start of every `fit` the ledger refuses a
  model that mixes examples (BatchNormalization, ...) and, for a DP model,
  any event other than the model's own (`guards.check_ledger_event`);
  `DPModel.fit` also checks the input is Poisson-sampled from the config's
  n at its q1. A plain Keras model's steps are counted as the given event,
  which the caller vouches for.
* **Stops where the plan ends.** With `max_steps`, no step runs past that
  total (resumed steps included): training ends exactly where the noise
  was calibrated.

Logging: at each epoch end `logs['epsilon']` is set, so it reaches `History`
and every callback listed AFTER the ledger (put `TensorBoard`/`CSVLogger`
after it). With `log_dir`, the ledger also writes the scalar
`epoch_epsilon` itself (step = epoch) with `tf.summary`.

Steps are counted, for a tf_twice DP model, by its step keys: one key is
drawn per logical step and no restore or `fit` call rewinds the count, so
every step that ran is charged at the ledger's next hook, also a step whose
`on_train_batch_end` never reached the ledger (an exception in an earlier
callback) and steps of custom loops over `train_step` between `fit` calls.
Other models are charged in `on_train_batch_begin`, before their steps run
(`steps_per_execution` steps each time; on Keras 3 a final execution that
runs fewer is charged whole); their custom loops call `record_steps`.
The ledger uses Keras's public callback hooks, `model.stop_training` and
`model.train_function`, on Keras 2 and Keras 3 alike.

State file (JSON, `format` 'tf_twice.PrivacyLedger', `version` 1):

    {"format": ..., "version": 1, "delta": float, "orders": [float, ...],
     "target_epsilon": float or null,
     "steps": int,            # steps charged, reserved ones included
     "reserved_steps": int,   # of which charged ahead, not yet confirmed
     "segments": [{"event": EVENT, "count": int}, ...],
     "epsilon": float, "optimal_order": float}   # informational

EVENT is `DpEvent.to_named_tuple()` as JSON: {"module_name", "class_name",
"arguments": {field: value}} with nested events in the same form and
tuples as lists. On load, `steps`, `epsilon` and `optimal_order` are
recomputed from the segments; only dp_accounting and tf_twice event
classes are accepted.
"""

from __future__ import annotations

import collections
import copy
import json
import logging
import math
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import dp_accounting
import numpy as np
import tensorflow as tf

from tf_twice import _files as files
from tf_twice import _keras
from tf_twice.accounting import TwiceSamplingRdpAccountant
from tf_twice.keras import guards

__all__ = ['PrivacyLedger', 'STATE_FORMAT', 'STATE_VERSION']

STATE_FORMAT = 'tf_twice.PrivacyLedger'
STATE_VERSION = 1
_EVENT_MODULES = ('dp_accounting', 'tf_twice')
_LOGGER = logging.getLogger(__name__)


# --- event <-> JSON ---------------------------------------------------------


def _is_event_tuple(value: Any) -> bool:
    return (hasattr(value, '_fields') and 'module_name' in value._fields and
            'class_name' in value._fields)


def _to_jsonable(value: Any) -> Any:
    if _is_event_tuple(value):
        arguments = {
            field: _to_jsonable(getattr(value, field))
            for field in value._fields
            if field not in ('module_name', 'class_name')
        }
        return {'module_name': value.module_name,
                'class_name': value.class_name, 'arguments': arguments}
    if isinstance(value, Mapping):
        return {str(k): _to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f'Cannot store event field {value!r} '
                     f'({type(value).__name__}) as JSON.')


def event_to_json(event: dp_accounting.DpEvent) -> Dict[str, Any]:
    """A JSON-ready dict of `event` (via `DpEvent.to_named_tuple`)."""
    return _to_jsonable(event.to_named_tuple())


def _from_jsonable(value: Any) -> Any:
    if isinstance(value, dict) and 'module_name' in value:
        module = str(value['module_name'])
        if module.split('.')[0] not in _EVENT_MODULES:
            raise ValueError(f'Ledger state names event module {module!r}; '
                             f'only {_EVENT_MODULES} events are accepted.')
        arguments = {k: _from_jsonable(v)
                     for k, v in value.get('arguments', {}).items()}
        wrapper = collections.namedtuple(
            '_EventTuple', ['module_name', 'class_name', *arguments])
        return wrapper(module, str(value['class_name']), **arguments)
    if isinstance(value, list):
        # Lists stay lists (as in ComposedDpEvent); event classes whose
        # fields are tuples convert them themselves.
        return [_from_jsonable(v) for v in value]
    return value


def event_from_json(obj: Mapping[str, Any]) -> dp_accounting.DpEvent:
    """Inverse of `event_to_json`."""
    try:
        return dp_accounting.DpEvent.from_named_tuple(_from_jsonable(obj))
    except (TypeError, AttributeError, ImportError, KeyError) as e:
        raise ValueError(f'Ledger state holds an invalid event {obj!r}: '
                         f'{e}') from e


def _event_key(event: dp_accounting.DpEvent) -> str:
    return json.dumps(event_to_json(event), sort_keys=True)


def _read_json(path: str) -> Dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        # Refuse rather than start from zero: that would reset the budget.
        raise ValueError(
            f'Cannot read the privacy ledger at state_path={path!r} ({e}); '
            'fix or move it deliberately.') from e


def _as_float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan  # Fails every range check below.


def _check_delta(delta: Any) -> float:
    value = _as_float(delta)
    if not 0.0 < value < 1.0:
        raise ValueError(f'delta must be in (0, 1); got {delta!r}.')
    return value


def _check_target(target: Any) -> Optional[float]:
    if target is None:
        return None
    value = _as_float(target)
    if not 0.0 < value < math.inf:
        raise ValueError('target_epsilon must be None or in (0, inf); got '
                         f'{target!r}.')
    return value


def _check_count(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f'{name} must be an integer >= {low}; got {value!r}.')
    if value < low:
        raise ValueError(f'{name} must be an integer >= {low}; got {value}.')
    return int(value)


def _check_state_path(state_path: Any) -> str:
    """A writable file path: refused up front, not at the first write."""
    if not isinstance(state_path, (str, os.PathLike)):
        raise ValueError('state_path must be None or a file path; got '
                         f'{state_path!r}.')
    state_path = os.fspath(state_path)
    if os.path.isdir(state_path):
        raise ValueError(f'state_path={state_path!r} is a directory; give a '
                         'file path, e.g. beside the checkpoints.')
    directory = os.path.dirname(os.path.abspath(state_path))
    if not os.path.isdir(directory):
        raise ValueError(f'state_path={state_path!r}: its directory '
                         f'{directory!r} does not exist; create it first.')
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f'state_path={state_path!r}: its directory '
                         f'{directory!r} is not writable.')
    return state_path


def _parse_segments(state: Mapping[str, Any]
                    ) -> List[Tuple[dp_accounting.DpEvent, int]]:
    if state.get('format') != STATE_FORMAT:
        raise ValueError(f"state must have format {STATE_FORMAT!r}; got "
                         f"{state.get('format')!r}.")
    if state.get('version') != STATE_VERSION:
        raise ValueError(f'state version must be {STATE_VERSION}; got '
                         f"{state.get('version')!r}.")
    segments = []
    for segment in state.get('segments', []):
        count = _check_count('segment count', segment.get('count'), 0)
        if count:
            segments.append((event_from_json(segment['event']), count))
    return segments


class PrivacyLedger(tf.keras.callbacks.Callback):
    """Counts DP steps of `fit`, reports epsilon, stops at a target, persists.

    See the module docstring for the guarantees (never past
    `target_epsilon`, never forgets privacy spent) and the state format.

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
      state_path: None or a JSON file (e.g. beside the model checkpoints).
        Loaded if it exists, and kept up to date.
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
        cannot compose, or an unreadable state file; when `fit` starts, for
        a model with BatchNormalization or a tf_twice DP model whose
        parameters differ from the event's.
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
        loaded = None
        if state_path is not None:
            state_path = _check_state_path(state_path)
            if os.path.exists(state_path):
                loaded = _read_json(state_path)
        self._setup(event, delta, target_epsilon=target_epsilon,
                    max_steps=max_steps,
                    save_every_steps=save_every_steps, orders=orders,
                    log_dir=log_dir, verbose=verbose, history=loaded)
        self._state_path = state_path
        if loaded is not None and self._verbose:
            _LOGGER.warning('PrivacyLedger: resumed %d steps from %s '
                            '(epsilon %.4g at delta %g).', self._steps,
                            state_path, self.epsilon, self._delta)

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
        return cls(dp_event(), delta, target_epsilon=target_epsilon,
                   max_steps=max_steps, state_path=state_path,
                   save_every_steps=save_every_steps, orders=orders,
                   log_dir=log_dir, verbose=verbose)

    def _setup(self, event, delta, *, target_epsilon, save_every_steps,
               orders, log_dir, verbose, history, max_steps=None):
        if not isinstance(event, dp_accounting.DpEvent):
            raise ValueError('event must be a dp_accounting DpEvent (one DP '
                             'step, e.g. TwiceSampledGaussianDpEvent); got '
                             f'{type(event).__name__}.')
        self._delta = _check_delta(delta)
        self._target = _check_target(target_epsilon)
        self._max_steps = (None if max_steps is None else
                           _check_count('max_steps', max_steps, 0))
        self._save_every = _check_count('save_every_steps', save_every_steps,
                                        1)
        self._verbose = int(verbose)
        segments = []
        if history is not None:
            segments = _parse_segments(history)
            if orders is None and history.get('orders'):
                orders = history['orders']
        self._accountant = TwiceSamplingRdpAccountant(orders)
        if not self._accountant.supports(event):
            raise ValueError(f'event {event} cannot be composed by '
                             'TwiceSamplingRdpAccountant (note that '
                             'TwiceSampledGaussianDpEvent must not be wrapped '
                             'in PoissonSampledDpEvent).')
        self._event = event
        self._event_json = event_to_json(event)  # Fails early if unstorable.
        self._key = json.dumps(self._event_json, sort_keys=True)
        self._segments: List[List[Any]] = []
        self._steps = 0
        for past_event, count in segments:
            self._compose(past_event, count)
        self._disk_steps = self._steps  # Steps the state file charges.
        self._log_dir = log_dir
        self._writer = None
        # Keys drawn and charged, per step-key stream of a tf_twice DP model
        # (a recompile with another DP optimizer brings another stream).
        # Held strongly: a replaced stream's uncharged steps must be read.
        self._charged_draws: Dict[int, List[Any]] = {}
        self._blocked = None
        self._stopped_by_budget = False
        self._stopped_at_max_steps = False

    # --- accounting -------------------------------------------------------

    def _compose(self, event: dp_accounting.DpEvent, count: int) -> None:
        self._accountant.compose(event, count)
        key = (self._key if event is self._event else _event_key(event))
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
    def orders(self) -> np.ndarray:
        return self._accountant.orders

    @property
    def max_steps(self) -> Optional[int]:
        return self._max_steps

    @property
    def state_path(self) -> Optional[str]:
        return self._state_path

    @property
    def steps(self) -> int:
        """DP steps taken, including those of the runs resumed from."""
        return self._steps

    @property
    def epsilon(self) -> float:
        """The accountant's epsilon at `delta` for all steps taken."""
        return float(self._accountant.get_epsilon(self._delta))

    def get_epsilon_and_optimal_order(self) -> Tuple[float, float]:
        eps, order = self._accountant.get_epsilon_and_optimal_order(
            self._delta)
        return float(eps), float(order)

    @property
    def accountant(self) -> TwiceSamplingRdpAccountant:
        """A copy of the accountant holding every step taken."""
        return copy.deepcopy(self._accountant)

    @property
    def dp_event(self) -> dp_accounting.DpEvent:
        """The composed `DpEvent` of every step taken."""
        return self._accountant.ledger

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
        extra_steps = _check_count('extra_steps', extra_steps, 0)
        scratch = copy.deepcopy(self._accountant)
        if extra_steps:
            scratch.compose(self._event, extra_steps)
        return float(scratch.get_epsilon(self._delta))

    def can_take(self, extra_steps: int = 1) -> bool:
        """Whether `extra_steps` more steps stay within `max_steps` and keep
        epsilon <= target_epsilon."""
        if self._max_steps is not None and (
                self._steps + extra_steps > self._max_steps):
            return False
        if self._target is None:
            return True
        return self.epsilon_after(extra_steps) <= self._target

    def remaining_steps(self, limit: int = 10**9) -> Optional[int]:
        """Most further steps within the target and `max_steps` (capped at
        `limit`).

        None when there is neither.
        """
        limit = _check_count('limit', limit, 0)
        if self._max_steps is not None:
            limit = min(limit, max(0, self._max_steps - self._steps))
        if self._target is None:
            return None if self._max_steps is None else limit
        if not self.can_take(1):
            return 0
        low, high = 1, 1  # can_take(low) holds.
        while high < limit and self.can_take(high):
            low, high = high, min(2 * high, limit)
        if high == limit and self.can_take(high):
            return limit
        while high - low > 1:  # can_take(low) and not can_take(high).
            mid = (low + high) // 2
            low, high = (mid, high) if self.can_take(mid) else (low, mid)
        return low

    def record_steps(self, count: int = 1) -> None:
        """Records `count` steps that happened (custom training loops).

        Steps are recorded even past the target (they happened); check
        `can_take` before running them.
        """
        count = _check_count('count', count, 1)
        self._compose(self._event, count)
        if self._state_path is not None and self._steps > self._disk_steps:
            self._write(reserve=0)

    # --- state ------------------------------------------------------------

    def _state(self, reserve: int) -> Dict[str, Any]:
        segments = [{'event': json.loads(key), 'count': count}
                    for key, _, count in self._segments]
        if reserve:
            if self._segments and self._segments[-1][0] == self._key:
                segments[-1]['count'] += reserve
            else:
                segments.append({'event': self._event_json, 'count': reserve})
        eps_source = self._accountant
        if reserve:
            eps_source = copy.deepcopy(self._accountant)
            eps_source.compose(self._event, reserve)
        eps, order = eps_source.get_epsilon_and_optimal_order(self._delta)
        return {
            'format': STATE_FORMAT,
            'version': STATE_VERSION,
            'delta': self._delta,
            'orders': [float(o) for o in self._accountant.orders],
            'target_epsilon': self._target,
            'steps': self._steps + reserve,
            'reserved_steps': reserve,
            'segments': segments,
            'epsilon': float(eps),
            'optimal_order': float(order),
        }

    def get_state(self) -> Dict[str, Any]:
        """The ledger as a JSON-ready dict (format in the module docstring)."""
        return self._state(reserve=0)

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
        if not isinstance(state, Mapping):
            raise ValueError('state must be a dict from get_state(); got '
                             f'{type(state).__name__}.')
        segments = _parse_segments(state)
        if event is None:
            if not segments:
                raise ValueError('event is required: the state has no steps '
                                 'to take it from.')
            event = segments[-1][0]
        if state_path is not None:
            state_path = _check_state_path(state_path)
        if state_path is not None and os.path.exists(state_path):
            raise ValueError(f'state_path={state_path!r} already holds a '
                             'ledger; load it with PrivacyLedger(event, '
                             'delta, state_path=...) so neither is lost.')
        ledger = cls.__new__(cls)
        tf.keras.callbacks.Callback.__init__(ledger)
        ledger._setup(
            event, state.get('delta') if delta is None else delta,
            target_epsilon=(state.get('target_epsilon')
                            if target_epsilon is None else target_epsilon),
            save_every_steps=save_every_steps, orders=orders,
            log_dir=log_dir, verbose=verbose, history=state)
        ledger._state_path = state_path
        ledger._disk_steps = 0  # Nothing on disk yet.
        return ledger

    def save(self, path: Optional[str] = None) -> None:
        """Writes the exact state atomically to `path` (or `state_path`)."""
        path = self._state_path if path is None else os.fspath(path)
        if path is None:
            raise ValueError('path is required when the ledger has no '
                             'state_path.')
        files.atomic_write_json(path, self.get_state())
        if path == self._state_path:
            self._disk_steps = self._steps

    def _write(self, reserve: int) -> None:
        files.atomic_write_json(self._state_path, self._state(reserve))
        self._disk_steps = self._steps + reserve

    # --- Keras hooks ------------------------------------------------------

    def _steps_per_execution(self) -> int:
        return _keras.steps_per_execution(self.model)

    def _charge_drawn_keys(self) -> bool:
        """Charges the steps tf_twice DP models ran since the last charge.

        Every step-key stream of the model (``DPModel.key_streams``: those
        of DP optimizers replaced by a recompile, then the current one) and
        every stream seen before is read, so no stream's steps are lost.
        The streams of the ledger's first sight start where the charges of
        earlier ledgers end (``StepKeys.accounted_draws``): steps that ran
        before any ledger saw the model (a ``fit`` without a ledger, a
        custom loop) are charged, steps another ledger charged are not; a
        stream seen later starts at 0 (it can only over-charge). Returns
        False for a model without step keys.
        """
        streams = getattr(self.model, 'key_streams', None)
        if not streams:
            return False
        first_sight = not self._charged_draws
        for keys in streams:
            if id(keys) not in self._charged_draws:
                start = (min(keys.draws, getattr(keys, 'accounted_draws', 0))
                         if first_sight else 0)
                self._charged_draws[id(keys)] = [keys, start]
        executed = 0
        for entry in self._charged_draws.values():
            draws = entry[0].draws
            executed += draws - entry[1]
            entry[1] = draws
            entry[0].accounted_draws = max(
                getattr(entry[0], 'accounted_draws', 0), draws)
        self._charge_counted(executed)
        return True

    def _block(self) -> None:
        """Makes `fit`'s next call of the train function a no-op."""
        model = self.model
        if self._blocked is not None:
            return
        original = model.train_function

        def blocked_train_function(unused_iterator):
            # No step, no weight update, nothing read from the data; the
            # logs keep their keys (metrics as they stand).
            return _keras.metric_results(model)

        blocked_train_function.original = original
        self._blocked = blocked_train_function
        model.train_function = blocked_train_function
        # Keras reads the metrics again at the epoch's end: those that no
        # step has built (Keras 3, before the first step) have no result.
        model.get_metrics_result = lambda: _keras.metric_results(model)

    def _unblock(self) -> None:
        model = self.model
        current = getattr(model, 'train_function', None)
        original = getattr(current, 'original', None)
        if original is not None and getattr(
                current, '__name__', '') == 'blocked_train_function':
            model.train_function = original
        if 'get_metrics_result' in vars(model):
            del model.get_metrics_result  # The class's method again.
        self._blocked = None

    def _stop(self, k: int) -> None:
        self.model.stop_training = True
        if self._max_steps is not None and self._steps + k > self._max_steps:
            if self._verbose and not self._stopped_at_max_steps:
                _LOGGER.warning('PrivacyLedger: stopping training after the '
                                'planned %d steps (max_steps).', self._steps)
            self._stopped_at_max_steps = True
            return
        if not self._stopped_by_budget and self._verbose:
            _LOGGER.warning(
                'PrivacyLedger: stopping training after %d steps: %d more '
                'step(s) would raise epsilon from %.4g to %.4g > '
                'target_epsilon %.4g (delta %g).', self._steps, k,
                self.epsilon, self.epsilon_after(k), self._target,
                self._delta)
        self._stopped_by_budget = True

    def on_train_begin(self, logs=None):
        # Refused before any step runs, so nothing is charged for them.
        guards.check_no_example_mixing(self.model)
        guards.check_ledger_event(self._event, self.model)
        self._unblock()
        self._stopped_by_budget = False
        self._stopped_at_max_steps = False
        # Steps that ran unseen since the last hook (an interrupted fit, a
        # custom loop) are charged now.
        self._charge_drawn_keys()
        keys = getattr(getattr(self.model, 'aggregator', None), 'keys', None)
        if getattr(keys, 'seeded', False) and self._verbose:
            _LOGGER.warning(
                'PrivacyLedger: the model\'s masks and noise are SEEDED. The '
                'epsilon holds only if the seed is secret and used for this '
                'one run: the same seed on the same weights gives the same '
                'noise, and two releases with the same noise reveal their '
                'noise-free difference. Leave seed=None for a release.')

    def on_train_batch_begin(self, batch, logs=None):
        k = self._steps_per_execution()
        if not self.can_take(k):
            self._stop(k)
            self._block()
            return
        if self._state_path is not None and (
                self._steps + k > self._disk_steps):
            reserve = max(k, self._save_every)
            if self._target is not None and reserve > k:
                # The file never charges beyond the budget.
                low, high = k, reserve
                if not self.can_take(high):
                    while high - low > 1:
                        mid = (low + high) // 2
                        low, high = ((mid, high) if self.can_take(mid)
                                     else (low, mid))
                    reserve = low
            self._write(reserve=reserve)
        if not getattr(self.model, 'key_streams', None):
            # A model without step keys: its k steps are charged now,
            # before they run (a final execution that runs fewer is
            # charged whole).
            self._charge_counted(k)

    def on_train_batch_end(self, batch, logs=None):
        self._charge_drawn_keys()
        k = self._steps_per_execution()
        if not self.can_take(k):
            self._stop(k)

    def _charge_counted(self, executed: int) -> None:
        if executed > 0:
            self._compose(self._event, executed)
            if self._state_path is not None and (
                    self._steps > self._disk_steps):
                self._write(reserve=0)  # More ran than was charged ahead.

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
        if self._state_path is not None:
            self._write(reserve=0)

    def on_train_end(self, logs=None):
        self._charge_drawn_keys()
        self._unblock()
        if self._state_path is not None:
            self._write(reserve=0)
        if self._writer is not None:
            self._writer.flush()
