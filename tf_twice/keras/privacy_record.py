"""The record of what ran, kept in a `DPModel`'s weights.

One non-trainable int64 weight, `dp_privacy_record` = [steps, digest word 1,
digest word 2], saved and restored with the others by every checkpoint kind
(TF checkpoints, `.weights.h5`, `.keras`, `BackupAndRestore`,
`tf.train.Checkpoint`). Every private train step updates it, once its noisy
update exists, with the words of the mechanism it ran: the event's, fixed
when the step is traced (a config is frozen, so a recompile with another
mechanism traces a new step), or `UNCHECKED_INPUT` for a step on input no
check showed to be Poisson-sampled. The arithmetic, and the rule by which a
`PrivacyLedger` charges a record, are in `tf_twice.accounting.step_record`.

Nothing else writes it: a ledger only reads it, an audit restores it with
the weights, a rollback restores an earlier one. Weights loaded into the
wrapped model itself (outside any DPModel) carry no record; the user vouches
for those, as for any public starting point.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import tensorflow as tf

from tf_twice import _keras
from tf_twice.accounting import ledger_state
from tf_twice.accounting import step_record

__all__ = ['add_variable', 'count_step', 'has_record', 'read', 'step_words']


def add_variable(model: tf.keras.Model) -> Any:
    """The record, empty, as a weight of a new `model`."""
    # Every replica computes the same update; the first one's is kept.
    first_replica = ('only_first_replica' if _keras.IS_KERAS_3 else
                     tf.VariableAggregation.ONLY_FIRST_REPLICA)
    return model.add_weight(
        name='dp_privacy_record', shape=(3,), dtype='int64',
        initializer='zeros', trainable=False, aggregation=first_replica)


def step_words(aggregator: Any, input_checked: tf.Variable) -> tf.Tensor:
    """The words one step of `aggregator` writes (int64 [2]): its event's,
    or `UNCHECKED_INPUT` while `input_checked` is False. Called at trace
    time: the config, and so the event, is frozen."""
    config = aggregator.config
    if config.non_private:
        return tf.constant(step_record.NON_PRIVATE, tf.int64)
    words = step_record.event_words(
        ledger_state.event_key(aggregator.dp_event()))
    return tf.where(input_checked, tf.constant(words, tf.int64),
                    tf.constant(step_record.UNCHECKED_INPUT, tf.int64))


def count_step(record: tf.Variable, update: Sequence[tf.Tensor],
               words: tf.Tensor) -> None:
    """Adds one step of `words` to `record` (inside the train step), once
    the noisy `update` exists (a step refused before it counts nothing)."""
    with tf.control_dependencies(list(update)):
        value = tf.convert_to_tensor(record)
        digest = (value[1:] * tf.constant(step_record.MULTIPLIERS, tf.int64)
                  + words) % step_record.MODULUS
        record.assign(tf.concat([value[:1] + 1, digest], 0))


def has_record(model: Any) -> bool:
    """Whether `model` keeps a record (a DPModel), without reading it."""
    return getattr(model, 'privacy_record', None) is not None


def read(model: Any) -> Optional[step_record.Record]:
    """`model`'s record; None for a model without one (not a DPModel)."""
    variable = getattr(model, 'privacy_record', None)
    if variable is None:
        return None
    # .numpy() reads a MirroredVariable too (np.asarray does not).
    steps, word1, word2 = (int(v) for v in np.asarray(variable.numpy()))
    return step_record.Record(steps, (word1, word2))
