"""Tests of the canary audit: its statistics, and audits of the real step.

The audited model is a linear regression without bias, initialised at zero,
with the squared loss: a record (x, y) has gradient -2 y x, so a canary with
a large y and x on a few coordinates that no other record uses has a
gradient that clipping turns into exactly the accountant's worst case (every
coordinate it touches at the l-infinity clip). The released update is then
the dominating pair of the twice-sampling analysis, up to the linear score.
"""

import math

import attr
import numpy as np
import pytest
from scipy import stats
import tensorflow as tf

from tests import tiny_models

from tf_twice import auditing
from tf_twice import sampling
from tf_twice.keras import PrivacyLedger
from tf_twice.keras import privacy_record
from tf_twice.mechanism import basis as basis_lib

DIM = 4
# Epsilon is reported at this delta; one step with a few thousand trials can
# only certify epsilon up to about log(trials), so a larger delta than in
# training keeps the accountant's one-step epsilon in that range.
DELTA = 1e-2


def _linear():
    return tf.keras.Sequential([tf.keras.layers.Dense(
        1, use_bias=False, kernel_initializer='zeros', input_shape=(DIM,))])


def _private(**dp_kwargs):
    """A compiled DPModel; n = ``num_examples`` is the config's."""
    model = tiny_models.dp_model(_linear(), **dp_kwargs)
    model.compile(optimizer=tf.keras.optimizers.SGD(0.1),
                  loss=tf.keras.losses.MeanSquaredError())
    return model


def _canary(*coordinates):
    """A record whose gradient at zero weights is -200 on `coordinates`."""
    x = np.zeros(DIM, np.float32)
    x[list(coordinates)] = 1.0
    return x, np.array([100.0], np.float32)


# --- the statistics ----------------------------------------------------------

def test_clopper_pearson_upper_matches_closed_forms():
    # No success in n trials: the bound solves (1 - p)^n = alpha.
    assert auditing.clopper_pearson_upper(0, 1000, 0.05) == pytest.approx(
        1 - 0.05 ** (1 / 1000), rel=1e-9)
    assert auditing.clopper_pearson_upper(7, 7, 0.05) == 1.0
    upper = auditing.clopper_pearson_upper(30, 100, 0.025)
    assert stats.binom.cdf(30, 100, upper) == pytest.approx(0.025, rel=1e-6)
    with pytest.raises(ValueError):
        auditing.clopper_pearson_upper(5, 4, 0.05)


def test_epsilon_lower_bound_formula():
    fpr = 1 - 0.025 ** (1 / 2000)
    fnr = auditing.clopper_pearson_upper(1000, 2000, 0.025)
    assert auditing.epsilon_lower_bound(
        0, 2000, 1000, 2000, delta=1e-3, confidence=0.95) == pytest.approx(
            math.log((1 - 1e-3 - fnr) / fpr))
    # The symmetric test (few false negatives) gives the other bound.
    assert auditing.epsilon_lower_bound(
        1000, 2000, 0, 2000, delta=1e-3, confidence=0.95) == pytest.approx(
            math.log((1 - 1e-3 - fnr) / fpr))
    # A useless test certifies nothing, and the bound is never negative.
    assert auditing.epsilon_lower_bound(
        1000, 2000, 1000, 2000, delta=1e-3) == 0.0
    with pytest.raises(ValueError):
        auditing.epsilon_lower_bound(0, 10, 0, 10, delta=1.0)
    with pytest.raises(ValueError):
        auditing.epsilon_lower_bound(0, 10, 0, 10, delta=0.0, confidence=1.0)


def test_select_threshold_separates_the_worlds():
    rng = np.random.default_rng(0)
    without = rng.standard_normal(500)
    with_ = rng.standard_normal(500) + 10.0
    threshold = auditing.select_threshold(without, with_, delta=0.0)
    assert without.max() <= threshold < with_.min()


# --- audits of the real step -------------------------------------------------

def test_twice_sampling_audit_stays_below_the_accountant():
    # q1 = 1, q2 = 0.5, d0 = (c2 / c_inf)^2 = 2; the canary's clipped
    # gradient has both of its coordinates at c_inf. The background records
    # use the other two coordinates only.
    model = _private(l2_norm_clip=1.0, linf_norm_clip=1 / math.sqrt(2),
                     noise_multiplier=0.7, coordinate_sampling_rate=0.5,
                     expected_batch_size=6.0, num_examples=6,
                     physical_batch_size=4, seed=1)
    rng = np.random.default_rng(1)
    background_x = np.zeros((5, DIM), np.float32)
    background_x[:, 2:] = rng.standard_normal((5, 2))
    background_y = rng.standard_normal((5, 1)).astype(np.float32)
    before = [v.numpy() for v in model.trainable_variables]

    result = auditing.audit_one_step(
        model, _canary(0, 1), num_trials=1000, delta=DELTA,
        background=(background_x, background_y), seed=2)

    print(result)
    assert result.num_trials == 1000
    assert result.confidence == 0.95
    assert 0.5 < result.epsilon_lower_bound < result.accountant_epsilon
    assert not result.refutes_accountant
    assert result.accountant_epsilon == pytest.approx(2.79, abs=0.01)
    for value, variable in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(value, variable.numpy())


def test_hybrid_audit_stays_below_the_accountant():
    # One principal block spanned by coordinate 1, then the residual. The
    # canary's coefficient is clipped to c2_1 and its residual (coordinates
    # 0 and 2) to c2_2 with both coordinates at c_inf_2: the worst case of
    # both blocks at once.
    principal = np.zeros((DIM, 1), np.float32)
    principal[1, 0] = 1.0
    basis = basis_lib.HybridBasis([principal], [[1]], groups=[[0]],
                                  variable_shapes=[(DIM, 1)])
    model = _private(basis=basis, l2_norm_clip=[0.6, 0.8],
                     linf_norm_clip=[None, 0.8 / math.sqrt(2)],
                     noise_multiplier=[0.6, 0.6],
                     coordinate_sampling_rate=0.5, expected_batch_size=1.0,
                     num_examples=1, physical_batch_size=1, seed=3)
    event = model.dp_event()
    assert event.block_dimensions == (1, DIM)

    result = auditing.audit_one_step(
        model, _canary(0, 1, 2), num_trials=1000,
        delta=DELTA, seed=4)

    print(result)
    assert 0.5 < result.epsilon_lower_bound < result.accountant_epsilon


def test_audit_catches_halved_noise():
    # The mechanism adds noise with multiplier z / 2 while the accountant is
    # asked about z: the audit must refute the accountant's epsilon.
    z = 0.7
    broken = _private(l2_norm_clip=1.0, linf_norm_clip=1.0,
                      noise_multiplier=z / 2, coordinate_sampling_rate=0.5,
                      expected_batch_size=1.0, num_examples=2,
                      physical_batch_size=1, seed=5)
    claimed = attr.evolve(broken.dp_event(), noise_multiplier=z)

    result = auditing.audit_one_step(
        broken, _canary(0), num_trials=10_000, delta=DELTA,
        claimed_event=claimed, seed=6)

    print(result)
    assert result.accountant_epsilon == pytest.approx(2.45, abs=0.01)
    assert result.refutes_accountant
    assert result.epsilon_lower_bound > result.accountant_epsilon + 0.5


def test_a_ledger_after_an_audit_charges_only_the_steps_the_weights_hold():
    # The audit's trials run steps but restore the weights and their
    # record: a ledger that then trains the model neither charges them nor
    # refuses them.
    model = _private(l2_norm_clip=1.0, noise_multiplier=1.0,
                     expected_batch_size=2.0, num_examples=8,
                     physical_batch_size=2)
    auditing.audit_one_step(model, _canary(0), num_trials=20, delta=DELTA)
    assert int(model.steps_taken) == 0
    ledger = PrivacyLedger.for_model(model, delta=1e-5, verbose=0)
    x = np.ones([8, DIM], np.float32)
    model.fit(sampling.poisson_batches(x, np.ones([8, 1], np.float32),
                                       physical_batch_size=2,
                                       expected_batch_size=2.0, steps=3,
                                       seed=0),
              callbacks=[ledger], verbose=0)
    assert ledger.steps == 3


def test_audit_runs_without_seeds_and_checks_arguments():
    model = _private(l2_norm_clip=1.0, noise_multiplier=1.0,
                     expected_batch_size=1.0, num_examples=1,
                     physical_batch_size=1)
    result = auditing.audit_one_step(model, _canary(0), num_trials=50,
                                     delta=DELTA)
    assert result.num_evaluation_trials == 35
    assert math.isfinite(result.epsilon_lower_bound)
    assert result.epsilon_lower_bound >= 0.0
    with pytest.raises(ValueError, match='num_trials'):
        auditing.audit_one_step(model, _canary(0), num_trials=1,
                                delta=DELTA)
    with pytest.raises(ValueError, match='non-zero'):
        auditing.audit_one_step(model, _canary(0), num_trials=10,
                                delta=DELTA, direction=[np.zeros((DIM, 1))])


def test_a_ledger_before_an_audit_does_not_charge_its_trials():
    model = _private(l2_norm_clip=1.0, noise_multiplier=1.0,
                     expected_batch_size=2.0, num_examples=8,
                     physical_batch_size=2)
    ledger = PrivacyLedger.for_model(model, delta=1e-5, verbose=0)
    x = np.ones([8, DIM], np.float32)

    def data(seed):
        return sampling.poisson_batches(x, np.ones([8, 1], np.float32),
                                        physical_batch_size=2,
                                        expected_batch_size=2.0, steps=3,
                                        seed=seed)

    model.fit(data(0), callbacks=[ledger], verbose=0)
    before = privacy_record.read(model)
    auditing.audit_one_step(model, _canary(0), num_trials=20, delta=DELTA)
    assert privacy_record.read(model) == before  # Restored with the weights.
    model.fit(data(1), callbacks=[ledger], verbose=0)
    assert ledger.steps == 6  # Not 6 + the audit's 41 draws.
