"""Re-learning the hybrid basis during training, from PUBLIC data.

``public_per_example_gradients`` computes per-example gradients of public
examples at a Keras model's current weights (``tf.vectorized_map``, O(n));
``public_gradient_matrices`` flattens them per parameter group; the
``BasisRefresh`` callback runs both and ``tf_twice.hybrid.learn_basis`` every
K steps and hands the new basis to the training path (``set_basis``).

Privacy: only public data and the current model (itself a DP output) are
read, so a refreshed basis is post-processing and costs no privacy.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_twice import config as config_lib
from tf_twice._validate import integer as _check_int
from tf_twice.hybrid import budget_splits
from tf_twice.hybrid.budgets import replanned_block_scales
from tf_twice.hybrid.learning import group_matrices
from tf_twice.hybrid.learning import learn_basis
from tf_twice.keras import per_example
from tf_twice.mechanism.basis import HybridBasis

__all__ = [
    'BasisRefresh',
    'public_gradient_matrices',
    'public_per_example_gradients',
]


def public_per_example_gradients(
        model: tf.keras.Model,
        per_example_loss,
        x,
        y,
        *,
        batch_size: int = 256,
        training: bool = True) -> List[np.ndarray]:
    """Per-example gradients of PUBLIC examples at the current model.

    Runs forward and backward passes per example under ``tf.vectorized_map``
    (O(n), like the DP model's step) in chunks of ``batch_size``.

    Args:
      model: a built or buildable Keras model; gradients are taken w.r.t.
        ``model.trainable_variables`` (their order is the variable order of
        the basis). Per-example gradients need no BatchNorm (use
        GroupNorm/LayerNorm).
      per_example_loss: a Keras ``Loss``, a loss name, or (y_true, y_pred)
        -> per-example losses, read as the DP step reads it
        (``tf_twice.keras.per_example.loss_fn``). The model's regularisation
        losses are added to every example, as in the DP step.
      x, y: public inputs and labels (x may be a nest of arrays).
      batch_size: examples per vectorised chunk, >= 1.
      training: the ``training`` flag of the forward pass.

    Returns:
      One float32 array [n, *shape_v] per trainable variable.
    """
    batch_size = _check_int('batch_size', batch_size, 1)
    loss_fn = per_example.loss_fn(per_example_loss)
    x = tf.nest.map_structure(tf.convert_to_tensor, x)
    y = tf.convert_to_tensor(y)
    n = int(y.shape[0])
    if not model.built:
        per_example.build(model, x)
    variables = model.trainable_variables
    if not variables:
        raise ValueError('model has no trainable variables.')

    chunk_gradients = _traced_gradients(model, per_example_loss, loss_fn,
                                        training)
    size = min(batch_size, n)
    chunks = [[] for _ in variables]
    for start in range(0, n, size):
        # The last chunk is padded with the first rows to the chunks' size
        # (its extra gradients dropped): one trace serves every chunk.
        rows = np.arange(start, start + size) % n
        grads = _in_one_replica(
            chunk_gradients,
            tf.nest.map_structure(lambda t: tf.gather(t, rows), x),
            tf.gather(y, rows))
        kept = min(size, n - start)
        for v, g in enumerate(grads):
            chunks[v].append(g.numpy()[:kept].astype(np.float32, copy=False))
    return [np.concatenate(c, axis=0) for c in chunks]


# model -> {(loss, training, variables): traced chunk gradients}: a basis
# refresh every K steps reuses its trace instead of tracing the per-example
# graph again (seconds for a CNN, at every refresh).
_TRACED = weakref.WeakKeyDictionary()


def _traced_gradients(model, per_example_loss, loss_fn, training):
    def chunk_gradients(xc, yc):
        # The DP step's own per-example losses and gradients.
        return per_example.gradients(model, loss_fn, xc, yc,
                                     training=training).gradients

    try:
        # The loss object itself (kept alive here), never an id that a
        # new loss could reuse; the variables, which a frozen layer
        # changes (their ids: the trace keeps them alive).
        key = (per_example_loss, training,
               tuple(id(v) for v in model.trainable_variables))
        traced = _TRACED.setdefault(model, {})
        if key not in traced:
            traced[key] = tf.function(chunk_gradients)
        return traced[key]
    except TypeError:  # An unhashable model or loss: traced once per call.
        return tf.function(chunk_gradients)


def _in_one_replica(fn, *args):
    """``fn(*args)``; in a strategy's cross-replica context (a callback of
    ``fit`` under ``MirroredStrategy``), where the model's distributed
    variables cannot be read, run in every replica (each computes the same
    gradients of the same public examples) and the first replica's result
    returned."""
    if not (tf.distribute.has_strategy()
            and tf.distribute.in_cross_replica_context()):
        return fn(*args)
    strategy = tf.distribute.get_strategy()
    results = strategy.run(fn, args=args)
    return tf.nest.map_structure(
        lambda r: strategy.experimental_local_results(r)[0], results)


def public_gradient_matrices(
        model: tf.keras.Model,
        per_example_loss,
        x,
        y,
        *,
        groups: Optional[Sequence[Sequence[int]]] = None,
        batch_size: int = 256,
        training: bool = True) -> List[np.ndarray]:
    """``public_per_example_gradients`` flattened per group: [n, d_g] each."""
    return group_matrices(
        public_per_example_gradients(model, per_example_loss, x, y,
                                     batch_size=batch_size,
                                     training=training), groups)


# Refreshing the basis during training.


class BasisRefresh(tf.keras.callbacks.Callback):
    """Re-learns the basis from public data every ``every_steps`` steps.

    Before step 0, K, 2K, ... (``on_train_batch_begin``) it computes the
    per-example gradients of the PUBLIC examples at the current weights and
    runs ``learn_basis``; the result is in ``self.basis`` and is passed to
    ``on_refresh`` (e.g. to assign it to the variables the DP step reads).

    With ``replan_config`` (the hybrid config training runs) every refresh
    also re-splits its l2 budget over the blocks from the same public
    gradients (``tf_twice.hybrid.replanned_block_scales``, by
    ``budget_split``), at fixed noise multipliers and d0_j: the scales are
    in ``self.block_scales`` and ``on_refresh`` is called as
    ``on_refresh(basis, block_scales=...)``, as ``set_basis`` takes them.
    The accounted event, and so epsilon, do not change.

    Privacy: the refresh reads only public data and the current model, which
    is itself the output of the DP training so far; the basis (and the
    scales) are therefore post-processing and cost no privacy. Do not give
    it private examples. Refresh k uses seed ``seed + k``, so a run is
    reproducible.

    Args:
      model: the model whose ``trainable_variables`` the basis covers (for a
        wrapped DP model, the inner model).
      public_data: (x, y) public examples.
      per_example_loss: as in ``public_per_example_gradients``.
      every_steps: K >= 1.
      on_refresh: optional callable(basis) run after each refresh.
      batch_size, training: as in ``public_per_example_gradients``.
      replan_config: None, or the config whose budget every refresh
        re-splits (one Block per basis block, noise multipliers set).
      budget_split, budget_quantile: the re-split's policy
        (``plan_blocks``); only with ``replan_config``.
      **learn_kwargs: ``learn_basis`` arguments (ranks, groups, ...).
    """

    def __init__(self,
                 model: tf.keras.Model,
                 public_data: Tuple[Any, Any],
                 per_example_loss,
                 every_steps: int,
                 *,
                 on_refresh: Optional[Callable[[HybridBasis], None]] = None,
                 batch_size: int = 256,
                 training: bool = True,
                 seed: int = 0,
                 replan_config: Optional[
                     config_lib.TwiceSamplingConfig] = None,
                 budget_split: Optional[str] = None,
                 budget_quantile: Optional[float] = None,
                 **learn_kwargs):
        super().__init__()
        self._every = _check_int('every_steps', every_steps, 1)
        self._seed = _check_int('seed', seed, 0)
        self._batch_size = _check_int('batch_size', batch_size, 1)
        if 'seed' in learn_kwargs or 'public_gradients' in learn_kwargs:
            raise ValueError('learn_kwargs must not set seed or '
                             'public_gradients.')
        if replan_config is None and (budget_split, budget_quantile) != (
                None, None):
            raise ValueError('budget_split and budget_quantile re-split a '
                             'budget: give them with replan_config only.')
        if replan_config is not None:
            if not isinstance(replan_config, config_lib.TwiceSamplingConfig):
                raise ValueError(
                    'replan_config must be a tf_twice.TwiceSamplingConfig; '
                    f'got {type(replan_config).__name__}.')
            budget_split = budget_split or budget_splits.DEFAULT_BUDGET_SPLIT
            budget_splits.check_budget_split(budget_split, budget_quantile)
        self._replan = (replan_config, budget_split, budget_quantile)
        x, y = public_data
        self._basis_model = model
        self._x, self._y = x, y
        self._loss = per_example_loss
        self._on_refresh = on_refresh
        self._training = training
        self._learn_kwargs = learn_kwargs
        self._step = 0
        self.refresh_count = 0
        self.basis: Optional[HybridBasis] = None
        self.block_scales: Optional[Tuple[float, ...]] = None

    def refresh(self) -> HybridBasis:
        """Learns a basis (and, with ``replan_config``, block scales) now
        from the public data and current weights."""
        grads = public_per_example_gradients(
            self._basis_model, self._loss, self._x, self._y,
            batch_size=self._batch_size, training=self._training)
        self.basis = learn_basis(grads, seed=self._seed + self.refresh_count,
                                 **self._learn_kwargs)
        self.refresh_count += 1
        config, budget_split, budget_quantile = self._replan
        if config is not None:
            self.block_scales = replanned_block_scales(
                config, self.basis, grads, budget_split=budget_split,
                budget_quantile=budget_quantile)
        if self._on_refresh is not None:
            if config is None:
                self._on_refresh(self.basis)
            else:
                self._on_refresh(self.basis, block_scales=self.block_scales)
        return self.basis

    def on_train_batch_begin(self, batch, logs=None):
        if self._step % self._every == 0:
            self.refresh()

    def on_train_batch_end(self, batch, logs=None):
        self._step += 1
