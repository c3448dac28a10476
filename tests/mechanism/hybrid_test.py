"""Tests of hybrid clipping in training: blocks, noise, both paths, events."""

import json
import math
import re

import numpy as np
import pytest
import tensorflow as tf

from tests import markers
from tests import tiny_models

from tf_twice import optimizers
from tf_twice import sampling
from tf_twice.accounting import TwiceSampledGaussianDpEvent
from tf_twice.accounting import calibrate_noise_multiplier
from tf_twice.accounting.statement import hybrid_noise_variance_ratio
from tf_twice.config import Block, TwiceSamplingConfig
from tf_twice.hybrid import budgets
from tf_twice.hybrid import learning
from tf_twice.keras import DPModel, PrivacyLedger
from tf_twice.keras import basis_refresh
from tf_twice.keras import guards
from tf_twice.mechanism import aggregation as agg
from tf_twice.mechanism import randomness
from tf_twice.mechanism import basis as basis_lib
from tf_twice.mechanism import hybrid

NUM_FEATURES, NUM_CLASSES = tiny_models.NUM_FEATURES, tiny_models.NUM_CLASSES


def _data(batch, seed=0):
    return tiny_models.data(batch, seed)


_mlp = tiny_models.mlp  # d = 43


def _loss(**kwargs):
    return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                         **kwargs)


def _weights(model):
    return [v.numpy() for v in model.trainable_variables]


def _assert_all_close(a_list, b_list, **kwargs):
    kwargs = {'rtol': 1e-5, 'atol': 1e-6, **kwargs}
    assert len(a_list) == len(b_list)
    for a, b in zip(a_list, b_list):
        np.testing.assert_allclose(a, b, **kwargs)


RANKS = [3, 5]
GROUPS = 2


def _basis(seed=0, public_seed=1):
    """A basis of the MLP's gradients learned from public examples."""
    grads = basis_refresh.public_per_example_gradients(
        _mlp(), _loss(), *_data(32, seed=public_seed))
    return learning.learn_basis(grads, RANKS, groups=GROUPS, seed=seed)


NUM_EXAMPLES, DELTA = 24, 1e-5  # q1 = 6 / 24
SEED = 17


def _params(**changes):
    """The hybrid config: principal blocks 1, 2, then the residual."""
    fields = dict(l2_norm_clip=(0.5, 0.3, 0.2),
                  linf_norm_clip=(0.2, None, 0.03),
                  noise_multiplier=(1.0, 2.0, 1.5),
                  coordinate_sampling_rate=0.5, expected_batch_size=6.0,
                  num_examples=NUM_EXAMPLES)
    fields.update(changes)
    return tiny_models.dp_config(**fields)


HYBRID = _params()
# The same clip budget and noise as one block (no basis).
SINGLE = TwiceSamplingConfig.single(
    num_examples=NUM_EXAMPLES, expected_batch_size=6.0, l2_norm_clip=0.6,
    noise_multiplier=1.0, coordinate_sampling_rate=0.5)


def _random_grads(batch, shapes, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return [(scale * rng.standard_normal((batch,) + tuple(s))).astype(
        np.float32) for s in shapes]


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


def _orthonormal_basis(dims, ranks, seed=0):
    """A random block-diagonal basis, one variable per group."""
    rng = np.random.default_rng(seed)
    matrices = [np.linalg.qr(rng.standard_normal((d, sum(r))))[0]
                for d, r in zip(dims, ranks)]
    return basis_lib.HybridBasis(matrices, ranks)


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


# --- the two training paths -------------------------------------------------


def _fast(basis, physical_batch_size=8, model=None):
    dp = DPModel(model or _mlp(), HYBRID, basis=basis,
                 physical_batch_size=physical_batch_size, seed=SEED)
    dp.compile(optimizer=tf.keras.optimizers.SGD(0.3), loss=_loss())
    return dp


@markers.needs_tf_privacy_optimizers
@pytest.mark.parametrize('physical_batch_size', [8, 3])
def test_fast_path_equals_optimizer_path_with_a_basis(physical_batch_size):
    basis = _basis()
    x, y = _data(8, seed=2)
    reference = DPModel(_mlp(), physical_batch_size=physical_batch_size)
    reference.compile(
        optimizer=optimizers.TwiceSamplingDPKerasSGDOptimizer(
            HYBRID, learning_rate=0.3, basis=basis, seed=SEED),
        loss=_loss())
    tiny_models.one_step(reference, x, y)
    dp = _fast(basis, physical_batch_size)
    tiny_models.one_step(dp, x, y)
    assert not np.allclose(_weights(dp)[0], _weights(_mlp())[0])
    _assert_all_close(_weights(dp), _weights(reference))
    # And the basis matters: without it (one block) the step differs.
    plain = DPModel(_mlp(), SINGLE, physical_batch_size=8, seed=SEED)
    plain.compile(optimizer=tf.keras.optimizers.SGD(0.3), loss=_loss())
    tiny_models.one_step(plain, x, y)
    assert not np.allclose(_weights(plain)[0], _weights(dp)[0])


def test_microbatching_does_not_change_the_hybrid_update():
    basis = _basis()
    x, y = _data(10, seed=4)
    results = []
    for physical in (3, 16):  # 4 chunks (2 rows of padding) vs 1 chunk
        dp = _fast(basis, physical)
        tiny_models.one_step(dp, x, y)
        results.append(_weights(dp))
    _assert_all_close(results[0], results[1])


def test_set_basis_takes_effect_without_retracing():
    traces = []

    class CountingDPModel(DPModel):

        def train_step(self, data):
            traces.append(1)  # once per trace, not per step
            return super().train_step(data)

    first, second = _basis(seed=0), _basis(seed=0, public_seed=9)
    assert first.structure == second.structure
    x, y = _data(6, seed=1)
    dp = CountingDPModel(_mlp(), HYBRID, basis=first, physical_batch_size=4,
                         seed=SEED)
    dp.compile(optimizer=tf.keras.optimizers.SGD(0.3), loss=_loss())
    tiny_models.one_step(dp, x, y)
    count = len(traces)
    weights, state = _weights(dp), dp.aggregator.keys.get_state()
    dp.set_basis(second)
    assert dp.basis is second
    tiny_models.one_step(dp, x, y)
    assert len(traces) == count
    # The step used the new basis: a model built with it from the same
    # weights and generator state takes the same step.
    ref = _fast(second, 4)
    for v, w in zip(ref.inner_model.trainable_variables, weights):
        v.assign(w)
    ref.aggregator.keys.set_state(state)
    tiny_models.one_step(ref, x, y)
    _assert_all_close(_weights(dp), _weights(ref))
    # The basis variables are neither weights nor in checkpoints.
    assert len(dp.weights) == len(dp.inner_model.weights)


def test_basis_refresh_callback_drives_set_basis_in_fit():
    traces = []

    class CountingDPModel(DPModel):

        def train_step(self, data):
            traces.append(1)
            return super().train_step(data)

    public = _data(32, seed=1)
    inner = _mlp()
    learn = dict(ranks=RANKS, groups=GROUPS)
    basis = learning.learn_basis(basis_refresh.public_per_example_gradients(
        inner, _loss(), *public), **learn)
    dp = CountingDPModel(inner, HYBRID, basis=basis, physical_batch_size=4,
                         seed=SEED)
    dp.compile(optimizer=tf.keras.optimizers.SGD(0.3), loss=_loss())
    refresh = basis_refresh.BasisRefresh(inner, public, _loss(), every_steps=2,
                                         on_refresh=dp.set_basis, **learn)
    dp.fit(_poisson(steps=5), callbacks=[refresh], verbose=0)
    assert refresh.refresh_count == 3  # before steps 0, 2 and 4
    assert dp.basis is refresh.basis
    assert len(traces) <= 2  # the first trace creates the optimizer's vars


def test_set_basis_refuses_another_structure_or_no_basis():
    dp = _fast(_basis())
    grads = basis_refresh.public_per_example_gradients(_mlp(), _loss(),
                                                       *_data(32))
    with pytest.raises(ValueError, match='same structure|structure of'):
        dp.set_basis(learning.learn_basis(grads, [4, 4], groups=GROUPS))
    plain = DPModel(_mlp(), SINGLE, physical_batch_size=4)
    with pytest.raises(ValueError, match='built with basis'):
        plain.set_basis(_basis())


MISFITS = [
    (SINGLE, 'one Block per block of the basis: 3'),
    (_params(l2_norm_clip=(0.5, 0.3), noise_multiplier=(1.0, 2.0),
             linf_norm_clip=None), 'one Block per block of the basis: 3'),
    # A block whose dimension is not the basis block's.
    (TwiceSamplingConfig(
        num_examples=NUM_EXAMPLES, expected_batch_size=6.0,
        blocks=(Block(l2_norm_clip=0.5, noise_multiplier=1.0, dimension=4),
                Block(l2_norm_clip=0.3, noise_multiplier=2.0),
                Block(l2_norm_clip=0.2, noise_multiplier=1.5))),
     'dimension is 4 but the basis block has 3'),
]


@pytest.mark.parametrize('config, match', MISFITS)
def test_config_blocks_must_fit_the_basis(config, match):
    with pytest.raises(ValueError, match=match):
        DPModel(_mlp(), config, basis=_basis(), physical_batch_size=4)


@markers.needs_tf_privacy_optimizers
@pytest.mark.parametrize('config, match', MISFITS)
def test_dp_optimizer_config_blocks_must_fit_the_basis(config, match):
    with pytest.raises(ValueError, match=match):
        optimizers.TwiceSamplingDPKerasSGDOptimizer(config, basis=_basis())


def test_several_blocks_without_a_basis_and_foreign_bases_are_refused():
    with pytest.raises(ValueError, match='no basis is given'):
        DPModel(_mlp(), HYBRID, physical_batch_size=4)
    other = _orthonormal_basis([43], [[2, 3]])  # one variable of 43
    with pytest.raises(ValueError, match='variable_shapes'):
        DPModel(_mlp(), HYBRID, basis=other, physical_batch_size=4)


@markers.needs_tf_privacy_optimizers
def test_dp_optimizer_with_several_blocks_needs_a_basis():
    with pytest.raises(ValueError, match='no basis is given'):
        optimizers.TwiceSamplingDPKerasSGDOptimizer(HYBRID)


def test_config_round_trip_with_a_basis():
    basis = _basis()
    dp = _fast(basis)
    config = dp.get_config()
    assert [b['l2_norm_clip'] for b in config['config']['blocks']] == [
        0.5, 0.3, 0.2]
    json.dumps({k: v for k, v in config.items() if k != 'model'})
    with pytest.raises(ValueError, match='no basis is given'):
        DPModel.from_config(config)
    clone = DPModel.from_config({**config, 'basis': basis})
    assert clone.config == dp.config and clone.basis is basis
    assert clone.dp_event() == dp.dp_event()


@markers.needs_tf_privacy_optimizers
def test_dp_optimizer_config_round_trip_with_a_basis():
    basis = _basis()
    opt = optimizers.TwiceSamplingDPKerasSGDOptimizer(HYBRID, basis=basis)
    again = type(opt).from_config({**opt.get_config(), 'basis': basis})
    assert again.config == opt.config and again.basis is basis


# --- accounting -------------------------------------------------------------


def _poisson(steps=3, seed=1):
    x, y = _data(NUM_EXAMPLES, seed=7)
    return sampling.poisson_batches(x, y, physical_batch_size=4,
                                    example_sampling_rate=0.25, steps=steps,
                                    seed=seed)


def _event(basis, **changes):
    fields = dict(example_sampling_rate=0.25, coordinate_sampling_rate=0.5,
                  noise_multiplier=(1.0, 2.0, 1.5),
                  l2_norm_clip=(0.5, 0.3, 0.2),
                  linf_norm_clip=(0.2, None, 0.03),
                  block_dimensions=basis.block_dimensions)
    fields.update(changes)
    return TwiceSampledGaussianDpEvent(**fields)


def test_event_and_ledger_round_trip_with_a_basis(tmp_path):
    basis = _basis()
    assert basis.block_dimensions == (3, 5, 43)
    dp = _fast(basis, 4)
    assert dp.dp_event() == _event(basis)
    path = tmp_path / 'ledger.json'
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, state_path=path,
                                     verbose=0)
    assert ledger.event == _event(basis)
    dp.fit(_poisson(), callbacks=[ledger], verbose=0)
    assert ledger.steps == 3
    state = json.loads(path.read_text())
    resumed = PrivacyLedger.from_state(state, verbose=0)
    assert resumed.event == _event(basis)
    assert resumed.epsilon == pytest.approx(ledger.epsilon, rel=1e-12)


@markers.needs_tf_privacy_optimizers
def test_optimizer_path_runs_the_same_multi_block_event():
    basis = _basis()
    model = DPModel(_mlp(), physical_batch_size=4)
    model.compile(optimizer=optimizers.TwiceSamplingDPKerasSGDOptimizer(
        HYBRID, basis=basis), loss=_loss())
    assert model.dp_event() == _event(basis)
    guards.check_ledger_event(_event(basis), model)


@pytest.mark.parametrize('changes', [
    dict(noise_multiplier=(1.0, 2.5, 1.5)),
    dict(l2_norm_clip=(0.5, 0.3, 0.25)),
    dict(linf_norm_clip=(0.1, None, 0.03)),
    dict(block_dimensions=(3, 5, 40)),
    dict(block_dimensions=None),  # Looser, but not the model's event.
    dict(noise_multiplier=1.0, l2_norm_clip=0.6, linf_norm_clip=None,
         block_dimensions=None),
])
def test_mismatched_multi_block_event_is_refused(changes):
    basis = _basis()
    dp = _fast(basis, 4)
    field, value = next(iter(changes.items()))
    with pytest.raises(ValueError,
                       match=re.escape(f'{field}={value!r}') + '.*for_model'):
        dp.fit(_poisson(), callbacks=[PrivacyLedger(_event(basis, **changes),
                                                    DELTA)], verbose=0)
    assert int(dp.optimizer.iterations) == 0


# --- the point of it: less noise at the same epsilon ------------------------


def test_public_basis_needs_less_noise_than_dp_sgd_at_equal_epsilon():
    # Gradients concentrated near a rank-8 subspace, public and private
    # drawn from the same distribution: the basis learned from public
    # gradients predicts the private ones' geometry.
    d, rank, c = 1000, 8, 1.0
    rng = np.random.default_rng(0)
    v = np.linalg.qr(rng.standard_normal((d, rank)))[0]
    mean = 0.3 * v[:, 0]

    def gradients(n):
        s = rng.standard_normal((n, rank)) * np.geomspace(1, 0.2, rank)
        return (mean + s @ v.T + 0.01 * rng.standard_normal((n, d))).astype(
            np.float32)

    public, private = gradients(200), gradients(500)
    basis = learning.learn_basis(public, [rank])
    budget = dict(target_epsilon=2.0, delta=1e-5, steps=1000,
                  example_sampling_rate=0.01, coordinate_sampling_rate=1.0)
    planned = budgets.plan_blocks(
        TwiceSamplingConfig.single(num_examples=10_000,
                                   expected_batch_size=100.0,
                                   l2_norm_clip=c),
        basis, public, target_epsilon=2.0, delta=1e-5, steps=1000)
    clips, z = planned.l2_norm_clips, planned.noise_multipliers
    hybrid_var = sum(r * (zj * cj)**2 for r, zj, cj in
                     zip(basis.block_dimensions, z, clips))
    z_std = calibrate_noise_multiplier(l2_norm_clip=c, linf_norm_clip=None,
                                       tolerance=1e-4, **budget)
    standard_var = d * (z_std * c)**2
    assert hybrid_var < 0.2 * standard_var
    ratio = hybrid_noise_variance_ratio(
        noise_multipliers=z, l2_norm_clips=clips,
        block_dimensions=basis.block_dimensions, **budget)
    assert ratio.ratio == pytest.approx(hybrid_var / standard_var, rel=1e-3)
    # ...without clipping the private signal away: the mean clipped private
    # gradient is nearly the one of plain clipping to c.
    silent = tiny_models.dp_config(l2_norm_clip=tuple(clips),
                                   noise_multiplier=(0.0, 0.0),
                                   expected_batch_size=500.0,
                                   num_examples=500)
    assert silent.non_private
    mean_hybrid = hybrid.noisy_update(
        hybrid.block_sums([private], silent, basis=basis), silent,
        basis=basis)[0].numpy()
    mean_plain = agg.clipped_masked_sum([private],
                                        l2_norm_clip=c)[0].numpy() / 500
    cosine = mean_hybrid @ mean_plain / (np.linalg.norm(mean_hybrid)
                                         * np.linalg.norm(mean_plain))
    assert cosine > 0.95


if __name__ == '__main__':
    raise SystemExit(pytest.main([__file__]))
