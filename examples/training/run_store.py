"""Finished training runs kept in a JSON file, for studies run in parts.

`examples/accuracy_study.py` and `examples/tune.py` train many runs; each
finished run is written to the file at once, and a rerun with the same
settings skips the runs the file holds. The file records the settings
shared by every run; opening it with other settings is refused, so that one
table never mixes two studies. Format: {"settings": ..., "runs": {key:
result}, ...} plus any named entries (`put_entry`, e.g. a search's best
point).
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional


class RunStore:
    """The finished runs of one study, in a JSON file (or in memory)."""

    def __init__(self, path: Optional[str], settings: Dict[str, Any]):
        self._path = path
        self._settings = json.loads(json.dumps(settings))
        self._runs: Dict[str, Dict[str, Any]] = {}
        self._entries: Dict[str, Any] = {}
        if path is not None and os.path.exists(path):
            with open(path, encoding='utf-8') as f:
                saved = json.load(f)
            if saved.get('settings') != self._settings:
                raise ValueError(
                    f'--results_json={path} holds a study with other '
                    f'settings ({saved.get("settings")}); use another file '
                    'or the same settings.')
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
