"""Finished training runs kept in a JSON file, for studies run in parts.

`examples/accuracy_study.py` and `examples/tune.py` train many runs; each
finished run is written to the file at once, and a rerun with the same
settings skips the runs the file holds. The file records the settings
shared by every run; opening it with other settings is refused, so that one
table never mixes two studies. One setting may be a union (`union_key`, the
accuracy study's rows): an invocation may name fewer or new entries under
it, but never give a stored name another value, so a study can add rows or
run a few of them first. Format: {"settings": ..., "runs": {key:
result}, ...} plus any named entries (`put_entry`, e.g. a search's best
point).
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional


class RunStore:
    """The finished runs of one study, in a JSON file (or in memory)."""

    def __init__(self, path: Optional[str], settings: Dict[str, Any], *,
                 union_key: Optional[str] = None):
        self._path = path
        self._settings = json.loads(json.dumps(settings))
        self._runs: Dict[str, Dict[str, Any]] = {}
        self._entries: Dict[str, Any] = {}
        if path is not None and os.path.exists(path):
            with open(path, encoding='utf-8') as f:
                saved = json.load(f)
            stored = saved.get('settings') or {}
            union = dict(stored.get(union_key) or {}) if union_key else {}
            if union_key is not None:
                clashes = sorted(
                    name for name, value in
                    self._settings.get(union_key, {}).items()
                    if union.setdefault(name, value) != value)
            same = ({k: v for k, v in stored.items() if k != union_key} ==
                    {k: v for k, v in self._settings.items()
                     if k != union_key})
            if not same or (union_key is not None and clashes):
                what = (f'other settings ({stored})' if not same else
                        f'other {union_key} {clashes} under the same names')
                raise ValueError(
                    f'--results_json={path} holds a study with {what}; use '
                    'another file or the same settings.')
            if union_key is not None:
                self._settings[union_key] = union
            self._runs = saved.pop('runs')
            saved.pop('settings')
            self._entries = saved

    @staticmethod
    def key(row: str, epsilon: float, seed: int) -> str:
        """An accuracy study's key of one run."""
        return f'{row} | epsilon={epsilon:g} | seed={seed}'

    def get(self, key: str) -> Optional[Dict[str, Any]]:
        return self._runs.get(key)

    def put(self, key: str, result: Dict[str, Any]) -> None:
        self._runs[key] = json.loads(json.dumps(result))
        self._save()

    def put_entry(self, name: str, value: Any) -> None:
        """Records `value` under `name` beside the runs."""
        self._entries[name] = json.loads(json.dumps(value))
        self._save()

    def _save(self) -> None:
        if self._path is None:
            return
        directory = os.path.dirname(os.path.abspath(self._path))
        os.makedirs(directory, exist_ok=True)
        temporary = f'{self._path}.tmp'
        with open(temporary, 'w', encoding='utf-8') as f:
            json.dump(dict(self._entries, settings=self._settings,
                           runs=self._runs), f, indent=1)
        os.replace(temporary, self._path)  # A crash keeps the last file.
