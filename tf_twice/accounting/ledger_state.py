"""The privacy ledger's state file: its format, events as JSON, and the
checks that refuse a file that would under-count the privacy spent.

State file (JSON, `format` 'tf_twice.PrivacyLedger', `version` 2):

    {"format": ..., "version": 2, "delta": float, "orders": [float, ...],
     "target_epsilon": float or null,
     "history_digest": "16 hex digits",  # of the segments' events
     "steps": int,            # steps charged, reserved ones included
     "reserved_steps": int,   # of which charged ahead, not yet confirmed
     "segments": [{"event": EVENT, "count": int}, ...],
     "epsilon": float, "optimal_order": float}   # informational

EVENT is `DpEvent.to_named_tuple()` as JSON: {"module_name", "class_name",
"arguments": {field: value}} with nested events in the same form and
tuples as lists. On load, `epsilon` and `optimal_order` are recomputed
from the segments, whose counts must add up to `steps` (a file with its
segments missing or cut, or its counts edited, is refused, not read as
fewer steps); only dp_accounting and tf_twice event classes are accepted.
A file whose `history_digest` is not its segments' (an event or count edited
by hand) is refused. Version 1 files (before the digest) are still read.

The digest catches mistakes, not forgery: whoever edits a file can recompute
it (or mark the file version 1, which has none). What ties a file to the
weights it accounts is the record a DPModel's weights carry of the steps
that ran on them (`tf_twice.accounting.step_record`): a ledger charges every
step of it that the file's history lacks, or refuses the weights.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import tempfile
from typing import Any, Dict, Iterable, List, Mapping, Tuple

import dp_accounting
import numpy as np

from tf_twice import _validate

__all__ = ['STATE_FORMAT', 'STATE_VERSION', 'check_state_path',
           'event_from_json', 'event_key', 'event_to_json', 'history_digest',
           'merge_segments', 'parse_segments', 'read_state', 'word_to_hex']

STATE_FORMAT = 'tf_twice.PrivacyLedger'
STATE_VERSION = 2
_READABLE_VERSIONS = (1, 2)  # 1: before the history digest.
_WORD = 2**63  # Digests are int64 words (a model's binding).
_EVENT_MODULES = ('dp_accounting', 'tf_twice')


# --- event <-> JSON ---------------------------------------------------------


def _to_jsonable(value: Any) -> Any:
    if hasattr(value, '_fields') and {'module_name', 'class_name'} <= set(
            value._fields):  # An event's named tuple.
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
        # from_named_tuple imports the module it names: only event modules.
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


def event_key(event: dp_accounting.DpEvent) -> str:
    return json.dumps(event_to_json(event), sort_keys=True)


# --- history digests --------------------------------------------------------


def word_to_hex(word: int) -> str:
    return f'{word:016x}'


def _hex_to_word(name: str, text: Any) -> int:
    try:
        word = int(text, 16) if isinstance(text, str) and len(text) == 16 \
            else -1
    except ValueError:
        word = -1
    if not 0 <= word < _WORD:
        raise ValueError(f'state {name} must be 16 hex digits below 2**63; '
                         f'got {text!r}.')
    return word


def merge_segments(segments: Iterable[Tuple[str, int]]) -> List[List[Any]]:
    """[event_key, count] runs of (event_key, count) pairs in order:
    consecutive pairs of one event are joined and empty ones dropped."""
    merged: List[List[Any]] = []
    for key, count in segments:
        if count <= 0:
            continue
        if merged and merged[-1][0] == key:
            merged[-1][1] += count
        else:
            merged.append([key, count])
    return merged


def history_digest(segments: Iterable[Tuple[str, int]]) -> int:
    """A word in [0, 2**63) that names the events of a history of
    (event_key, count) pairs, in order: SHA-256 of the merged list
    (`merge_segments`), truncated.
    """
    text = json.dumps(merge_segments(segments))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8],
                          'big') >> 1


# --- the state file ---------------------------------------------------------


def check_state_path(state_path: Any) -> str:
    """`state_path` as a str, if a ledger can be written there.

    Refused up front, not at the first write (after steps have run): a
    directory, a file in a missing directory or in one that is not
    writable.
    """
    if not isinstance(state_path, (str, os.PathLike)):
        raise ValueError('state_path must be None or a file path; got '
                         f'{state_path!r}.')
    state_path = os.fspath(state_path)
    if os.path.isdir(state_path):
        raise ValueError(f'state_path={state_path!r} is a directory; give a '
                         'file path, e.g. beside the checkpoints.')
    directory = os.path.dirname(os.path.abspath(state_path))
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f'state_path={state_path!r}: {directory!r} is a '
                         'file, not a directory.')
    if not os.path.isdir(directory):
        raise ValueError(f'state_path={state_path!r}: its directory '
                         f'{directory!r} does not exist; create it first.')
    # The atomic write creates a temporary file there and renames it: tried
    # once (permission bits do not tell a read-only filesystem, nor what
    # root may do).
    try:
        with tempfile.NamedTemporaryFile(dir=directory,
                                         prefix='.tf_twice_probe_'):
            pass
    except OSError as e:
        raise ValueError(f'state_path={state_path!r}: its directory '
                         f'{directory!r} is not writable ({e.strerror}).'
                         ) from e
    return state_path


def read_state(path: str) -> Dict[str, Any]:
    try:
        with open(path) as f:
            state = json.load(f)
    except (OSError, ValueError) as e:
        # Refuse rather than start from zero: that would reset the budget.
        raise ValueError(
            f'Cannot read the privacy ledger at state_path={path!r} ({e}); '
            'fix or move it deliberately.') from e
    if not isinstance(state, dict):
        raise ValueError(
            f'The privacy ledger at state_path={path!r} is not a JSON object; '
            'fix or move it deliberately.')
    return state


def parse_segments(state: Mapping[str, Any]
                    ) -> List[Tuple[dp_accounting.DpEvent, int]]:
    """The (event, count) segments of a state, checked for consistency.

    A state the ledger wrote always has a list of segments whose counts add
    up to its ``steps``. One that does not (segments missing, emptied or cut,
    ``steps`` edited) is refused: read as it stands it would restart the
    privacy spent from fewer steps than were charged. So is a version 2
    state whose ``history_digest`` is not that of its segments.
    """
    if not isinstance(state, Mapping):
        raise ValueError('A privacy ledger state must be a JSON object; got '
                         f'{type(state).__name__}.')
    if state.get('format') != STATE_FORMAT:
        raise ValueError(f"state must have format {STATE_FORMAT!r}; got "
                         f"{state.get('format')!r}.")
    if state.get('version') not in _READABLE_VERSIONS:
        raise ValueError(f'state version must be one of {_READABLE_VERSIONS}'
                         f"; got {state.get('version')!r}.")
    raw = state.get('segments')
    if not isinstance(raw, list):
        raise ValueError('state must hold its list of segments; got '
                         f'segments={raw!r}. Refused rather than read as no '
                         'steps: fix or move the file deliberately.')
    segments = []
    total = 0
    for segment in raw:
        if not isinstance(segment, Mapping) or 'event' not in segment:
            raise ValueError('every segment of the state must be an object '
                             f'with an event and a count; got {segment!r}.')
        count = _validate.integer('segment count', segment.get('count'), 0)
        total += count
        if count:
            segments.append((event_from_json(segment['event']), count))
    steps = _validate.integer('state steps', state.get('steps'), 0)
    if steps != total:
        raise ValueError(
            f'state says steps={steps}, but its segments hold {total} steps: '
            'the file was cut or edited. Refused rather than read as the '
            'smaller count: fix or move it deliberately.')
    reserved = _validate.integer('state reserved_steps',
                                 state.get('reserved_steps', 0), 0)
    if reserved > steps:
        raise ValueError(f'state reserved_steps={reserved} exceeds its '
                         f'steps={steps}.')
    if state.get('version') != 1:
        digest = _hex_to_word('history_digest', state.get('history_digest'))
        if digest != history_digest([(event_key(e), c) for e, c in segments]):
            raise ValueError(
                'state history_digest does not match its segments: an event '
                'or a count was edited after the ledger wrote the file. '
                'Refused rather than read as edited: fix or move it '
                'deliberately.')
    return segments
