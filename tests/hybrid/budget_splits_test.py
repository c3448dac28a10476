"""Tests of tf_twice.hybrid.budget_splits: the l2 budget split policies."""

import math

import numpy as np
import pytest
from scipy import optimize

from tf_twice.hybrid import budget_splits as splits

pytestmark = pytest.mark.keras_free  # Once per TensorFlow (conftest).


def test_split_l2_budget():
    split = splits.split_l2_budget(2.5, [3.0, 1.0, 2.0])
    assert math.isclose(sum(b * b for b in split), 2.5**2)
    np.testing.assert_allclose(np.array(split) / split[1], [3, 1, 2])
    assert splits.split_l2_budget(1.0, [4.0]) == (1.0,)
    for bad in ([1.0, 0.0], [1.0, -1.0], [np.nan], []):
        with pytest.raises(ValueError, match='public_projection_norms'):
            splits.split_l2_budget(1.0, bad)
    with pytest.raises(ValueError, match='total_l2_clip'):
        splits.split_l2_budget(0.0, [1.0])


def test_quantile_l2_budget():
    rng = np.random.default_rng(3)
    norms = np.abs(rng.standard_normal((200, 3))) * [4.0, 1.0, 0.5]
    for q in (0.1, 0.5, 1.0):
        split = np.array(splits.quantile_l2_budget(2.0, norms, q))
        assert math.isclose(float(np.sum(split**2)), 4.0, rel_tol=1e-12)
        levels = np.quantile(norms, q, axis=0)
        np.testing.assert_allclose(split / np.linalg.norm(split),
                                   levels / np.linalg.norm(levels),
                                   rtol=1e-12)
    # A block whose quantile is 0 keeps a tiny positive budget.
    sparse = np.concatenate([norms[:, :1], np.zeros((200, 1))], axis=1)
    split = splits.quantile_l2_budget(1.0, sparse, 0.5)
    assert 0 < split[1] < 1e-5 and math.isclose(split[0], 1.0)
    for bad in (0.0, 1.5, float('nan')):
        with pytest.raises(ValueError, match='quantile'):
            splits.quantile_l2_budget(1.0, norms, bad)
    with pytest.raises(ValueError, match='public_per_example_norms'):
        splits.quantile_l2_budget(1.0, norms[0], 0.5)
    with pytest.raises(ValueError, match='public_per_example_norms'):
        splits.quantile_l2_budget(1.0, -norms, 0.5)
    with pytest.raises(ValueError, match='no energy'):
        splits.quantile_l2_budget(1.0, np.zeros((5, 2)), 0.5)


def _rho_model(c2, w, v, ranks, s, noise):
    """The modelled rho, negative when the update opposes the mean."""
    c2 = np.asarray(c2)
    a = np.sqrt(ranks)
    n = s**2 * (np.dot(a, c2)**2 if noise == 'per_block'
                else np.dot(ranks, c2**2))
    return np.dot(w, c2) * abs(np.dot(w, c2)) / (np.dot(v, c2**2) + n)


@pytest.mark.parametrize('noise', ['per_block', 'shared'])
def test_variance_optimal_l2_budget_maximises_its_criterion(noise):
    rng = np.random.default_rng(5)
    ranks = np.array([4.0, 12.0, 500.0])
    for trial in range(12):
        w = rng.uniform(-0.2, 1.0, 3) * [1.0, 0.5, 0.3]
        w[0] = abs(w[0]) + 0.05
        v = rng.uniform(0.05, 1.0, 3)
        s = float(rng.choice([0.0, 0.01, 0.05, 0.3]))
        split = np.array(splits.variance_optimal_l2_budget(
            1.5, w, v, ranks, noise_std=s, noise=noise))
        assert math.isclose(float(np.sum(split**2)), 1.5**2, rel_tol=1e-12)
        assert np.all(split > 0)
        best = _rho_model(split, w, v, ranks, s, noise)
        # Independent check: a generic optimiser from many starts, over
        # the positive part of the sphere (angles).
        def minus(angles):
            x = np.array([math.cos(angles[0]) * math.cos(angles[1]),
                          math.cos(angles[0]) * math.sin(angles[1]),
                          math.sin(angles[0])])
            return -_rho_model(x, w, v, ranks, s, noise)
        found = max(-optimize.minimize(
            minus, start, method='L-BFGS-B',
            bounds=[(0, math.pi / 2)] * 2).fun
            for start in rng.uniform(0, math.pi / 2, (8, 2)))
        # (A dropped block keeps a budget of 1e-6 of the largest, whose
        # noise costs up to ~sqrt(r_j) 1e-6 relative.)
        assert best >= found * (1 - 1e-4), (trial, split, best, found)


def test_variance_optimal_l2_budget_limits_and_monotonicity():
    w, v, ranks = [0.8, 0.3, 0.2], [0.5, 0.2, 0.01], [4, 12, 500]
    # No noise: c2_j proportional to w_j / v_j, the per-block best scale.
    split = splits.variance_optimal_l2_budget(1.0, w, v, ranks, noise_std=0)
    ratio = np.array(w) / np.array(v)
    np.testing.assert_allclose(split, ratio / np.linalg.norm(ratio),
                               rtol=1e-9)
    # More noise: the largest block's share shrinks, then is left out.
    shares = [splits.variance_optimal_l2_budget(
        1.0, w, v, ranks, noise_std=s)[-1]
        for s in (0.0, 0.01, 0.03, 0.1, 1.0)]
    assert shares[0] > shares[1] > shares[2] > 1e-3
    assert shares[3] < 1e-5 and shares[4] < 1e-5
    # A block whose public mean direction opposes the mean gets the floor.
    split = splits.variance_optimal_l2_budget(1.0, [0.8, -0.1, 0.2], v,
                                              ranks, noise_std=0.01)
    assert split[1] < 1e-5 * max(split)
    for kwargs, match in (
            (dict(noise_std=-1.0), 'noise_std'),
            (dict(noise_std=0.1, noise='mixed'), 'noise must be one of'),
    ):
        with pytest.raises(ValueError, match=match):
            splits.variance_optimal_l2_budget(1.0, w, v, ranks, **kwargs)
    with pytest.raises(ValueError, match='direction_energies'):
        splits.variance_optimal_l2_budget(1.0, w, [0.5, 0.0, 0.1], ranks,
                                          noise_std=0.1)
    with pytest.raises(ValueError, match='ranks'):
        splits.variance_optimal_l2_budget(1.0, w, v, [4, 12], noise_std=0.1)
    with pytest.raises(ValueError, match='alignment'):
        splits.variance_optimal_l2_budget(1.0, [-1.0, 0.0, -0.1], v, ranks,
                                          noise_std=0.1)


if __name__ == '__main__':
    raise SystemExit(pytest.main([__file__]))
