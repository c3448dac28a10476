"""Durable files: the privacy ledger's state and the secret run state."""

import json
import os
import tempfile
from typing import Any

__all__ = ['atomic_write_json']


def atomic_write_json(path: str, obj: Any) -> None:
    """Writes `obj` as JSON to `path` so that a crash leaves the old or the
    new file, never a partial one. The file has mode 0600 (mkstemp's)."""
    path = os.path.abspath(path)
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix='.' + os.path.basename(path) + '.',
                               suffix='.tmp', dir=directory)
    try:
        with os.fdopen(fd, 'w') as f:
            json.dump(obj, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:  # Make the rename itself durable (POSIX); best effort elsewhere.
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass
