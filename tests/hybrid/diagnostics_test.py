"""Tests of the per-example gradient geometry against direct numpy."""

import math

import numpy as np
import pytest

from tests import reference
from tf_twice.hybrid import diagnostics
from tf_twice.hybrid import learning

pytestmark = pytest.mark.keras_free  # Once per TensorFlow (conftest).

SHAPES = [(4, 5), (30,), (10, 10), (5, 14)]  # d = 220
GROUPS = [[0, 2], [1, 3]]
D = 220


# Directions shared by every draw, so public and private gradients share
# their principal subspace (as the paper's public data is meant to).
_DIRECTIONS = (np.random.default_rng(100).standard_normal((10, D))
               / math.sqrt(D))


def _flat(n, seed):
    rng = np.random.default_rng(seed)
    low = (rng.standard_normal((n, 10)) * np.geomspace(5, 1, 10)
           ) @ _DIRECTIONS
    return (low + 0.05 * rng.standard_normal((n, D))).astype(np.float32)


def _per_variable(flat):
    cuts = np.cumsum([math.prod(s) for s in SHAPES])[:-1]
    return [p.reshape((flat.shape[0],) + s)
            for p, s in zip(np.split(flat, cuts, axis=1), SHAPES)]


@pytest.fixture(scope='module')
def basis():
    return learning.learn_basis(_per_variable(_flat(50, seed=0)), [2, 4, 3],
                                groups=GROUPS, seed=1)


def test_matches_direct_numpy(basis):
    flat = _flat(30, seed=2)
    top_s = (0, 5, 50, D)
    got = diagnostics.gradient_geometry(_per_variable(flat), basis,
                                        top_s=top_s, chunk_size=7)
    x = flat.astype(np.float64)
    np.testing.assert_allclose(got.l2_norm, np.linalg.norm(x, axis=1),
                               rtol=1e-12)
    np.testing.assert_allclose(got.linf_norm, np.abs(x).max(axis=1))
    for i, row in enumerate(x):
        by_size = np.argsort(-np.abs(row))
        for c, s in enumerate(top_s):
            kept = row.copy()
            kept[by_size[:s]] = 0.0
            assert math.isclose(got.sparsified_residual_norm[i, c],
                                np.linalg.norm(kept), rel_tol=1e-9,
                                abs_tol=1e-12)
    dense = reference.dense_principal_blocks(basis)
    expected_blocks = np.stack([np.linalg.norm(x @ u, axis=1) for u in dense],
                               axis=1)
    np.testing.assert_allclose(got.block_norms, expected_blocks, rtol=1e-5)
    np.testing.assert_allclose(
        got.principal_norm, np.linalg.norm(expected_blocks, axis=1),
        rtol=1e-5)
    left = x.copy()
    for j, u in enumerate(dense):
        left -= (x @ u) @ u.T
        np.testing.assert_allclose(got.cumulative_residual_norm[:, j],
                                   np.linalg.norm(left, axis=1), rtol=1e-5)
    np.testing.assert_allclose(got.residual_norm,
                               np.linalg.norm(left, axis=1), rtol=1e-5)
    np.testing.assert_allclose(
        got.coordinate_cv, np.abs(x.std(axis=0) / x.mean(axis=0)),
        rtol=1e-9)
    # A matrix in natural variable order gives the same numbers.
    again = diagnostics.gradient_geometry(flat, basis, top_s=top_s)
    np.testing.assert_allclose(again.block_norms, got.block_norms,
                               rtol=1e-6)
    # Residuals shrink block by block.
    assert np.all(np.diff(got.cumulative_residual_norm, axis=1) <= 1e-6)


def test_sparsification_by_public_significance():
    public, private = _flat(40, seed=3), _flat(10, seed=4)
    score = diagnostics.coordinate_significance(_per_variable(public))
    np.testing.assert_allclose(score, np.abs(public).mean(axis=0),
                               rtol=1e-6)
    got = diagnostics.gradient_geometry(private, top_s=(3, 100),
                                        significance=score)
    order = np.argsort(-score, kind='stable')
    for c, s in enumerate((3, 100)):
        kept = private.astype(np.float64).copy()
        kept[:, order[:s]] = 0.0
        np.testing.assert_allclose(got.sparsified_residual_norm[:, c],
                                   np.linalg.norm(kept, axis=1), rtol=1e-9)
    # The example's own top coordinates are the best s-sparse choice.
    own = diagnostics.gradient_geometry(private, top_s=(3, 100))
    assert np.all(own.sparsified_residual_norm
                  <= got.sparsified_residual_norm + 1e-12)


def test_clip_norm_scales_examples_first(basis):
    flat = 3 * _flat(12, seed=5)
    got = diagnostics.gradient_geometry(flat, basis, clip_norm=0.5,
                                        top_s=(10,))
    norms = np.linalg.norm(flat.astype(np.float64), axis=1, keepdims=True)
    clipped = flat * np.minimum(1.0, 0.5 / norms)
    expected = diagnostics.gradient_geometry(clipped.astype(np.float32), basis,
                                             top_s=(10,))
    assert np.all(got.l2_norm <= 0.5 + 1e-6)
    for name in ('l2_norm', 'linf_norm', 'sparsified_residual_norm',
                 'block_norms', 'residual_norm'):
        np.testing.assert_allclose(getattr(got, name),
                                   getattr(expected, name), rtol=1e-5)


def test_summary_quantiles(basis):
    got = diagnostics.gradient_geometry(_flat(25, seed=6), basis, top_s=(4, 9))
    summary = got.summary(quantiles=(0.1, 0.5, 0.9))
    l2 = summary['l2_norm']
    assert math.isclose(l2['mean'], np.mean(got.l2_norm))
    assert math.isclose(l2['std'], np.std(got.l2_norm))
    assert math.isclose(l2['q0.9'], np.quantile(got.l2_norm, 0.9))
    blocks = summary['block_norms']
    np.testing.assert_allclose(blocks['q0.5'],
                               np.median(got.block_norms, axis=0))
    assert len(summary['sparsified_residual_norm']['mean']) == 2
    assert 'top_s' not in summary
    with pytest.raises(ValueError, match='quantiles'):
        got.summary(quantiles=(1.5,))


def test_without_basis_and_constant_coordinates():
    flat = _flat(8, seed=7)
    flat[:, 0] = 0.0  # a coordinate no example touches
    got = diagnostics.gradient_geometry(flat)
    assert got.block_norms is None and got.residual_norm is None
    assert got.coordinate_cv[0] == 0.0
    assert 'block_norms' not in got.summary()


@pytest.mark.parametrize('kwargs, match', [
    (dict(top_s=(D + 1,)), 'top_s'),
    (dict(significance=np.ones(D - 1)), 'significance'),
    (dict(clip_norm=0.0), 'clip_norm'),
    (dict(chunk_size=0), 'chunk_size'),
])
def test_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        diagnostics.gradient_geometry(_flat(4, seed=8), **kwargs)


def test_refuses_mismatched_or_non_finite_gradients(basis):
    with pytest.raises(ValueError, match='d = 220'):
        diagnostics.gradient_geometry(np.ones((3, 219), np.float32), basis)
    bad = _flat(3, seed=9)
    bad[1, 2] = np.nan
    with pytest.raises(ValueError, match='finite'):
        diagnostics.gradient_geometry(bad)
