"""Tests of tf_twice.hybrid.budgets: per-block clips and noise from public data."""

import math

import attr
import numpy as np
import pytest

from tf_twice.accounting import TwiceSamplingRdpAccountant
from tf_twice.config import Block, TwiceSamplingConfig
from tf_twice.hybrid import budgets
from tf_twice.hybrid import learning

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


def test_split_l2_budget():
    split = budgets.split_l2_budget(2.5, [3.0, 1.0, 2.0])
    assert math.isclose(sum(b * b for b in split), 2.5**2)
    np.testing.assert_allclose(np.array(split) / split[1], [3, 1, 2])
    assert budgets.split_l2_budget(1.0, [4.0]) == (1.0,)
    for bad in ([1.0, 0.0], [1.0, -1.0], [np.nan], []):
        with pytest.raises(ValueError, match='public_projection_norms'):
            budgets.split_l2_budget(1.0, bad)
    with pytest.raises(ValueError, match='total_l2_clip'):
        budgets.split_l2_budget(0.0, [1.0])


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
    norms = budgets.public_block_norms(basis, public, clip_norm=2.0)
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
        planned = budgets.plan_blocks(
            _one_block(noise_multiplier=1.0, linf_norm_clip=c_inf), basis,
            public)
        residual_c2 = planned.l2_norm_clips[-1]
        assert planned.linf_norm_clips[-1] == pytest.approx(
            min(c_inf, residual_c2), rel=1e-12)


def test_plan_blocks_optimises_noise_for_the_budget(basis_and_public):
    basis, public = basis_and_public
    planned = budgets.plan_blocks(_one_block(linf_norm_clip=0.05), basis,
                                  public, **BUDGET)
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


if __name__ == '__main__':
    raise SystemExit(pytest.main([__file__]))
