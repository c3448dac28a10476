"""A quiet console for the experiment scripts.

TensorFlow's C++ log is hidden unless TF_CPP_MIN_LOG_LEVEL is set (the
scripts set the level before TensorFlow is imported), and a few known
TensorFlow/Keras notes (KNOWN_NOISE) are dropped; every other warning, the
privacy ledger's included, is shown.
"""

from __future__ import annotations

import logging

import tensorflow as tf

# Log messages of TensorFlow and Keras that say nothing to a user of the
# scripts: vectorized_map's note that one gradient op falls back to a loop
# (it still gives per-example gradients), and Keras' timing note that the
# script's own callbacks (the ledger charges every step on the host) take
# longer than a small batch. Every other message is kept.
KNOWN_NOISE = (
    'uses a while_loop. Fix that!',
    'is slow compared to the batch time',
)


class _DropKnownNoise(logging.Filter):
    """Drops log records whose message contains one of KNOWN_NOISE."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(noise in message for noise in KNOWN_NOISE)


def quiet_known_noise() -> None:
    """Drops TensorFlow's and Keras' KNOWN_NOISE messages (idempotent).

    The filter sits on the 'tensorflow' logger, where those records are
    made; other TensorFlow messages, tf_twice's own loggers (the ledger's
    privacy warnings) and Python warnings are untouched.
    """
    logger = logging.getLogger('tensorflow')
    if not any(isinstance(f, _DropKnownNoise) for f in logger.filters):
        logger.addFilter(_DropKnownNoise())


def device_summary() -> str:
    """One line on where TensorFlow runs (its own device log is hidden)."""
    gpus = tf.config.list_physical_devices('GPU')
    where = f'{len(gpus)} GPU(s)' if gpus else 'CPU only, no GPU visible'
    return f'TensorFlow {tf.__version__}: {where}.'
