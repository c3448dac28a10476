"""Tests of tf_twice.hybrid.budgets: per-block clips and noise from public
data, and of the public block statistics that they read."""

import contextlib
import math

import attr
import numpy as np
import pytest
from scipy import optimize

from tests import reference
from tf_twice.accounting import TwiceSamplingRdpAccountant
from tf_twice.config import Block, TwiceSamplingConfig
from tf_twice.hybrid import block_statistics
from tf_twice.hybrid import budget_splits as splits
from tf_twice.hybrid import budgets
from tf_twice.hybrid import learning

pytestmark = pytest.mark.keras_free  # Once per TensorFlow (conftest).

D = 60


def _public(n=80, seed=0):
    """Public gradients [n, D] concentrated near a rank-8 subspace."""
    rng = np.random.default_rng(seed)
    v = np.linalg.qr(rng.standard_normal((D, 8)))[0]
    s = rng.standard_normal((n, 8)) * np.geomspace(3, 0.5, 8)
    return (s @ v.T + 0.05 * rng.standard_normal((n, D))).astype(np.float32)


@pytest.fixture(scope='module')
def basis_and_public():
    public = _public()
    return learning.learn_basis(public, [3, 5], seed=1), public


def _one_block(**block):
    block.setdefault('l2_norm_clip', 1.0)
    return TwiceSamplingConfig(num_examples=1000, expected_batch_size=50.0,
                               coordinate_sampling_rate=0.5,
                               blocks=(Block(**block),))


BUDGET = dict(target_epsilon=3.0, delta=1e-5, steps=200)


def test_linf_clips_from_d0():
    assert budgets.linf_clips_from_d0([2.0, 1.0], 4.0) == (1.0, 0.5)
    np.testing.assert_allclose(
        budgets.linf_clips_from_d0([2.0, 1.0], [16.0, 1.0]), [0.5, 1.0])
    with pytest.raises(ValueError, match='d0'):
        budgets.linf_clips_from_d0([1.0], 0.0)
    with pytest.raises(ValueError, match='l2_norm_clips'):
        budgets.linf_clips_from_d0([-1.0], 1.0)


def test_hybrid_noise_multipliers_meet_the_budget(basis_and_public):
    basis, _ = basis_and_public
    z = budgets.hybrid_noise_multipliers(
        basis, (0.5, 0.3, 0.2), (0.2, None, 0.03),
        example_sampling_rate=0.05, coordinate_sampling_rate=0.5, **BUDGET)
    assert len(z) == 3
    config = TwiceSamplingConfig(
        num_examples=1000, expected_batch_size=50.0,
        coordinate_sampling_rate=0.5, blocks=tuple(
            Block(l2_norm_clip=c2, linf_norm_clip=c_inf, noise_multiplier=zj,
                  dimension=r)
            for c2, c_inf, zj, r in zip((0.5, 0.3, 0.2), (0.2, None, 0.03), z,
                                        basis.block_dimensions)))
    accountant = TwiceSamplingRdpAccountant()
    accountant.compose(config.dp_event(), 200)
    assert accountant.get_epsilon(1e-5) <= 3.0
    with pytest.raises(ValueError, match='one value per block'):
        budgets.hybrid_noise_multipliers(
            basis, (0.5, 0.3), example_sampling_rate=0.05,
            coordinate_sampling_rate=0.5, **BUDGET)


def test_plan_blocks_splits_the_l2_budget_by_public_norms(basis_and_public):
    basis, public = basis_and_public
    planned = budgets.plan_blocks(_one_block(l2_norm_clip=2.0,
                                             noise_multiplier=1.3),
                                  basis, public)
    assert planned.num_blocks == basis.num_blocks == 3
    assert planned.dimensions == basis.block_dimensions == (3, 5, D)
    clips = np.array(planned.l2_norm_clips)
    assert math.isclose(float(np.sum(clips**2)), 4.0, rel_tol=1e-12)
    norms = block_statistics.public_block_norms(basis, public, clip_norm=2.0)
    np.testing.assert_allclose(clips / np.linalg.norm(clips),
                               norms / np.linalg.norm(norms), rtol=1e-12)
    # The public gradients are near rank 8 = 3 + 5: the principal blocks get
    # almost all of the budget.
    assert clips[-1] < 0.3 * clips[0]
    assert planned.noise_multipliers == (1.3,) * 3
    # Kept from the one-block config.
    assert (planned.num_examples, planned.expected_batch_size,
            planned.coordinate_sampling_rate) == (1000, 50.0, 0.5)


def test_plan_blocks_linf_clips(basis_and_public):
    basis, public = basis_and_public
    # No l-infinity clip given and principal_d0 = 1: every clip is c2_j.
    planned = budgets.plan_blocks(_one_block(noise_multiplier=1.0), basis,
                                  public)
    assert planned.linf_norm_clips == planned.l2_norm_clips
    # residual_d0 and principal_d0 set c2_j / sqrt(d0_j), capped at rank r_j.
    planned = budgets.plan_blocks(_one_block(noise_multiplier=1.0), basis,
                                  public, residual_d0=16.0, principal_d0=4.0)
    c2 = planned.l2_norm_clips
    np.testing.assert_allclose(
        planned.linf_norm_clips,
        [c2[0] / math.sqrt(3), c2[1] / 2.0, c2[2] / 4.0], rtol=1e-12)
    # The config's l-infinity clip is the residual's, capped at its c2.
    for c_inf in (1e-3, 100.0):
        # Above c2 = 1 the config says that it clips nothing.
        says_so = (pytest.warns(UserWarning, match='clips nothing')
                   if c_inf > 1.0 else contextlib.nullcontext())
        with says_so:
            config = _one_block(noise_multiplier=1.0, linf_norm_clip=c_inf)
        planned = budgets.plan_blocks(config, basis, public)
        residual_c2 = planned.l2_norm_clips[-1]
        assert planned.linf_norm_clips[-1] == pytest.approx(
            min(c_inf, residual_c2), rel=1e-12)


def test_plan_blocks_optimises_noise_for_the_budget(basis_and_public):
    basis, public = basis_and_public
    # One keep rate on every block, so that the noise's variance is the
    # update's (up to one divisor).
    planned = budgets.plan_blocks(
        _one_block(linf_norm_clip=0.05), basis, public,
        principal_coordinate_sampling_rate=0.5, **BUDGET)
    eps = planned.epsilon(BUDGET['steps'], BUDGET['delta'])
    assert 0.95 * BUDGET['target_epsilon'] <= eps <= BUDGET['target_epsilon']
    # Per-block noise costs less total variance than one z for all blocks
    # at the same clips and epsilon.
    same_z = planned.with_noise_multipliers((None,) * 3).calibrate(
        tolerance=1e-4, **BUDGET)

    def variance(config):
        return sum(r * (b.noise_multiplier * b.l2_norm_clip)**2
                   for r, b in zip(config.dimensions, config.blocks))

    assert variance(planned) < variance(same_z)


def test_plan_blocks_refuses_bad_arguments(basis_and_public):
    basis, public = basis_and_public
    with pytest.raises(ValueError, match='target_epsilon, delta and steps'):
        budgets.plan_blocks(_one_block(), basis, public)
    with pytest.raises(ValueError, match='not both'):
        budgets.plan_blocks(_one_block(noise_multiplier=1.0), basis, public,
                            **BUDGET)
    with pytest.raises(ValueError, match='residual_d0'):
        budgets.plan_blocks(_one_block(linf_norm_clip=0.1), basis, public,
                            residual_d0=4.0, **BUDGET)
    two = _one_block(noise_multiplier=1.0)
    two = attr.evolve(two, blocks=two.blocks * 2)
    with pytest.raises(ValueError, match='one Block'):
        budgets.plan_blocks(two, basis, public)
    with pytest.raises(ValueError, match='dimension'):
        budgets.plan_blocks(_one_block(noise_multiplier=1.0, dimension=D),
                            basis, public)
    with pytest.raises(ValueError, match='principal_d0'):
        budgets.plan_blocks(_one_block(noise_multiplier=1.0), basis, public,
                            principal_d0=0.0)
    with pytest.raises(ValueError, match='HybridBasis'):
        budgets.plan_blocks(_one_block(noise_multiplier=1.0), None, public)
    with pytest.raises(ValueError, match='TwiceSamplingConfig'):
        budgets.plan_blocks({'l2_norm_clip': 1.0}, basis, public)


def _dense_blocks(basis, public):
    """Per-block projections [k, r_j] (residual last, natural coordinates)
    and the matrices mapping them back, from the numpy reading of the basis."""
    g = public.astype(np.float64)
    principal = reference.dense_principal_blocks(basis)
    coefficients = [g @ u for u in principal]
    residual = g - sum(a @ u.T for a, u in zip(coefficients, principal))
    return coefficients + [residual], principal + [np.eye(g.shape[1])]


def _rho(public, basis, l2_clips, noise_variance):
    """The criterion variance_optimal maximises, computed directly: the
    squared cosine-like ratio <mu, m>^2 / (||mu||^2 (||m||^2 + N)) of the
    raw public mean mu and the hybrid-clipped public mean m plus noise."""
    blocks, maps = _dense_blocks(basis, public)
    clipped = sum(
        (a * np.minimum(1.0, c2 / np.linalg.norm(a, axis=1))[:, None]) @ u.T
        for a, u, c2 in zip(blocks, maps, l2_clips)).mean(axis=0)
    mu = public.astype(np.float64).mean(axis=0)
    return float(np.dot(mu, clipped)**2 / (np.dot(mu, mu) * (
        np.dot(clipped, clipped) + noise_variance)))


def test_public_block_statistics_match_a_dense_reading(basis_and_public):
    basis, public = basis_and_public
    stats = block_statistics.public_block_statistics(basis, public,
                                                     chunk_size=7)
    blocks, _ = _dense_blocks(basis, public)
    norms = np.stack([np.linalg.norm(a, axis=1) for a in blocks], axis=1)
    np.testing.assert_allclose(stats.per_example_norms, norms, rtol=1e-4)
    units = [np.mean(a / np.linalg.norm(a, axis=1)[:, None], axis=0)
             for a in blocks]
    means = [np.mean(a, axis=0) for a in blocks]
    np.testing.assert_allclose(
        stats.alignments, [np.dot(m, u) for m, u in zip(means, units)],
        rtol=1e-4)
    np.testing.assert_allclose(stats.direction_energies,
                               [np.dot(u, u) for u in units], rtol=1e-4)
    # Chunks of 7 and of 256: the same norms, computed in float32 by
    # products whose blocking (and rounding) depends on the chunk's size
    # (1.2e-8 apart on an AVX-512 CPU).
    np.testing.assert_allclose(stats.mean_norms,
                               block_statistics.public_block_norms(basis,
                                                                   public),
                               rtol=1e-6)
    # The pre-clip scales each example's norms, not its direction.
    clipped = block_statistics.public_block_statistics(basis, public,
                                                       clip_norm=0.5)
    totals = np.linalg.norm(public.astype(np.float64), axis=1)
    np.testing.assert_allclose(
        clipped.per_example_norms,
        norms * np.minimum(1.0, 0.5 / totals)[:, None], rtol=1e-4)
    np.testing.assert_allclose(clipped.alignments, stats.alignments,
                               rtol=1e-6)  # float32 projections, chunked.
    # Read by gradients.read_gradients, as learn_basis reads them.
    with pytest.raises(ValueError, match='public_gradients must be finite'):
        block_statistics.public_block_statistics(
            basis, np.where(public > 1.0, np.nan, public))
    with pytest.raises(ValueError, match='2-D'):
        block_statistics.public_block_statistics(basis, public[0])


def test_variance_optimal_matches_a_brute_force_search_with_the_accountant():
    """plan_blocks's variance_optimal split against a search over splits
    that computes, for each, the per-block noise with the real accountant
    (optimize_block_noise) and the clipped public mean directly.

    q2 = 1 and no l-infinity clip: the regime of the paper's theorem, where
    the model is exact; public gradients all clipped (norms > c)."""
    rng = np.random.default_rng(0)
    v = np.linalg.qr(rng.standard_normal((D, 8)))[0]
    s = (rng.standard_normal((80, 8)) * np.geomspace(3, 0.5, 8) +
         [2.0, 1.0, 0, 0, 0, 0, 0, 0])
    public = (s @ v.T + 0.3 * rng.standard_normal((80, D))).astype(np.float32)
    basis = learning.learn_basis(public, [3], seed=1)
    c, batch, budget = 0.2, 200.0, dict(target_epsilon=8.0, delta=1e-5,
                                       steps=50)
    stats = block_statistics.public_block_statistics(basis, public)
    assert np.min(stats.per_example_norms) > c
    config = TwiceSamplingConfig(num_examples=1000, expected_batch_size=batch,
                                 blocks=(Block(l2_norm_clip=c),))

    def rho(l2_clips):
        z = budgets.hybrid_noise_multipliers(
            basis, l2_clips, example_sampling_rate=batch / 1000,
            coordinate_sampling_rate=1.0, **budget)
        variance = sum(r * (zj * c2)**2 for r, zj, c2 in zip(
            basis.block_dimensions, z, l2_clips)) / batch**2
        return _rho(public, basis, l2_clips, variance)

    def minus_rho(angle):
        return -rho((c * math.cos(angle), c * math.sin(angle)))

    grid = np.linspace(0.02, math.pi / 2 - 0.02, 12)
    i = int(np.argmin([minus_rho(a) for a in grid]))
    search = optimize.minimize_scalar(
        minus_rho, bounds=(grid[max(i - 1, 0)], grid[min(i + 1, 11)]),
        method='bounded', options=dict(xatol=1e-4))
    planned = budgets.plan_blocks(config, basis, public,
                                  budget_split='variance_optimal', **budget)
    c2 = planned.l2_norm_clips
    assert math.isclose(c2[0]**2 + c2[1]**2, c**2, rel_tol=1e-12)
    # The optimum is inside, not at a floor, and the same split.
    assert 0.1 < search.x < 1.4
    assert math.atan2(c2[1], c2[0]) == pytest.approx(search.x, abs=0.01)
    assert rho(c2) >= -search.fun * (1 - 1e-6)
    # And it is worth it: the projection-norm split scores clearly lower.
    default = budgets.plan_blocks(config, basis, public, **budget)
    assert rho(default.l2_norm_clips) < rho(c2) - 0.005


@pytest.mark.parametrize('split', splits.BUDGET_SPLITS)
def test_plan_blocks_splits_keep_the_global_l2_ball(basis_and_public, split):
    basis, public = basis_and_public
    for config, budget in ((_one_block(l2_norm_clip=2.0,
                                       noise_multiplier=1.3), {}),
                           (_one_block(l2_norm_clip=2.0,
                                       linf_norm_clip=0.05), BUDGET)):
        planned = budgets.plan_blocks(config, basis, public,
                                      budget_split=split, **budget)
        clips = np.array(planned.l2_norm_clips)
        assert np.all(clips > 0)
        assert math.isclose(float(np.sum(clips**2)), 4.0, rel_tol=1e-12)
        if budget:
            eps = planned.epsilon(BUDGET['steps'], BUDGET['delta'])
            assert eps <= BUDGET['target_epsilon']


def test_plan_blocks_quantile_and_variance_optimal_splits(basis_and_public):
    basis, public = basis_and_public
    config = _one_block(l2_norm_clip=2.0, noise_multiplier=1.3)
    stats = block_statistics.public_block_statistics(basis, public,
                                                     clip_norm=2.0)
    for q in (None, 0.9):
        planned = budgets.plan_blocks(config, basis, public,
                                      budget_split='quantile',
                                      budget_quantile=q)
        np.testing.assert_allclose(
            planned.l2_norm_clips,
            splits.quantile_l2_budget(2.0, stats.per_example_norms,
                                      0.5 if q is None else q), rtol=1e-12)
    # With the config's z and q2 on every block, the noise is shared:
    # s = z / (B q2).
    planned = budgets.plan_blocks(config, basis, public,
                                  budget_split='variance_optimal',
                                  principal_coordinate_sampling_rate=0.5)
    np.testing.assert_allclose(
        planned.l2_norm_clips,
        splits.variance_optimal_l2_budget(
            2.0, stats.alignments, stats.direction_energies,
            basis.block_dimensions, noise_std=1.3 / (50.0 * 0.5),
            noise='shared'), rtol=1e-12)
    assert planned.noise_multipliers == (1.3,) * 3


def test_plan_blocks_refuses_bad_budget_splits(basis_and_public):
    basis, public = basis_and_public
    config = _one_block(noise_multiplier=1.0)
    with pytest.raises(ValueError, match="budget_split must be one of "
                       "projection_norms, variance_optimal, quantile"):
        budgets.plan_blocks(config, basis, public, budget_split='norms')
    with pytest.raises(ValueError, match='budget_quantile applies only'):
        budgets.plan_blocks(config, basis, public, budget_quantile=0.5)
    for bad in (0.0, 1.2, 'half'):
        with pytest.raises(ValueError, match='budget_quantile'):
            budgets.plan_blocks(config, basis, public,
                                budget_split='quantile', budget_quantile=bad)
    with pytest.raises(ValueError, match='residual_d0'):
        budgets.plan_blocks(_one_block(), basis, public, residual_d0=-1.0,
                            budget_split='variance_optimal', **BUDGET)


def _noise_stds(config):
    return np.array([b.noise_multiplier * b.l2_norm_clip
                     for b in config.blocks])


def test_public_fisher_objective_weighs_blocks_by_public_energy(
        basis_and_public):
    basis, public = basis_and_public
    config = _one_block(linf_norm_clip=0.05)
    total = budgets.plan_blocks(config, basis, public, **BUDGET)
    fisher = budgets.plan_blocks(config, basis, public,
                                 noise_objective='public_fisher', **BUDGET)
    assert fisher.l2_norm_clips == total.l2_norm_clips  # Only the noise.
    eps = fisher.epsilon(BUDGET['steps'], BUDGET['delta'])
    assert 0.95 * BUDGET['target_epsilon'] <= eps <= BUDGET['target_epsilon']
    statistics = block_statistics.public_block_statistics(
        basis, public, clip_norm=1.0)
    energy = np.mean(statistics.per_example_norms**2, axis=0)
    dims = np.array(basis.block_dimensions)
    # Each solution is the better one for its own objective...
    assert np.sum(energy * _noise_stds(fisher)**2) < np.sum(
        energy * _noise_stds(total)**2)
    assert np.sum(dims * _noise_stds(total)**2) < np.sum(
        dims * _noise_stds(fisher)**2)
    # ...and the public-energy weights move noise off the first principal
    # block (most energy per coordinate) onto the residual.
    assert _noise_stds(fisher)[0] < _noise_stds(total)[0]
    assert _noise_stds(fisher)[-1] > _noise_stds(total)[-1]


def test_noise_objective_refusals(basis_and_public):
    basis, public = basis_and_public
    with pytest.raises(ValueError, match='noise_objective must be one of'):
        budgets.plan_blocks(_one_block(), basis, public,
                            noise_objective='curvature', **BUDGET)
    with pytest.raises(ValueError, match='only when the per-block noise is '
                       'optimised'):
        budgets.plan_blocks(_one_block(noise_multiplier=1.0), basis, public,
                            noise_objective='public_fisher')
    with pytest.raises(ValueError, match=r'variance_weights\[1\] must be'):
        budgets.hybrid_noise_multipliers(
            basis, (0.5, 0.3, 0.2), example_sampling_rate=0.05,
            coordinate_sampling_rate=0.5, variance_weights=(1.0, -1.0, 1.0),
            **BUDGET)
    with pytest.raises(ValueError, match='one value per block'):
        budgets.hybrid_noise_multipliers(
            basis, (0.5, 0.3, 0.2), example_sampling_rate=0.05,
            coordinate_sampling_rate=0.5, variance_weights=(1.0, 1.0),
            **BUDGET)


def test_unmasked_principal_blocks_are_planned_with_their_update_noise(
        basis_and_public):
    # By default the principal blocks keep every coefficient, the residual
    # q2 = 1/2 (the config's q2 for them too is the paper's algorithm).
    # Block j's update noise is z_j c2_j / (B q2_j): the noise is optimised
    # for that variance, and the budget is met by the per-block accountant.
    basis, public = basis_and_public
    config = _one_block(linf_norm_clip=0.05)
    masked = budgets.plan_blocks(
        config, basis, public, principal_coordinate_sampling_rate=0.5,
        **BUDGET)
    unmasked = budgets.plan_blocks(config, basis, public, **BUDGET)
    assert budgets.DEFAULT_PRINCIPAL_COORDINATE_SAMPLING_RATE == 1.0
    assert unmasked.coordinate_sampling_rates == (1.0, 1.0, 0.5)
    assert unmasked.dp_event().coordinate_sampling_rate == (1.0, 1.0, 0.5)
    eps = unmasked.epsilon(BUDGET['steps'], BUDGET['delta'])
    assert 0.95 * BUDGET['target_epsilon'] <= eps <= BUDGET['target_epsilon']
    rates = np.array(unmasked.coordinate_sampling_rates)
    dims = np.array(basis.block_dimensions)

    def update_variance(planned):
        return np.sum(dims * (_noise_stds(planned) / rates)**2)

    # The plan is the better one for the update it makes: the same clips
    # with the noise planned for the noise's own variance, each block's
    # divisor B q2_j ignored, give the update more variance at the same
    # epsilon.
    raw_variance = unmasked.with_noise_multipliers(
        budgets.hybrid_noise_multipliers(
            basis, unmasked.l2_norm_clips, unmasked.linf_norm_clips,
            example_sampling_rate=config.example_sampling_rate,
            coordinate_sampling_rate=(1.0, 1.0, 0.5),
            variance_weights=dims * 1.0, **BUDGET))
    assert update_variance(unmasked) < update_variance(raw_variance)
    assert masked.coordinate_sampling_rates == (0.5, 0.5, 0.5)
    with pytest.raises(
            ValueError,
            match=r'principal_coordinate_sampling_rate: .*in \(0, 1\]'):
        budgets.plan_blocks(config, basis, public,
                            principal_coordinate_sampling_rate=0.0, **BUDGET)


def test_a_template_rate_is_the_residuals():
    # A one-block template with its own rate (0.25, the config 0.5): the
    # residual keeps it; the principal blocks keep their own.
    basis, public = learning.learn_basis(_public(), [3, 5], seed=1), _public()
    config = attr.evolve(_one_block(linf_norm_clip=0.05), blocks=(Block(
        l2_norm_clip=1.0, linf_norm_clip=0.05,
        coordinate_sampling_rate=0.25),))
    assert budgets.plan_blocks(config, basis, public, **BUDGET
                               ).coordinate_sampling_rates == (1.0, 1.0, 0.25)
    assert budgets.plan_blocks(
        config, basis, public, principal_coordinate_sampling_rate=0.25,
        **BUDGET).coordinate_sampling_rates == (0.25,) * 3


@pytest.mark.parametrize('split', splits.BUDGET_SPLITS)
def test_a_replan_at_the_plans_own_gradients_keeps_its_clips(
        basis_and_public, split):
    # With one z on every block the plan's noise model is the re-plan's
    # (z_j fixed), so every policy re-splits the same statistics the same
    # way, also with unmasked principal blocks.
    basis, public = basis_and_public
    for rate in (0.5, 1.0):
        planned = budgets.plan_blocks(
            _one_block(l2_norm_clip=2.0, noise_multiplier=1.3), basis,
            public, budget_split=split,
            principal_coordinate_sampling_rate=rate)
        np.testing.assert_allclose(budgets.replanned_block_scales(
            planned, basis, public, budget_split=split), 1.0, rtol=1e-9)


def test_a_replan_follows_the_public_norms_at_the_same_epsilon(
        basis_and_public):
    basis, public = basis_and_public
    planned = budgets.plan_blocks(_one_block(linf_norm_clip=0.05), basis,
                                  public, **BUDGET)
    # Later in training: the gradients left the principal subspace.
    moved = (_public(seed=3) * 0.2
             + np.random.default_rng(4).standard_normal(public.shape)
             ).astype(np.float32)
    scales = np.array(budgets.replanned_block_scales(planned, basis, moved))
    clips = scales * planned.l2_norm_clips
    stats = block_statistics.public_block_statistics(basis, moved,
                                                     clip_norm=1.0)
    np.testing.assert_allclose(clips, splits.split_l2_budget(
        1.0, splits.floored(stats.mean_norms)), rtol=1e-9)
    assert clips[-1] > 2 * planned.l2_norm_clips[-1]
    # The mechanism the scales run: every block's clips and noise scaled by
    # s_j, so z_j and d0_j are the plan's and so is epsilon.
    rescaled = attr.evolve(planned, blocks=tuple(
        attr.evolve(b, l2_norm_clip=b.l2_norm_clip * s,
                    linf_norm_clip=b.linf_norm_clip * s)
        for b, s in zip(planned.blocks, scales)))
    assert rescaled.epsilon(200, 1e-5) == pytest.approx(
        planned.epsilon(200, 1e-5), rel=1e-12)


def test_a_variance_optimal_replan_without_public_signal_splits_by_norms(
        basis_and_public):
    # Public gradients whose mean is 0 (every alignment 0): plan_blocks
    # refuses the split before training, a re-plan in training must not.
    basis, public = basis_and_public
    planned = budgets.plan_blocks(_one_block(noise_multiplier=1.3), basis,
                                  public)
    symmetric = np.concatenate([public, -public])
    assert budgets.replanned_block_scales(
        planned, basis, symmetric, budget_split='variance_optimal'
    ) == budgets.replanned_block_scales(planned, basis, symmetric)


def test_replanned_block_scales_refusals(basis_and_public):
    basis, public = basis_and_public
    with pytest.raises(ValueError, match='one Block per basis block'):
        budgets.replanned_block_scales(_one_block(noise_multiplier=1.0),
                                       basis, public)
    planned = budgets.plan_blocks(_one_block(), basis, public, **BUDGET)
    with pytest.raises(ValueError, match='budget_quantile applies only'):
        budgets.replanned_block_scales(planned, basis, public,
                                       budget_quantile=0.5)
    with pytest.raises(ValueError, match='basis must be'):
        budgets.replanned_block_scales(planned, None, public)


if __name__ == '__main__':
    raise SystemExit(pytest.main([__file__]))
