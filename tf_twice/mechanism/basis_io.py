"""The file format of a ``HybridBasis``: one .npz per basis.

Arrays ``group_0`` .. ``group_{G-1}`` hold the [d_g, k_g] float32 matrices;
``meta`` holds, as JSON, a format version, the structure (groups, variable
shapes, group ranks), the orthonormality tolerance and the metadata. Nothing
is pickled. Reading checks only the format version: ``HybridBasis.load``
hands what it reads to the constructor, which checks every guarantee again.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Mapping, Sequence

import numpy as np

__all__ = ['FORMAT_VERSION', 'read', 'write']

FORMAT_VERSION = 1


def write(path_or_file, group_matrices: Sequence[np.ndarray], *,
          groups: Sequence[Sequence[int]],
          variable_shapes: Sequence[Sequence[int]],
          group_ranks: Sequence[Sequence[int]],
          orthonormality_tolerance: float,
          metadata: Mapping[str, Any]) -> None:
    """Writes one basis as an .npz (exactly at the given path)."""
    meta = {
        'format_version': FORMAT_VERSION,
        'groups': [list(g) for g in groups],
        'variable_shapes': [list(s) for s in variable_shapes],
        'group_ranks': [list(r) for r in group_ranks],
        'orthonormality_tolerance': orthonormality_tolerance,
        'metadata': dict(metadata),
    }
    arrays = {f'group_{g}': m for g, m in enumerate(group_matrices)}
    arrays['meta'] = np.array(json.dumps(meta))
    # np.savez appends '.npz' to a path without it; an open file keeps the
    # path the caller chose.
    if isinstance(path_or_file, (str, bytes)) or hasattr(
            path_or_file, '__fspath__'):
        with open(path_or_file, 'wb') as f:
            np.savez(f, **arrays)
    else:
        np.savez(path_or_file, **arrays)


def read(path_or_file) -> Dict[str, Any]:
    """The ``HybridBasis`` constructor's arguments, as ``write`` stored them.

    Keys: group_matrices, group_ranks, groups, variable_shapes,
    orthonormality_tolerance, metadata.
    """
    with np.load(path_or_file, allow_pickle=False) as data:
        meta = json.loads(str(data['meta']))
        if meta.get('format_version') != FORMAT_VERSION:
            raise ValueError(
                'path_or_file holds an unknown basis format version '
                f'{meta.get("format_version")!r}.')
        matrices = [data[f'group_{g}'] for g in range(len(meta['groups']))]
    return dict(group_matrices=matrices,
                group_ranks=meta['group_ranks'],
                groups=meta['groups'],
                variable_shapes=meta['variable_shapes'],
                orthonormality_tolerance=meta['orthonormality_tolerance'],
                metadata=meta['metadata'])
