"""Tests of the staged update (tf_twice.hybrid.stages): clip, masks and noise
nest under one key, and the last stage is the library's own step."""

import numpy as np
import pytest
import tensorflow as tf

from tests.hybrid_setup import HYBRID
from tests.hybrid_setup import basis as _basis
from tests.hybrid_setup import random_grads as _random_grads
from tf_twice.config import TwiceSamplingConfig
from tf_twice.hybrid import stages
from tf_twice.mechanism import hybrid
from tf_twice.mechanism import randomness

D, B, Q2, C2, C_INF, Z = 4000, 8.0, 0.5, 1.0, 0.05, 2.0
TWICE = TwiceSamplingConfig.single(
    num_examples=80, expected_batch_size=B, coordinate_sampling_rate=Q2,
    l2_norm_clip=C2, linf_norm_clip=C_INF, noise_multiplier=Z)


def _key(seed):
    return randomness.draw_step_key(tf.random.Generator.from_seed(seed))


def test_clip_masks_and_noise_nest_under_one_key():
    # One example in the batch: its masked coordinates are 0 or its clipped
    # value, so the masks stage can be read coordinate by coordinate.
    grad = np.random.default_rng(0).standard_normal((1, D)).astype(np.float32)
    out = stages.staged_updates([grad], TWICE, key=_key(1))
    clipped = grad[0] * min(1.0, C2 / np.linalg.norm(grad[0]))
    clipped = np.clip(clipped, -C_INF, C_INF)  # rtol: the clip's margin.
    np.testing.assert_allclose(out['clip'][0].numpy(), clipped / B,
                               rtol=1e-4, atol=1e-12)
    masked = out['masks'][0].numpy() * B * Q2
    kept = np.isclose(masked, clipped, rtol=1e-4, atol=0)
    assert np.all(kept | (masked == 0))
    assert abs(kept.mean() - Q2) < 0.05  # 4,000 coordinates, sd 0.008
    noise = out['noise'][0].numpy() - out['masks'][0].numpy()
    assert abs(noise.std() / (Z * C2 / (B * Q2)) - 1) < 0.05
    assert abs(noise.mean()) < 4 * Z * C2 / (B * Q2) / np.sqrt(D)


def test_the_noise_stage_is_the_librarys_step_with_block_scales():
    basis = _basis()
    grads = _random_grads(5, basis.variable_shapes, seed=2, scale=2.0)
    scales = (2.0, 0.5, 1.0)
    key = _key(3)
    out = stages.staged_updates(grads, HYBRID, key=key, basis=basis,
                                block_scales=scales, stages=['noise'])
    assert list(out) == ['noise']
    s = tf.constant(scales, tf.float64)
    sums = hybrid.block_sums(grads, HYBRID, basis=basis, block_scales=s,
                             key=key)
    step = hybrid.noisy_update(
        [[tf.cast(t, tf.float64) for t in block] for block in sums], HYBRID,
        basis=basis, block_scales=s, key=key)
    for a, b in zip(out['noise'], step):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_an_unknown_stage_is_refused_by_name():
    with pytest.raises(ValueError, match="stage must be one of .*'noisy'"):
        stages.stage_config(TWICE, 'noisy')
