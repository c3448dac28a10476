"""Binds a DP model's weights to the ledger history that accounts them.

A `DPModel` holds one non-trainable int64 variable, `ledger_binding`:
[steps, digest] of the `PrivacyLedger` that last charged its steps: how
many steps it had charged and which events they were, in order
(`tf_twice.accounting.ledger_state.history_digest`); zeros before any
ledger. It is saved and restored with the weights in every checkpoint kind
(TF checkpoints, `.weights.h5`, `.keras`, `BackupAndRestore`). A ledger
checks it before a model's first step and updates it after every charge,
and refuses weights unless its own first steps are the ones they were
trained with: then its epsilon bounds theirs (RDP only grows with more
steps). Refused are weights bound

* after more steps than the ledger holds: a new ledger on weights a ledger
  already charged (even with a fresh optimizer, whose step count is 0), or
  a stale copy of the state file;
* to other events: another run's state file beside a checkpoint, or an
  event or a count edited in the file (with its digest recomputed).

What it cannot see: weights loaded into the wrapped model itself (outside
any DPModel) carry no binding; the user vouches for those, as for any
public starting point.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import tensorflow as tf

from tf_twice.accounting import budget as budget_lib

__all__ = ['add_binding_variable', 'bind', 'check_binding']

VARIABLE_NAME = 'privacy_ledger_binding'


def add_binding_variable(model: tf.keras.Model) -> Any:
    """The zero binding variable of a new `model` (a Keras weight)."""
    return model.add_weight(name=VARIABLE_NAME, shape=(2,), dtype='int64',
                            initializer='zeros', trainable=False)


def _binding(model: tf.keras.Model) -> Optional[Any]:
    return getattr(model, 'ledger_binding', None)


def check_binding(model: tf.keras.Model,
                  budget: budget_lib.PrivacyBudget) -> None:
    """Refuses `model` unless `budget`'s first steps are those its weights
    were bound to (see the module docstring).

    Raises:
      ValueError: naming the steps and what to do.
    """
    variable = _binding(model)
    if variable is None:
        return
    steps, digest = (int(w) for w in np.asarray(variable.numpy()))
    if steps == 0:
        return  # No ledger has charged these weights.
    load = ('Load the state file written with these weights '
            '(state_path=...), or continue from their ledger '
            '(PrivacyLedger.from_state(ledger.get_state())); if the weights '
            'are a public starting point (their privacy accounted '
            'elsewhere), wrap model.inner_model in a new DPModel.')
    if steps > budget.steps:
        raise ValueError(
            f'{model.name}\'s weights hold {steps} DP steps a ledger charged, '
            f'but this PrivacyLedger holds only {budget.steps}: a new ledger '
            'or a stale copy of the state file. ' + load + ' If they ran '
            'under this ledger\'s event and are accounted nowhere else, '
            f'charge them with ledger.record_steps({steps - budget.steps}).')
    if digest != budget.history_digest(steps):
        raise ValueError(
            f'The first {steps} steps this PrivacyLedger holds are not the '
            f'steps {model.name}\'s weights were trained with (other events, '
            'or the same in another order): another run\'s state file, or '
            'one whose events or counts were edited. ' + load)


def bind(model: tf.keras.Model, budget: budget_lib.PrivacyBudget) -> None:
    """Records `budget`'s steps and their history in `model`'s weights."""
    variable = _binding(model)
    if variable is not None:
        steps = budget.steps  # The digest of exactly these steps.
        variable.assign(
            np.array([steps, budget.history_digest(steps)], np.int64))
