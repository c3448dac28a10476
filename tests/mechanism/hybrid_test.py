"""Tests of the hybrid-clipping step: the clipping set, the numpy reference,
per-block noise (tf_twice.mechanism.hybrid). Training with a basis:
tests/keras/hybrid_training_test.py."""

import math

import attr
import numpy as np
import pytest
import tensorflow as tf

from tests.hybrid_setup import basis as _basis
from tests.hybrid_setup import orthonormal_basis as _orthonormal_basis
from tests.hybrid_setup import params as _params
from tests.hybrid_setup import random_grads as _random_grads
from tests.hybrid_setup import NUM_EXAMPLES
from tf_twice.config import TwiceSamplingConfig
from tf_twice.mechanism import aggregation as agg
from tf_twice.mechanism import basis as basis_lib
from tf_twice.mechanism import randomness
from tf_twice.mechanism import hybrid


# --- the mechanism ----------------------------------------------------------


def test_every_examples_contribution_lies_in_the_hybrid_set():
    basis = _basis()
    params = _params(coordinate_sampling_rate=1.0)
    batch = 12
    grads = _random_grads(batch, basis.variable_shapes, seed=3, scale=2.0)
    grads[0][4] *= 0.01  # one example inside every bound
    binds = [False] * 3
    for i in range(batch):
        one_hot = np.eye(batch, dtype=np.float32)[i]
        sums = hybrid.block_sums(grads, params, basis=basis, weights=one_hot)
        for j, block in enumerate(sums):
            v = np.concatenate([s.numpy().ravel() for s in block])
            c2 = params.l2_norm_clips[j]
            c_inf = params.linf_norm_clips[j] or math.inf
            assert np.linalg.norm(v) <= c2 * (1 + 1e-5)
            assert np.max(np.abs(v)) <= c_inf * (1 + 1e-6)
            # The bound that binds: l-infinity where c_inf is set (blocks 0
            # and 2), else l2.
            binds[j] |= (np.max(np.abs(v)) > 0.999 * c_inf if c_inf < c2
                         else np.linalg.norm(v) > 0.999 * c2)
    assert all(binds)


def _numpy_hybrid_step(basis, grads, weights, masks, noise, params):
    """Decompose, clip, mask, sum, noise and compose, in float64 numpy."""
    batch = grads[0].shape[0]
    flat = np.concatenate([g.reshape(batch, -1) for g in grads], axis=1)
    flat = flat.astype(np.float64)
    blocks, coefficients = [], []
    groups = [np.concatenate([flat[:, _slice(basis, v)] for v in group],
                             axis=1) for group in basis.groups]
    mats = [m.numpy().astype(np.float64) for m in basis.group_matrices]
    for j in range(basis.num_principal_blocks):
        pieces = []
        for g, (x, u) in enumerate(zip(groups, mats)):
            start = sum(basis.group_ranks[g][:j])
            pieces.append(x @ u[:, start:start + basis.group_ranks[g][j]])
        blocks.append(pieces)
    blocks.append([x - (x @ u) @ u.T for x, u in zip(groups, mats)])
    released = []
    for j, pieces in enumerate(blocks):
        v = np.concatenate(pieces, axis=1)
        c2, c_inf = params.l2_norm_clips[j], params.linf_norm_clips[j]
        v = v * np.minimum(1.0, c2 / np.linalg.norm(v, axis=1))[:, None]
        if c_inf is not None:
            v = np.clip(v, -c_inf, c_inf)
        m = np.concatenate([mk.reshape(batch, -1) for mk in masks[j]], axis=1)
        total = (weights[:, None] * m * v).sum(0)
        total += params.noise_multipliers[j] * c2 * np.concatenate(
            [e.ravel() for e in noise[j]])
        released.append(total / (params.expected_batch_size
                                 * params.coordinate_sampling_rate))
    out = []
    for g, u in enumerate(mats):
        a = []
        for j in range(basis.num_principal_blocks):
            offset = sum(basis.group_ranks[h][j] for h in range(g))
            a.append(released[j][offset:offset + basis.group_ranks[g][j]])
        start = sum(basis.group_dims[:g])
        residual = released[-1][start:start + basis.group_dims[g]]
        out.append(residual + u @ np.concatenate(a))
    update = np.zeros(basis.dim)
    for g, group in enumerate(basis.groups):
        pos = 0
        for v in group:
            s = _slice(basis, v)
            update[s] = out[g][pos:pos + s.stop - s.start]
            pos += s.stop - s.start
    return update


def _slice(basis, v):
    sizes = [int(np.prod(s)) for s in basis.variable_shapes]
    start = sum(sizes[:v])
    return slice(start, start + sizes[v])


def test_hybrid_step_matches_numpy_reference():
    basis = _basis()
    params = _params()
    batch = 7
    grads = _random_grads(batch, basis.variable_shapes, seed=4, scale=1.5)
    weights = np.array([1, 1, 0, 1, 1, 1, 0], np.float32)
    rng = np.random.default_rng(5)
    shapes = [[(r,) for r in ranks] for ranks in zip(*basis.group_ranks)]
    shapes.append([(d,) for d in basis.group_dims])
    masks = [[rng.random((batch,) + s) < 0.5 for s in block]
             for block in shapes]
    noise = [[rng.standard_normal(s).astype(np.float32) for s in block]
             for block in shapes]
    sums = hybrid.block_sums(grads, params, basis=basis, weights=weights,
                             masks=masks)
    update = hybrid.noisy_update(sums, params, basis=basis, noise=noise)
    got = np.concatenate([u.numpy().ravel() for u in update])
    want = _numpy_hybrid_step(basis, grads, weights, masks, noise, params)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_without_a_basis_the_step_is_the_single_block_step():
    shapes = [(4, 5), (5,), (5, 3), (3,)]
    grads = _random_grads(6, shapes, seed=6, scale=2.0)
    params = TwiceSamplingConfig.single(
        num_examples=NUM_EXAMPLES, l2_norm_clip=0.6, linf_norm_clip=0.15,
        noise_multiplier=1.0, coordinate_sampling_rate=0.5,
        expected_batch_size=6.0)
    key = randomness.draw_step_key(tf.random.Generator.from_seed(2))
    sums = hybrid.block_sums(grads, params, key=key, example_offset=3)
    update = hybrid.noisy_update(sums, params, key=key)
    want = agg.add_noise_and_normalize(
        agg.clipped_masked_sum(grads, l2_norm_clip=0.6, linf_norm_clip=0.15,
                               coordinate_sampling_rate=0.5, key=key,
                               example_offset=3),
        l2_norm_clip=0.6, noise_multiplier=1.0, expected_batch_size=6.0,
        coordinate_sampling_rate=0.5, key=key)
    for a, b in zip(update, want):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_block_scales_run_the_config_with_scaled_clips():
    # Block j divided by s_j, clipped, masked, noised and multiplied back:
    # the step of the config whose clips (l2 and l-infinity) and noise std
    # are s_j times larger, same key, so same masks and noise draws.
    basis, params = _basis(), _params()
    scales = (2.0, 0.25, 0.7)
    scaled = TwiceSamplingConfig(
        num_examples=params.num_examples,
        expected_batch_size=params.expected_batch_size,
        coordinate_sampling_rate=params.coordinate_sampling_rate,
        blocks=tuple(attr.evolve(
            b, l2_norm_clip=b.l2_norm_clip * s,
            linf_norm_clip=None if b.linf_norm_clip is None
            else b.linf_norm_clip * s) for b, s in zip(params.blocks, scales)))
    grads = _random_grads(7, basis.variable_shapes, seed=4, scale=1.5)
    key = randomness.draw_step_key(tf.random.Generator.from_seed(3))
    updates = []
    for config, block_scales in ((params, tf.constant(scales, tf.float64)),
                                 (scaled, None)):
        sums = hybrid.block_sums(grads, config, basis=basis, key=key,
                                 block_scales=block_scales)
        updates.append(hybrid.noisy_update(
            sums, config, basis=basis, key=key, block_scales=block_scales))
    unscaled = hybrid.noisy_update(
        hybrid.block_sums(grads, params, basis=basis, key=key), params,
        basis=basis, key=key)
    for a, b, c in zip(*updates, unscaled):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5,
                                   atol=1e-6)
        assert not np.allclose(a.numpy(), c.numpy())


def test_block_scales_are_checked_and_kept_across_a_basis_assignment():
    basis = _basis()
    holder = hybrid.BasisVariables(basis)
    np.testing.assert_array_equal(holder.block_scales.numpy(), [1, 1, 1])
    holder.assign(basis, (2.0, 0.5, 1.5))
    holder.assign(_basis(seed=3))  # A refresh without scales keeps them.
    np.testing.assert_array_equal(holder.block_scales.numpy(),
                                  [2.0, 0.5, 1.5])
    for bad in ((1.0, 1.0), (1.0, 0.0, 1.0), (1.0, float('nan'), 1.0),
                (1e-20, 1.0, 1.0), (1.0, 1.0, 1e300)):
        with pytest.raises(ValueError,
                           match=r'block_scales must be 3 numbers in \[2\*\*-40'):
            holder.assign(basis, bad)
    np.testing.assert_array_equal(holder.block_scales.numpy(),
                                  [2.0, 0.5, 1.5])


def test_noise_of_every_block_has_its_own_std_and_is_independent():
    # Zero gradients: block j's released sum is N(0, (z_j c2_j)^2) per
    # coordinate, divided by B q2. 60 steps give n = 60 r_j draws per block;
    # the sample std has relative standard error 1 / sqrt(2 n): allow 5.
    basis = _orthonormal_basis([600, 400], [[100, 200], [60, 140]])
    params = _params(expected_batch_size=4.0)
    shapes = [(600,), (400,)]
    gen = tf.random.Generator.from_seed(31)
    zeros = [np.zeros((2,) + s, np.float32) for s in shapes]

    @tf.function
    def released():
        key = randomness.draw_step_key(gen)
        sums = hybrid.block_sums(zeros, params, basis=basis, key=key)
        return agg.add_block_noise_and_normalize(
            sums, l2_norm_clips=params.l2_norm_clips,
            noise_multipliers=params.noise_multipliers,
            expected_batch_size=4.0, coordinate_sampling_rate=0.5, key=key)

    draws = [[] for _ in range(3)]
    for _ in range(60):
        for j, block in enumerate(released()):
            draws[j].append(np.concatenate([b.numpy() for b in block]))
    draws = [np.stack(d) for d in draws]  # [steps, r_j]
    assert [d.shape[1] for d in draws] == list(basis.block_dimensions)
    for j, d in enumerate(draws):
        sigma = params.noise_multipliers[j] * params.l2_norm_clips[j] / 2.0
        assert abs(d.std() / sigma - 1) < 5 / math.sqrt(2 * d.size)
        assert abs(d.mean()) < 5 * sigma / math.sqrt(d.size)
    # Blocks are independent: uncorrelated on their common coordinates.
    for j, k in [(0, 1), (0, 2), (1, 2)]:
        width = min(draws[j].shape[1], draws[k].shape[1])
        a, b = draws[j][:, :width].ravel(), draws[k][:, :width].ravel()
        assert abs(np.corrcoef(a, b)[0, 1]) < 5 / math.sqrt(a.size)


def test_composed_update_has_the_hybrid_noise_covariance():
    # In gradient space, U_j^T update = (e_j + U_j^T e_res) / (B q2): std
    # sqrt(sigma_j^2 + sigma_res^2) / (B q2) per coefficient.
    basis = _orthonormal_basis([500], [[40, 80]], seed=3)
    params = _params(expected_batch_size=4.0)
    gen = tf.random.Generator.from_seed(5)
    zeros = [np.zeros((2, 500), np.float32)]

    @tf.function
    def update():
        key = randomness.draw_step_key(gen)
        return hybrid.noisy_update(
            hybrid.block_sums(zeros, params, basis=basis, key=key), params,
            basis=basis, key=key)[0]

    u = np.stack([update().numpy() for _ in range(80)])  # [steps, d]
    sigma = [z * c / 2.0 for z, c in zip(params.noise_multipliers,
                                         params.l2_norm_clips)]
    for j in range(2):
        coef = u @ basis.block(0, j).numpy()
        want = math.sqrt(sigma[j]**2 + sigma[2]**2)
        assert abs(coef.std() / want - 1) < 5 / math.sqrt(2 * coef.size)


def test_variables_of_several_dtypes_share_one_accumulation_dtype():
    # A group joining a float32 and a float64 variable (a float64 layer in
    # a float32 model): its blocks are formed, clipped and summed in
    # float64, the zero accumulators match them, and the noisy update has
    # the same values as all-float64 input.
    rng = np.random.default_rng(8)
    matrices = [np.linalg.qr(rng.standard_normal((7, 3)))[0],
                np.linalg.qr(rng.standard_normal((2, 2)))[0]]
    basis = basis_lib.HybridBasis(
        matrices, [[2, 1], [1, 1]], groups=[[0, 1], [2]],
        variable_shapes=[(3,), (4,), (2,)])
    dtypes = [tf.float32, tf.float64, tf.float16]
    variables = [tf.Variable(tf.zeros(s, d))
                 for s, d in zip(basis.variable_shapes, dtypes)]
    grads = [tf.constant(g, d) for g, d in zip(
        _random_grads(5, basis.variable_shapes, seed=9, scale=2.0), dtypes)]
    params = _params(num_examples=NUM_EXAMPLES)
    key = randomness.draw_step_key(tf.random.Generator.from_seed(6))
    zeros = hybrid.zero_block_sums(variables, basis)
    sums = hybrid.block_sums(grads, params, basis=basis, key=key)
    assert ([[(z.dtype, z.shape) for z in block] for block in zeros]
            == [[(s.dtype, s.shape) for s in block] for block in sums])
    assert {s.dtype for block in sums for s in block} == {tf.float64}
    added = [[z + s for z, s in zip(*pair)] for pair in zip(zeros, sums)]
    update = hybrid.noisy_update(added, params, basis=basis, key=key)
    want = hybrid.noisy_update(
        hybrid.block_sums([tf.cast(g, tf.float64) for g in grads], params,
                          basis=basis, key=key),
        params, basis=basis, key=key)
    for u, w in zip(update, want):
        np.testing.assert_array_equal(u.numpy(), w.numpy())
