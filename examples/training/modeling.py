"""The training script's model, losses, optimizer and learning-rate schedule.

The learning rate is a constant or a `tf.keras.optimizers.schedules`
schedule. Keras evaluates a schedule at the optimizer's iteration count,
which the checkpoint holds, so a resumed run continues the schedule where
the checkpoint left it.
"""

from __future__ import annotations

from typing import Any, Dict, Union

import tensorflow as tf

from tf_twice import models

from examples.training import settings
from examples.training.data import Data
from examples.training.settings import TrainConfig

LearningRate = Union[float, tf.keras.optimizers.schedules.LearningRateSchedule]


def build_inner_model(config: TrainConfig, data: Data) -> tf.keras.Model:
    """The `--model` of `tf_twice.models` for the data's shape and classes."""
    kwargs: Dict[str, Any] = dict(input_shape=data.input_shape,
                                  num_classes=data.num_classes)
    if config.model == 'small_cnn':
        # 'valid' convolutions need 10x10 inputs; 8x8 digits need 'same'.
        kwargs['padding'] = ('same' if min(data.input_shape[:2]) < 10
                             else 'valid')
    return models.build_model(config.model, **kwargs)


def loss() -> tf.keras.losses.Loss:
    return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def per_example_loss() -> tf.keras.losses.Loss:
    return tf.keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction='none')


def learning_rate(config: TrainConfig, planned_steps: int) -> LearningRate:
    """`--learning_rate` under `--lr_schedule` (checked by check_config).

    cosine: `CosineDecay` from the learning rate to `--lr_min_fraction` of it
    over `--lr_decay_steps` steps (default: the planned steps), constant
    after. step: `ExponentialDecay` with `staircase=True`, i.e. the rate is
    multiplied by `--lr_decay_rate` every `--lr_decay_steps` steps.
    """
    rate = float(config.learning_rate)
    schedules = tf.keras.optimizers.schedules
    if config.lr_schedule == 'cosine':
        decay_steps = (planned_steps if config.lr_decay_steps is None
                       else config.lr_decay_steps)
        alpha = (0.0 if config.lr_min_fraction is None
                 else float(config.lr_min_fraction))
        return schedules.CosineDecay(rate, decay_steps=max(1, decay_steps),
                                     alpha=alpha)
    if config.lr_schedule == 'step':
        decay_rate = (settings.DEFAULT_LR_DECAY_RATE
                      if config.lr_decay_rate is None
                      else float(config.lr_decay_rate))
        return schedules.ExponentialDecay(
            rate, decay_steps=config.lr_decay_steps, decay_rate=decay_rate,
            staircase=True)
    return rate


def optimizer(config: TrainConfig,
              rate: LearningRate) -> tf.keras.optimizers.Optimizer:
    """The `--optimizer` with learning rate `rate` (see `learning_rate`).

    With `--ema_momentum` the optimizer keeps an exponential moving average
    of the weights, which replaces them at the end of `fit` (Keras's
    `use_ema`). The average is a function of the released iterates, so it
    costs no privacy (post-processing); it averages the DP noise of the
    last steps out (De et al., arXiv:2204.13650, section 3).
    """
    ema = {}
    if config.ema_momentum is not None:
        ema = dict(use_ema=True, ema_momentum=float(config.ema_momentum))
    if config.optimizer == 'adam':
        return tf.keras.optimizers.Adam(rate, **ema)
    return tf.keras.optimizers.SGD(rate, momentum=config.momentum, **ema)


def current_learning_rate(rate: LearningRate, iterations: Any) -> float:
    """The rate the optimizer's next step uses: `rate` at its iteration
    count. (Keras 2's `optimizer.learning_rate` is the last step's.)"""
    if isinstance(rate, tf.keras.optimizers.schedules.LearningRateSchedule):
        rate = rate(iterations)
    return float(rate)
