"""What the PrivacyLedger tests share: one event, its data and a model."""

import numpy as np
import tensorflow as tf

from tf_twice import sampling
from tf_twice.accounting import TwiceSampledGaussianDpEvent
from tf_twice.accounting import TwiceSamplingRdpAccountant

DELTA = 1e-5
Q1 = 0.25
EVENT = TwiceSampledGaussianDpEvent(
    example_sampling_rate=Q1, coordinate_sampling_rate=0.5,
    noise_multiplier=1.0, l2_norm_clip=1.0, linf_norm_clip=0.5)
OTHER_EVENT = TwiceSampledGaussianDpEvent(
    example_sampling_rate=Q1, coordinate_sampling_rate=0.5,
    noise_multiplier=(2.0, 3.0), l2_norm_clip=(1.0, 0.5),
    linf_norm_clip=None)
RNG = np.random.default_rng(0)
X = RNG.normal(size=[64, 4]).astype(np.float32)
Y = RNG.normal(size=[64, 3]).astype(np.float32)


def accountant_epsilon(*event_counts):
    accountant = TwiceSamplingRdpAccountant()
    for event, count in event_counts:
        accountant.compose(event, count)
    return accountant.get_epsilon(DELTA)


def data(steps=5, seed=1):
    # Plain Keras training: the ledger only counts steps. n * q1 = 16, so an
    # empty batch (probability 0.75^64) does not occur.
    return sampling.poisson_batches(X, Y, physical_batch_size=8,
                                    example_sampling_rate=Q1, steps=steps,
                                    seed=seed)


def model(steps_per_execution=1):
    model = tf.keras.Sequential([tf.keras.layers.Dense(
        3, input_shape=(4,),
        kernel_initializer=tf.keras.initializers.GlorotUniform(seed=0))])
    model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss='mse',
                  steps_per_execution=steps_per_execution)
    return model
