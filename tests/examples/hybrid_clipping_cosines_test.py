"""Checks of examples/hybrid_clipping_cosines.py against a numpy reading."""

import numpy as np

import tf_twice
from examples import hybrid_clipping_cosines as script
from tf_twice.hybrid import learning


def _clip(v, c):
    return v * min(1.0, c / np.linalg.norm(v))


def test_cosines_match_a_numpy_reading_of_both_clippings():
    rng = np.random.default_rng(0)
    d = 30
    gradients = (rng.standard_normal((40, d)) * np.geomspace(3, 0.1, d)
                 + 0.5).astype(np.float32)
    basis = learning.learn_basis(gradients[:20], [4], seed=0)
    u = basis.group_matrices[0].numpy()  # [d, 4]
    clips = (0.8, 0.3)
    planned = tf_twice.TwiceSamplingConfig(
        num_examples=40, expected_batch_size=40.0,
        coordinate_sampling_rate=1.0, blocks=tuple(
            tf_twice.Block(l2_norm_clip=c, noise_multiplier=1.0)
            for c in clips)).with_dimensions(basis.block_dimensions)
    c2 = 1.0
    values = script.clipping_cosines(gradients, basis, planned,
                                     l2_norm_clip=c2, d0=1.0)
    # d0 = 1: no l-infinity clip binds; no l-infinity clip on the blocks.
    global_mean = np.mean([_clip(g, c2) for g in gradients], axis=0)
    hybrid_mean = np.mean([
        u @ _clip(u.T @ g, clips[0]) + _clip(g - u @ (u.T @ g), clips[1])
        for g in gradients], axis=0)
    raw = gradients.mean(axis=0)

    def cos(a, b):
        return a @ b / np.linalg.norm(a) / np.linalg.norm(b)

    np.testing.assert_allclose(values['cos_global_raw'],
                               cos(global_mean, raw), rtol=1e-4)
    np.testing.assert_allclose(values['cos_hybrid_raw'],
                               cos(hybrid_mean, raw), rtol=1e-4)
    np.testing.assert_allclose(values['cos_hybrid_global'],
                               cos(hybrid_mean, global_mean), rtol=1e-4)
    np.testing.assert_allclose(
        values['norm_ratio'],
        np.linalg.norm(hybrid_mean) / np.linalg.norm(global_mean), rtol=1e-4)
    norms = np.linalg.norm(gradients, axis=1)
    assert values['clipped_fraction'] == np.mean(norms > c2)
    assert values['cos_hybrid_global'] < 0.9999  # The clippings differ.
