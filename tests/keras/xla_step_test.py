"""DPModel's DP step compiled whole by XLA (``compile(jit_compile=True)``):
the same step as without XLA, and weights outside [0, 1] still refused."""

import numpy as np
import pytest
import tensorflow as tf

from tests import tiny_models
from tests.hybrid_setup import basis as _basis
from tests.hybrid_setup import params as _hybrid_params
from tf_twice import sampling
from tf_twice.keras import DPModel, PrivacyLedger

SEED = 11


def _compiled(jit_compile, *, hybrid=False, physical_batch_size=4):
    model = tiny_models.mlp()
    if hybrid:
        dp = DPModel(model, _hybrid_params(), basis=_basis(),
                     physical_batch_size=physical_batch_size, seed=SEED)
    else:
        dp = tiny_models.dp_model(
            model, physical_batch_size=physical_batch_size, seed=SEED,
            num_examples=24, expected_batch_size=6.0, l2_norm_clip=0.5,
            linf_norm_clip=0.2, coordinate_sampling_rate=0.5)
    dp.compile(optimizer=tf.keras.optimizers.SGD(0.3),
               loss=tf.keras.losses.SparseCategoricalCrossentropy(
                   from_logits=True), jit_compile=jit_compile)
    return dp


def _poisson():
    # Batches of any size k (no padding by the pipeline): the XLA step pads
    # each to whole chunks itself.
    x, y = tiny_models.data(24, seed=3)
    return sampling.poisson_batches(x, y, example_sampling_rate=0.25,
                                    steps=3, seed=2)


@pytest.mark.parametrize('hybrid', [False, True])
def test_the_xla_step_is_the_step_without_xla(hybrid):
    runs = []
    for jit_compile in (False, True):
        dp = _compiled(jit_compile, hybrid=hybrid)
        ledger = PrivacyLedger.for_model(dp, delta=1e-5, verbose=0)
        dp.fit(_poisson(), callbacks=[ledger], verbose=0)
        assert ledger.steps == 3
        runs.append(([v.numpy() for v in dp.trainable_variables],
                     dp.privacy_record.numpy()))
    (plain, plain_record), (xla, xla_record) = runs
    # Same seeded keys, so the same masks and noise; XLA orders the float
    # arithmetic its own way.
    for a, b in zip(plain, xla):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(plain_record, xla_record)
    initial = tiny_models.mlp().get_weights()
    assert not np.allclose(initial[0], xla[0])


def test_a_weight_outside_the_range_is_refused_before_the_xla_step():
    dp = _compiled(True)
    before = [v.numpy() for v in dp.trainable_variables]
    x, y = tiny_models.data(6, seed=1)
    weights = np.array([1, 1, 1.5, 0, 1, 1], np.float32)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r'sample_weight must be finite and in \[0, 1\]'):
        tiny_models.one_step(dp, x, y, sample_weight=weights)
    assert int(dp.privacy_record.numpy()[0]) == 0
    for a, b in zip(before, dp.trainable_variables):
        np.testing.assert_array_equal(a, b.numpy())


def test_an_empty_logical_batch_is_a_step_under_xla():
    # A Poisson batch may be empty: a valid step whose update is noise.
    dp = _compiled(True)
    x, y = tiny_models.data(0, seed=1)
    tiny_models.one_step(dp, x, y)
    assert int(dp.privacy_record.numpy()[0]) == 1


def test_jit_compile_must_be_true_or_false():
    dp = tiny_models.dp_model(tiny_models.mlp(), expected_batch_size=6.0,
                              num_examples=24)
    with pytest.raises(ValueError, match='jit_compile must be True or False'):
        dp.compile(optimizer='sgd', loss='sparse_categorical_crossentropy',
                   jit_compile='auto')
