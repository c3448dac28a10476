"""Mistakes in fit's input are refused before any step, naming the
argument, instead of surfacing as a trace of the DP step."""

import numpy as np
import pytest
import tensorflow as tf

from tests import tiny_models

from tf_twice import sampling
from tf_twice.config import TwiceSamplingConfig
from tf_twice.keras import DPModel, PrivacyLedger

N, BATCH = 64, 16
X, Y = tiny_models.data(N, seed=2)


def _model(loss=None):
    config = TwiceSamplingConfig.single(
        num_examples=N, expected_batch_size=BATCH, l2_norm_clip=1.0,
        noise_multiplier=1.0)
    model = DPModel(tiny_models.mlp(), config)
    model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss=loss or
                  tf.keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    return model, PrivacyLedger.for_model(model, delta=1e-5, verbose=0)


@pytest.mark.parametrize('x, y, loss, match', [
    (X, Y.astype(str), None, 'labels \\(y\\) are strings'),
    (X, np.eye(tiny_models.NUM_CLASSES, dtype=np.float32)[Y], None,
     'one-hot'),
    (X[:, :-1], Y, None, 'inputs \\(x\\) have per-example shape'),
])
def test_bad_input_is_refused_before_any_step(x, y, loss, match):
    model, ledger = _model(loss)
    data = sampling.poisson_batches(x, y, expected_batch_size=BATCH, seed=0)
    with pytest.raises(ValueError, match=match):
        model.fit(data, epochs=1, callbacks=[ledger], verbose=0)
    assert int(model.optimizer.iterations) == 0 and ledger.steps == 0


def test_one_hot_labels_train_with_a_categorical_loss():
    model, ledger = _model(tf.keras.losses.CategoricalCrossentropy(
        from_logits=True))
    y = np.eye(tiny_models.NUM_CLASSES, dtype=np.float32)[Y]
    data = sampling.poisson_batches(X, y, expected_batch_size=BATCH, seed=0)
    model.fit(data, epochs=1, steps_per_epoch=2, callbacks=[ledger],
              verbose=0)
    assert ledger.steps == 2


def test_a_mapped_pipeline_is_refused_with_what_its_elements_are():
    model, ledger = _model()
    data = sampling.poisson_batches(X, Y, expected_batch_size=BATCH, seed=0)
    with pytest.raises(ValueError, match='\\(x, y, sample_weight\\) triples'):
        model.fit(data.map(lambda x, y, w: (x * 2, y, w)), epochs=1,
                  callbacks=[ledger], verbose=0)


def test_poisson_steps_without_any_ledger_are_warned_about():
    # Sound steps, but nothing accounts them or stops them at a budget
    # (e.g. a model reloaded from a file, whose attached ledger is gone).
    model, _ = _model()
    data = sampling.poisson_batches(X, Y, expected_batch_size=BATCH, seed=0)
    with pytest.warns(UserWarning, match='nothing here accounts them'):
        model.fit(data, epochs=1, steps_per_epoch=1, verbose=0)
