"""``plan_hybrid_clipping``: hybrid clipping planned from public data in one call.

```python
hybrid = tf_twice.keras.plan_hybrid_clipping(
    model, loss, x_public, y_public, config, ranks=(32, 96),
    target_epsilon=3.0, delta=1e-5, steps=400)
training = tf_twice.keras.make_private(
    model, hybrid.config, x, y, basis=hybrid.basis, delta=1e-5, steps=400)
```

It chains the three host-side steps that were separate calls: the PUBLIC
per-example gradients at the model's current weights
(``basis_refresh.public_per_example_gradients``), the basis learned from
them (``tf_twice.hybrid.learn_basis``) and the per-block config
(``tf_twice.hybrid.plan_blocks``: the global l2 budget split over blocks,
l-infinity clips, per-block noise optimised for the budget). Guarantee: only
the public examples, the model's weights and the arguments are read, so the
plan costs no privacy; the config it returns is what the ledger accounts.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence, Union

import tensorflow as tf

from tf_twice import _validate
from tf_twice import config as config_lib
from tf_twice.hybrid import budgets
from tf_twice.hybrid import learning
from tf_twice.keras import basis_refresh
from tf_twice.mechanism import basis as basis_lib

__all__ = ['HybridPlan', 'plan_hybrid_clipping']


class HybridPlan(NamedTuple):
    """What ``plan_hybrid_clipping`` returns (unpacks as config, basis).

    Attributes:
      config: one ``Block`` per basis block (principal blocks, then the
        residual), dimensions set; pass it to ``DPModel``/``make_private``.
      basis: the ``HybridBasis`` learned from the public examples; pass it
        as ``basis=``.
    """
    config: config_lib.TwiceSamplingConfig
    basis: basis_lib.HybridBasis


def plan_hybrid_clipping(
        model: tf.keras.Model,
        loss: Any,
        public_x: Any,
        public_y: Any,
        config: config_lib.TwiceSamplingConfig,
        *,
        ranks: Sequence[int],
        groups: Union[None, int, Sequence[Sequence[int]]] = None,
        seed: int = 0,
        batch_size: int = 256,
        target_epsilon: Optional[float] = None,
        delta: Optional[float] = None,
        steps: Optional[int] = None,
        **plan_blocks_kwargs: Any) -> HybridPlan:
    """The basis and per-block config of hybrid clipping, from PUBLIC data.

    Args:
      model: the Keras model to train, at the weights training starts from.
      loss: the per-example loss, as ``DPModel`` reads it (a Keras ``Loss``,
        a name, or (y_true, y_pred) -> per-example losses).
      public_x, public_y: PUBLIC examples (never the private set).
      config: a one-block ``TwiceSamplingConfig``: n, q1, q2, the global l2
        budget c, the residual's l-infinity clip (or None), and a noise
        multiplier (every block gets it) or None (per-block noise optimised
        for ``target_epsilon`` after ``steps``).
      ranks: the principal blocks' ranks r_j >= 1 (``learn_basis``).
      groups: parameter groups of the basis (``learn_basis``).
      seed: of the basis's power iterations (public, not secret).
      batch_size: public examples per vectorised chunk, >= 1.
      target_epsilon, delta, steps: the budget the per-block noise must meet;
        required exactly when ``config`` has no noise multiplier.
      **plan_blocks_kwargs: ``residual_d0``, ``principal_d0``,
        ``principal_coordinate_sampling_rate``, ``budget_split``,
        ``budget_quantile``, ``noise_objective``, ``orders``, ``conversion`` of
        ``tf_twice.hybrid.plan_blocks``.

    Returns:
      A ``HybridPlan`` (config, basis).

    Raises:
      ValueError: an argument outside its range (named), a config that is
        not one block, or a target no noise meets.
    """
    if not isinstance(config, config_lib.TwiceSamplingConfig):
        raise ValueError('config must be a tf_twice.TwiceSamplingConfig; got '
                         f'{type(config).__name__}.')
    if config.num_blocks != 1:
        raise ValueError('config must have one Block (the global budget); '
                         f'got {config.num_blocks}.')
    seed = _validate.integer('seed', seed, 0)
    gradients = basis_refresh.public_per_example_gradients(
        model, loss, public_x, public_y, batch_size=batch_size)
    basis = learning.learn_basis(gradients, ranks, groups=groups, seed=seed)
    budget = dict(target_epsilon=target_epsilon, delta=delta, steps=steps)
    planned = budgets.plan_blocks(
        config, basis, gradients,
        **{k: v for k, v in budget.items() if v is not None},
        **plan_blocks_kwargs)
    return HybridPlan(planned, basis)
