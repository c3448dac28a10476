"""The numpy references shared by the tests: one twice-sampling DP step, and
the hybrid basis as dense matrices.

Written from the paper's algorithm (and SPEC section 2), not from the
TensorFlow code: per-example l2 clip to c2, optional l-infinity clip to
c_inf, the coordinate masks, the example weights, Gaussian noise of std
z * c2 added once, division by expected_batch_size * q2. In float64, so
that a match with the float32 TensorFlow step tests the TensorFlow step.
"""

import math
from typing import List, Optional, Sequence

import numpy as np


def flatten(per_example: Sequence[np.ndarray]) -> np.ndarray:
    """[B, *shape] arrays -> one [B, d] float64 matrix, in order."""
    batch = per_example[0].shape[0]
    return np.concatenate([np.reshape(a, (batch, -1)) for a in per_example],
                          axis=1).astype(np.float64)


def unflatten(flat: np.ndarray, shapes: Sequence[Sequence[int]]
              ) -> List[np.ndarray]:
    """A [d] vector -> one array per shape, in order."""
    out, start = [], 0
    for shape in shapes:
        size = int(np.prod(shape))
        out.append(flat[start:start + size].reshape(shape))
        start += size
    return out


def private_update(grads: Sequence[np.ndarray], weights: np.ndarray,
                   masks: Sequence[np.ndarray], noise: Sequence[np.ndarray],
                   *, c2: float, c_inf: Optional[float], z: float,
                   expected_batch_size: float, q2: float) -> np.ndarray:
    """The released update of one logical batch, as one [d] vector.

    grads and masks: one [B, *shape] array per variable; noise: one
    standard-normal array of each variable's shape; weights: [B].
    """
    flat = flatten(grads)
    norms = np.linalg.norm(flat, axis=1)
    flat = flat * np.minimum(1.0, c2 / np.maximum(norms, 1e-300))[:, None]
    if c_inf is not None:
        flat = np.clip(flat, -c_inf, c_inf)
    total = (np.asarray(weights, np.float64)[:, None] * flatten(masks)
             * flat).sum(axis=0)
    total += z * c2 * np.concatenate([np.reshape(e, -1) for e in noise])
    return total / (expected_batch_size * q2)


def softmax_regression_gradients(w: np.ndarray, b: np.ndarray,
                                 x: np.ndarray, y: np.ndarray
                                 ) -> List[np.ndarray]:
    """Per-example gradients [B, *shape] of the cross-entropy of softmax
    regression (logits x @ w + b) w.r.t. w and b."""
    logits = x @ w + b
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    delta = p - np.eye(w.shape[1])[y]
    return [x[:, :, None] * delta[:, None, :], delta]


def softmax_regression_step(w, b, x, y, weights, masks, noise, *, c2, c_inf,
                            z, expected_batch_size, q2, lr):
    """One whole DP-SGD step (plain SGD at rate lr) of softmax regression:
    the new (w, b)."""
    update = private_update(
        softmax_regression_gradients(w, b, x, y), weights, masks, noise,
        c2=c2, c_inf=c_inf, z=z, expected_batch_size=expected_batch_size,
        q2=q2)
    new_w, new_b = unflatten(update, [w.shape, b.shape])
    return w - lr * new_w, b - lr * new_b


def dense_principal_blocks(basis) -> List[np.ndarray]:
    """Principal block j of a block-diagonal ``HybridBasis`` as one dense
    [d, r_j] float64 matrix (rows in natural variable order), for each j."""
    offsets = np.cumsum([0] + [math.prod(s) for s in basis.variable_shapes])
    blocks = []
    for j in range(basis.num_principal_blocks):
        columns = []
        for g, group in enumerate(basis.groups):
            u = basis.block(g, j).numpy().astype(np.float64)
            full = np.zeros((basis.dim, u.shape[1]))
            row = 0
            for v in group:
                size = offsets[v + 1] - offsets[v]
                full[offsets[v]:offsets[v + 1]] = u[row:row + size]
                row += size
            columns.append(full)
        blocks.append(np.concatenate(columns, axis=1))
    return blocks
