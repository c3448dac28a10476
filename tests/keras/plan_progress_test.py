"""Tests of choosing a plan by its public one-step progress
(tf_twice.keras.plan_progress)."""

import math

import attr
import numpy as np
import pytest

from tests import hybrid_setup
from tests import tiny_models
from tf_twice.keras import plan_progress


def _public(n=200, seed=0):
    """Labels a linear function of the features: a step can make
    progress."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, tiny_models.NUM_FEATURES)).astype(np.float32)
    w = np.random.default_rng(99).standard_normal(
        (tiny_models.NUM_FEATURES, tiny_models.NUM_CLASSES))
    return x, np.argmax(x @ w, axis=1)


def _config(noise_multiplier, **kwargs):
    return tiny_models.dp_config(expected_batch_size=50.0, num_examples=1000,
                                 noise_multiplier=noise_multiplier, **kwargs)


def test_the_plan_whose_update_lowers_the_public_loss_is_chosen():
    model = tiny_models.mlp()
    weights = [v.numpy() for v in model.trainable_variables]
    best, progress = plan_progress.choose_plan(
        model, hybrid_setup.loss(), *_public(),
        {'loud': (_config(300.0), None), 'quiet': (_config(0.5), None),
         'tiny clip': (_config(0.5, l2_norm_clip=1e-6), None)},
        learning_rate=0.5, draws=4)
    assert best == 'quiet'
    assert progress['quiet'].mean > 0 > progress['loud'].mean
    assert abs(progress['tiny clip'].mean) < progress['quiet'].mean / 10
    assert len(progress['quiet'].decreases) == 4
    assert math.isfinite(progress['quiet'].standard_error)
    for v, w in zip(model.trainable_variables, weights):  # Restored.
        np.testing.assert_array_equal(v.numpy(), w)


def test_a_hybrid_candidate_is_scored_on_the_same_draws_and_errors_restore():
    model = tiny_models.mlp()
    weights = [v.numpy() for v in model.trainable_variables]
    basis = hybrid_setup.basis()
    x, y = _public()
    kwargs = dict(learning_rate=0.5, draws=3, seed=5)
    one = plan_progress.public_progress(model, hybrid_setup.loss(), x, y,
                                        hybrid_setup.HYBRID, basis=basis,
                                        **kwargs)
    _, both = plan_progress.choose_plan(
        model, hybrid_setup.loss(), x, y,
        {'twice': (hybrid_setup.SINGLE, None),
         'hybrid': (hybrid_setup.HYBRID, basis)}, **kwargs)
    assert both['hybrid'] == one  # Its draws do not depend on the others.
    wrong = attr.evolve(hybrid_setup.HYBRID,
                        blocks=hybrid_setup.HYBRID.blocks[:2])
    with pytest.raises(ValueError):
        plan_progress.choose_plan(
            model, hybrid_setup.loss(), x, y,
            {'twice': (hybrid_setup.SINGLE, None), 'wrong': (wrong, basis)},
            **kwargs)
    for v, w in zip(model.trainable_variables, weights):
        np.testing.assert_array_equal(v.numpy(), w)


def test_the_public_batch_keeps_a_real_steps_noise_per_update():
    config = _config(2.0, coordinate_sampling_rate=0.5)
    public = plan_progress._public_batch_config(config, 40)
    assert public.expected_batch_size == 20.0 and public.non_private
    assert public.noise_multipliers[0] / public.expected_batch_size == (
        pytest.approx(config.noise_multipliers[0]
                      / config.expected_batch_size))


def test_candidates_must_be_calibrated_private_configs():
    model = tiny_models.mlp()
    for bad in (_config(0.0), _config(None)):
        with pytest.raises(ValueError, match=r"candidates\['bad'\]"):
            plan_progress.choose_plan(model, hybrid_setup.loss(), *_public(),
                                      {'bad': (bad, None)},
                                      learning_rate=0.5)
