"""End to end: DP training on scikit-learn's digits through `fit`.

Poisson-sampled logical batches (tf_twice.sampling) feed `DPModel`'s
twice-sampling, hybrid-clipping train step; `PrivacyLedger` accounts for
every step. The 8x8 digits ship with scikit-learn, so nothing is downloaded.
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_twice import sampling
from tf_twice.accounting import TwiceSampledGaussianDpEvent
from tf_twice.accounting import TwiceSamplingRdpAccountant
from tf_twice.config import TwiceSamplingConfig
from tf_twice.keras import guards
from tf_twice.keras.ledger import PrivacyLedger

dp_model = pytest.importorskip('tf_twice.keras.dp_model')
datasets = pytest.importorskip('sklearn.datasets')

DELTA = 1e-5


def _digits():
    digits = datasets.load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    perm = np.random.default_rng(0).permutation(len(x))
    x, y = x[perm], y[perm]
    return (x[:1500], y[:1500]), (x[1500:], y[1500:])


def test_dp_fit_on_digits_learns_and_ledger_matches_accountant():
    (x_train, y_train), (x_test, y_test) = _digits()
    batch, q2, z, c2, c_inf = 64, 0.5, 1.0, 1.0, 0.3
    q1 = batch / len(x_train)
    inner = tf.keras.Sequential([tf.keras.layers.Dense(
        10, input_shape=(64,),
        kernel_initializer=tf.keras.initializers.GlorotUniform(seed=0))])
    loss = tf.keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction='none')
    guards.check_no_example_mixing(inner)
    guards.check_per_example_loss(loss)
    config = TwiceSamplingConfig.single(
        num_examples=len(x_train), expected_batch_size=batch,
        l2_norm_clip=c2, noise_multiplier=z, linf_norm_clip=c_inf,
        coordinate_sampling_rate=q2)
    model = dp_model.DPModel(inner, config, physical_batch_size=32, seed=0)
    model.compile(optimizer=tf.keras.optimizers.SGD(1.0), loss=loss,
                  metrics=['accuracy'])

    data = sampling.poisson_batches(x_train, y_train, physical_batch_size=32,
                                    expected_batch_size=batch, seed=0)
    guards.check_poisson_input(data, example_sampling_rate=q1)
    event = TwiceSampledGaussianDpEvent(
        example_sampling_rate=q1, coordinate_sampling_rate=q2,
        noise_multiplier=z, l2_norm_clip=c2, linf_norm_clip=c_inf)
    ledger = PrivacyLedger(event, DELTA, target_epsilon=3.0)
    epochs = 15
    history = model.fit(data, epochs=epochs, callbacks=[ledger], verbose=0)

    steps_per_epoch = sampling.poisson_schedule(
        len(x_train), example_sampling_rate=q1).steps_per_epoch
    assert ledger.steps == epochs * steps_per_epoch
    assert int(model.optimizer.iterations) == ledger.steps
    expected = TwiceSamplingRdpAccountant().compose(
        event, ledger.steps).get_epsilon(DELTA)
    assert ledger.epsilon == pytest.approx(expected, rel=1e-12)
    assert history.history['epsilon'][-1] == pytest.approx(expected)
    assert ledger.epsilon < 3.0

    predictions = inner.predict(x_test, verbose=0)
    accuracy = np.mean(np.argmax(predictions, axis=-1) == y_test)
    assert accuracy > 0.7, accuracy  # Chance is 0.1.
