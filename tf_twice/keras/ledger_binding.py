"""Binds a DP model's weights to the ledger history that accounts them.

A `DPModel` holds two non-trainable int64 weights, saved and restored with
the others in every checkpoint kind (TF checkpoints, `.weights.h5`,
`.keras`, `BackupAndRestore`, `tf.train.Checkpoint`):

* `steps_taken`: the DP steps these weights hold, counted inside the
  train step itself (so also steps no ledger saw, and the step a
  checkpoint callback listed before the ledger saves); a recompile does
  not reset it, an audit restores it with the weights.
* `ledger_binding`: [steps, digest] of the `PrivacyLedger` history that
  last charged them: how many steps it had charged and which events they
  were, in order (`tf_twice.accounting.ledger_state.history_digest`);
  zeros before any ledger.

A ledger checks both before a model's first step and after every charge,
then binds the weights to its own history. It refuses weights that hold
more steps than it charged (a new ledger on a restored checkpoint, even
with a fresh optimizer; a stale copy of the state file; steps of a `fit`
without it), or whose binding is not a prefix of its own history (another
run's state file of other events; an event or a count edited in the file
with its digest recomputed; weights reloaded under it from another run;
another ledger that has since charged them). Then its first steps are the
ones the weights were bound to and it holds at least as many steps as they
do, so its epsilon bounds theirs (RDP only grows with more steps), if the
steps that ran after the last binding ran under its event: those of a
`fit` without a ledger are the user's to vouch for.

What it cannot see: weights loaded into the wrapped model itself (outside
any DPModel) carry neither weight; the user vouches for those, as for any
public starting point.
"""

from __future__ import annotations

from typing import Any, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_twice import _keras
from tf_twice.accounting import budget as budget_lib

__all__ = ['add_variables', 'bind', 'check_binding', 'count_step']


def add_variables(model: tf.keras.Model) -> Tuple[Any, Any]:
    """(steps_taken, ledger_binding), zero, as weights of a new `model`."""
    # Every replica adds the step; the first one's count is kept.
    first_replica = ('only_first_replica' if _keras.IS_KERAS_3 else
                     tf.VariableAggregation.ONLY_FIRST_REPLICA)
    steps_taken = model.add_weight(
        name='dp_steps_taken', shape=(), dtype='int64', initializer='zeros',
        trainable=False, aggregation=first_replica)
    binding = model.add_weight(
        name='privacy_ledger_binding', shape=(2,), dtype='int64',
        initializer='zeros', trainable=False)
    return steps_taken, binding


def count_step(model: tf.keras.Model, update: Sequence[tf.Tensor]) -> None:
    """Counts one DP step in `model`'s weights (inside its train step), once
    its noisy `update` exists (a step refused before it counts nothing)."""
    with tf.control_dependencies(list(update)):
        model.steps_taken.assign_add(1)


def _words(model: tf.keras.Model) -> Tuple[int, int, int]:
    taken = int(np.asarray(model.steps_taken.numpy()))
    steps, digest = (int(w) for w in np.asarray(model.ledger_binding.numpy()))
    return taken, steps, digest


def check_binding(model: tf.keras.Model,
                  budget: budget_lib.PrivacyBudget) -> None:
    """Refuses `model` unless `budget` holds at least the steps its weights
    hold and its history begins with the one they were bound to.

    Raises:
      ValueError: naming the steps and what to do.
    """
    if getattr(model, 'ledger_binding', None) is None:
        return
    taken, steps, digest = _words(model)
    name = model.name
    if taken < 0 or steps < 0 or digest < 0 or (steps == 0) != (digest == 0):
        raise ValueError(
            f'{name}\'s steps_taken and ledger_binding ({taken}, [{steps}, '
            f'{digest}]) are not values a ledger wrote (weights set by '
            'arithmetic on get_weights()?): the steps they hold are unknown. '
            'Restore them from a checkpoint.')
    load = ('Load the state file written with these weights '
            '(state_path=...), or continue from their ledger '
            '(PrivacyLedger.from_state(ledger.get_state())); if the weights '
            'are a public starting point (their privacy accounted '
            'elsewhere), wrap model.inner_model in a new DPModel.')
    missing = max(steps, taken) - budget.steps
    record = (' If they ran under this ledger\'s event and are accounted '
              'nowhere else, charge them with '
              f'ledger.record_steps({missing}).')
    if steps > budget.steps:
        raise ValueError(
            f'{name}\'s weights were trained with {steps} DP steps a ledger '
            f'charged, but this PrivacyLedger holds only {budget.steps}: a '
            'new ledger or a stale copy of the state file. ' + load
            + record)
    if steps and digest != budget.history_digest(steps):
        raise ValueError(
            f'The first {steps} steps this PrivacyLedger holds are not the '
            f'steps {name}\'s weights were trained with (other events, or '
            'the same in another order): another run\'s state file, one '
            'whose events or counts were edited, weights loaded from another '
            'run, or weights another ledger has charged since. ' + load)
    if taken > budget.steps:
        raise ValueError(
            f'{name}\'s weights hold {taken} DP steps, but this PrivacyLedger '
            f'has charged only {budget.steps}: steps ran that no ledger '
            'charged here (a fit without it, a stale copy of the state '
            'file). ' + load + record)


def bind(model: tf.keras.Model, budget: budget_lib.PrivacyBudget) -> None:
    """Records `budget`'s steps and their history in `model`'s weights,
    after `check_binding` refused weights `budget` does not account: a
    binding only moves forward.

    Raises:
      ValueError: from `check_binding`; nothing is recorded then.
    """
    check_binding(model, budget)
    if getattr(model, 'ledger_binding', None) is not None:
        steps = budget.steps  # The digest of exactly these steps.
        model.ledger_binding.assign(np.array(
            [steps, budget.history_digest(steps) if steps else 0], np.int64))
