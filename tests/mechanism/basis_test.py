"""Tests of the hybrid-clipping basis: learning, projection, budgets."""

import json
import math

import numpy as np
import pytest
import tensorflow as tf

from tests import reference
from tf_twice.hybrid import block_statistics
from tf_twice.hybrid import learning
from tf_twice.keras import basis_refresh
from tf_twice.mechanism import basis as basis_lib

SHAPES = [(4, 5), (30,), (10, 10), (5, 14)]  # d = 20 + 30 + 100 + 70 = 220
GROUPS = [[0, 2], [1, 3]]  # d_g = 120 and 100


def _per_variable(n, seed=0, rank=None):
    """Per-variable gradients [n, *shape]; low-rank plus noise if rank."""
    rng = np.random.default_rng(seed)
    d = sum(math.prod(s) for s in SHAPES)
    if rank is None:
        flat = rng.standard_normal((n, d))
    else:
        flat = (rng.standard_normal((n, rank)) * np.geomspace(10, 1, rank)
                ) @ rng.standard_normal((rank, d)) / math.sqrt(d)
        flat += 0.01 * rng.standard_normal((n, d))
    cuts = np.cumsum([math.prod(s) for s in SHAPES])[:-1]
    return [p.reshape((n,) + s).astype(np.float32)
            for p, s in zip(np.split(flat, cuts, axis=1), SHAPES)]


def _known_spectrum(singular_values, k=60, d=200, seed=1):
    """M = A diag(s) V^T with orthonormal A [k, k'] and V [d, k']."""
    rng = np.random.default_rng(seed)
    s = np.asarray(singular_values, dtype=np.float64)
    a, _ = np.linalg.qr(rng.standard_normal((k, s.size)))
    v, _ = np.linalg.qr(rng.standard_normal((d, s.size)))
    return ((a * s) @ v.T).astype(np.float32), v


def _distance(u, v):
    """||U U^T - V V^T||_2: the sine of the largest principal angle."""
    u = np.asarray(u, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    return np.linalg.norm(u @ u.T - v @ v.T, 2)


def _gram_error(u):
    u = np.asarray(u, dtype=np.float64)
    return np.max(np.abs(u.T @ u - np.eye(u.shape[1])))


@pytest.fixture(scope='module')
def grouped_basis():
    return learning.learn_basis(_per_variable(40, rank=12), [3, 5, 4],
                                groups=GROUPS, seed=3)


def test_blocks_orthonormal_and_mutually_orthogonal(grouped_basis):
    basis = grouped_basis
    assert basis.ranks == (3, 5, 4)
    assert basis.group_dims == (120, 100)
    for g in range(basis.num_groups):
        # One Gram matrix per group covers orthonormality within every
        # block and orthogonality between blocks.
        assert _gram_error(basis.group_matrices[g].numpy()) < 1e-5
        u0, u1 = basis.block(g, 0).numpy(), basis.block(g, 1).numpy()
        assert np.max(np.abs(u0.T.astype(np.float64) @ u1)) < 1e-5
    full = np.concatenate(reference.dense_principal_blocks(basis), axis=1)
    assert full.shape == (220, 12)
    assert _gram_error(full) < 1e-5


def test_recovers_known_subspaces_in_order():
    s = [100, 90, 80, 30, 25, 20, 15] + list(5 * 0.9**np.arange(20))
    matrix, v = _known_spectrum(s)
    basis = learning.learn_basis(matrix, [3, 4], power_iterations=8)
    first, second = basis.block(0, 0).numpy(), basis.block(0, 1).numpy()
    assert _distance(first, v[:, :3]) < 1e-4
    assert _distance(second, v[:, 3:7]) < 1e-4
    # The order matters: block 1 is not the second subspace.
    assert _distance(first, v[:, 3:6]) > 0.99


def test_matches_paper_algorithm_with_explicit_deflation():
    # A slowly decaying spectrum: two iterations are far from converged, so
    # agreement checks the algorithm (same random starts), not convergence.
    matrix, v = _known_spectrum(np.geomspace(10, 1, 40), seed=4)
    ranks, iterations, seed = [4, 6], 2, 7
    basis = learning.learn_basis(matrix, ranks,
                                 power_iterations=iterations, seed=seed)

    rng = np.random.default_rng(np.random.SeedSequence([seed, 0]))
    m = matrix.astype(np.float64)
    by_hand = []
    for r in ranks:
        u = rng.standard_normal((m.shape[1], r))
        for _ in range(iterations):
            u, _ = np.linalg.qr(m.T @ (m @ u))
        m = m - (m @ u) @ u.T  # deflation, as in the paper
        by_hand.append(u)
    for j, u in enumerate(by_hand):
        assert _distance(basis.block(0, j).numpy(), u) < 1e-4
    assert _distance(basis.block(0, 0).numpy(), v[:, :4]) > 1e-2


def test_deterministic_given_seed():
    grads = _per_variable(30, rank=8)
    a = learning.learn_basis(grads, [2, 3], groups=GROUPS, seed=5)
    b = learning.learn_basis(grads, [2, 3], groups=GROUPS, seed=5)
    c = learning.learn_basis(grads, [2, 3], groups=GROUPS, seed=6)
    for x, y, z in zip(a.group_matrices, b.group_matrices, c.group_matrices):
        np.testing.assert_array_equal(x.numpy(), y.numpy())
        assert not np.array_equal(x.numpy(), z.numpy())
    assert a.metadata['seed'] == 5 and a.metadata['power_iterations'] == 3


def test_project_reconstruct_round_trip_and_orthogonal_residual(
        grouped_basis):
    basis = grouped_basis
    rng = np.random.default_rng(8)
    x = [rng.standard_normal((6, d)).astype(np.float32)
         for d in basis.group_dims]
    projection = basis.project(x)
    assert [[c.shape.as_list() for c in block]
            for block in projection.coefficients] == [
                [[6, r[j]] for r in basis.group_ranks] for j in range(3)]
    back = basis.reconstruct(*projection)
    for xi, yi, u, r in zip(x, back, basis.group_matrices,
                            projection.residual):
        np.testing.assert_allclose(yi.numpy(), xi, atol=1e-5)
        # The residual has no component along any block.
        along = r.numpy().astype(np.float64) @ u.numpy()
        assert np.max(np.abs(along)) < 1e-5 * np.max(np.linalg.norm(xi, 1))
    # Unbatched vectors (a noisy sum) and several leading dimensions give
    # the same coefficients and residuals as the batch.
    single = basis.project([t[0] for t in x])
    nested = basis.project([t.reshape(2, 3, -1) for t in x])
    assert nested.residual[0].shape == (2, 3, 120)
    for j in range(3):
        for g in range(2):
            batch = projection.coefficients[j][g].numpy()
            np.testing.assert_allclose(single.coefficients[j][g], batch[0],
                                       atol=1e-6)
            np.testing.assert_allclose(
                nested.coefficients[j][g],
                batch.reshape((2, 3, -1)), atol=1e-6)
    np.testing.assert_allclose(basis.reconstruct(*single)[0], x[0][0],
                               atol=1e-5)


def test_decompose_compose_per_variable(grouped_basis):
    basis = grouped_basis
    grads = _per_variable(5, seed=9)
    projection = basis.decompose(grads)
    assert [r.shape[1:] for r in projection.residual] == SHAPES
    back = basis.compose(*projection)
    for g, b in zip(grads, back):
        np.testing.assert_allclose(b.numpy(), g, atol=1e-5)
    # Coefficients match the dense block-diagonal basis in natural order.
    flat = np.concatenate([g.reshape(5, -1) for g in grads], axis=1)
    for j, dense in enumerate(reference.dense_principal_blocks(basis)):
        got = np.concatenate([c.numpy() for c in projection.coefficients[j]],
                             axis=1)
        np.testing.assert_allclose(got, flat @ dense, atol=1e-4)
    np.testing.assert_allclose(basis.merge_flat(basis.split_flat(flat)),
                               flat)


def test_graph_mode_keeps_static_shapes(grouped_basis):
    basis = grouped_basis

    @tf.function
    def round_trip(grads):
        projection = basis.decompose(grads)
        for block in projection.coefficients:
            for c in block:
                assert c.shape[-1] is not None
        return basis.compose(*projection)

    spec = [tf.TensorSpec([None] + list(s), tf.float32) for s in SHAPES]
    concrete = round_trip.get_concrete_function(spec)
    assert [o.shape.as_list() for o in concrete.outputs] == [
        [None] + list(s) for s in SHAPES]
    grads = _per_variable(3, seed=10)
    for g, b in zip(grads, round_trip(grads)):
        np.testing.assert_allclose(b.numpy(), g, atol=1e-5)


def test_groups_divide_memory():
    shapes = [(50,)] * 4
    grads = [np.random.default_rng(i).standard_normal((30, 50)).astype(
        np.float32) for i in range(4)]
    whole = learning.learn_basis(grads, [8, 16])
    assert whole.memory_floats == 200 * 24
    for g in (2, 4):
        split = learning.learn_basis(grads, [8, 16], groups=g,
                                     rank_split='equal')
        assert split.ranks == (8, 16)
        assert split.memory_floats == 200 * 24 // g
        assert split.memory_bytes == 4 * split.memory_floats
    assert whole.variable_shapes == tuple(shapes)
    # ResNet22 scale by arithmetic only: d = 291,898, k = 3,250.
    assert basis_lib.basis_memory_bytes([291898], [[250, 500, 1000, 1500]]
                                        ) == 291898 * 3250 * 4


def test_save_load_round_trip(grouped_basis, tmp_path):
    path = tmp_path / 'basis'  # saved exactly here, no suffix added
    grouped_basis.save(path)
    loaded = basis_lib.HybridBasis.load(path)
    assert loaded.groups == grouped_basis.groups
    assert loaded.variable_shapes == grouped_basis.variable_shapes
    assert loaded.group_ranks == grouped_basis.group_ranks
    assert dict(loaded.metadata) == dict(grouped_basis.metadata)
    for a, b in zip(loaded.group_matrices, grouped_basis.group_matrices):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_load_checks_format_version_and_takes_tolerance(grouped_basis,
                                                       tmp_path):
    path = tmp_path / 'basis.npz'
    grouped_basis.save(path)
    loose = basis_lib.HybridBasis.load(path, orthonormality_tolerance=1e-3)
    assert loose.orthonormality_tolerance == 1e-3
    assert basis_lib.HybridBasis.load(path).orthonormality_tolerance == (
        grouped_basis.orthonormality_tolerance)
    with np.load(path) as data:
        arrays = dict(data)
    meta = json.loads(str(arrays['meta']))
    meta['format_version'] = 2
    arrays['meta'] = np.array(json.dumps(meta))
    with open(path, 'wb') as f:
        np.savez(f, **arrays)
    with pytest.raises(ValueError, match='unknown basis format version 2'):
        basis_lib.HybridBasis.load(path)


def test_refuses_non_orthonormal():
    rng = np.random.default_rng(11)
    u, _ = np.linalg.qr(rng.standard_normal((30, 5)))
    basis_lib.HybridBasis([u], [[2, 3]])  # accepted
    scaled = u.copy()
    scaled[:, 1] *= 1.01
    with pytest.raises(ValueError, match='not orthonormal'):
        basis_lib.HybridBasis([scaled], [[2, 3]])
    repeated = np.concatenate([u[:, :4], u[:, :1]], axis=1)
    with pytest.raises(ValueError, match='not orthonormal'):
        basis_lib.HybridBasis([repeated], [[2, 3]])
    nudged = u + 1e-6 * rng.standard_normal(u.shape)
    basis_lib.HybridBasis([nudged], [[2, 3]])
    with pytest.raises(ValueError, match='not orthonormal'):
        basis_lib.HybridBasis([nudged], [[2, 3]],
                              orthonormality_tolerance=1e-8)


@pytest.mark.parametrize('kwargs, match', [
    (dict(group_ranks=[[2, 3]], groups=[[0, 1], [1]],
          variable_shapes=[(10,), (20,)]), 'partition'),
    (dict(group_ranks=[[2, 3]], groups=[[0]],
          variable_shapes=[(10,), (20,)]), 'partition'),
    (dict(group_ranks=[[2, 2]]), 'shape'),
    (dict(group_ranks=[[5, 0], [0, 0]]), 'one row per group'),
    (dict(group_ranks=[[5, 0]]), 'total rank'),
    (dict(group_ranks=[[2, 3]], orthonormality_tolerance=0), 'tolerance'),
    (dict(group_ranks=[[2, 3]], nan=True), 'finite'),
])
def test_construction_validation(kwargs, match):
    u, _ = np.linalg.qr(np.random.default_rng(0).standard_normal((30, 5)))
    if kwargs.pop('nan', False):
        u[0, 0] = np.nan
    ranks = kwargs.pop('group_ranks')
    with pytest.raises(ValueError, match=match):
        basis_lib.HybridBasis([u], ranks, **kwargs)


@pytest.mark.parametrize('kwargs, match', [
    (dict(ranks=[2], power_iterations=0), 'power_iterations'),
    (dict(ranks=[2], group_ranks=[[2]]), 'exactly one'),
    (dict(ranks=[150, 100]), 'at most d'),
    (dict(ranks=[2], rank_split='cube'), 'rank_split'),
    (dict(ranks=[0]), 'ranks entries'),
    (dict(ranks=[2], groups=5), 'num_groups'),
    (dict(group_ranks=[[300]]), 'at most d_g'),
])
def test_learn_basis_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        learning.learn_basis(_per_variable(8), **kwargs)


def test_learn_basis_refuses_non_finite_gradients():
    grads = _per_variable(8)
    grads[1][0, 0] = np.inf
    with pytest.raises(ValueError, match='finite'):
        learning.learn_basis(grads, [2])


def test_rank_beyond_public_examples_stays_orthonormal():
    grads = _per_variable(10, seed=12)
    with pytest.warns(UserWarning, match='public examples'):
        basis = learning.learn_basis(grads, [6, 8], power_iterations=2)
    u = basis.group_matrices[0].numpy().astype(np.float64)
    assert _gram_error(u) < 1e-5
    # The 10 public gradients lie in the span of the 14 directions.
    m = np.concatenate([g.reshape(10, -1) for g in grads], axis=1)
    assert np.linalg.norm(m - (m @ u) @ u.T) < 1e-4 * np.linalg.norm(m)


def test_steep_spectrum_beyond_its_rank():
    # Singular values over 8 orders of magnitude, and more directions asked
    # for (45) than the rank of M (40, from 60 examples): still orthonormal,
    # and the blocks span all of M's rows.
    matrix, _ = _known_spectrum(np.geomspace(1e4, 1e-4, 40), seed=5)
    basis = learning.learn_basis(matrix, [10, 20, 15], power_iterations=4)
    u = basis.group_matrices[0].numpy().astype(np.float64)
    assert _gram_error(u) < 1e-5
    m = matrix.astype(np.float64)
    assert np.linalg.norm(m - (m @ u) @ u.T) < 1e-5 * np.linalg.norm(m)


def test_orthonormalisation_of_ill_conditioned_iterates():
    rng = np.random.default_rng(16)
    previous, _ = np.linalg.qr(rng.standard_normal((300, 4)))
    # An iterate with condition number 1e5 (mixed columns) and a component
    # along the previous blocks: one Gram pass leaves errors ~1e-7 here.
    a, _ = np.linalg.qr(rng.standard_normal((300, 6)))
    v, _ = np.linalg.qr(rng.standard_normal((6, 6)))
    w = ((a * np.geomspace(1, 1e-5, 6)) @ v
         + previous @ rng.standard_normal((4, 6)))
    q = learning._orthonormal_columns(w, previous, rng, final=True)
    assert q.shape == (300, 6)
    assert _gram_error(q) < 1e-12
    assert np.max(np.abs(previous.T @ q)) < 1e-12
    # Rank-revealing: 3 independent directions among 5 columns.
    low = rng.standard_normal((300, 3)) @ rng.standard_normal((3, 5))
    assert learning._gram_orthonormalize(low).shape == (300, 3)
    filled = learning._orthonormal_columns(low, previous, rng, final=True)
    assert filled.shape == (300, 5) and _gram_error(filled) < 1e-12
    assert np.max(np.abs(previous.T @ filled)) < 1e-12


def test_split_group_ranks():
    dims = [10000, 2500, 100, 2]
    table = learning.split_group_ranks([30, 60], dims, 'sqrt')
    assert [sum(row[j] for row in table) for j in range(2)] == [30, 60]
    # sqrt(d_g) weights 100 : 50 : 10 : 1.4 give quotas 18.59, 9.29, 1.86,
    # 0.26: floors plus the two largest remainders.
    assert [row[0] for row in table] == [19, 9, 2, 0]
    assert all(sum(row) <= d for row, d in zip(table, dims))
    equal = learning.split_group_ranks([8, 9], [50, 50, 50, 50], 'equal')
    assert [row[0] for row in equal] == [2, 2, 2, 2]
    assert sorted(row[1] for row in equal) == [2, 2, 2, 3]
    # Group 0 has 2 coordinates: its cap binds and the rest goes to group 1.
    assert learning.split_group_ranks([6, 3], [2, 100], 'equal') == [
        [2, 0], [4, 3]]
    with pytest.raises(ValueError, match='at most d'):
        learning.split_group_ranks([5], [2, 2])


def test_partition_variables():
    sizes = [432, 2304, 2304, 4608, 9216, 18432, 36864, 5770]
    groups = learning.partition_variables(sizes, 3)
    assert [v for g in groups for v in g] == list(range(len(sizes)))
    assert all(groups)
    assert groups[-1] == [6, 7]
    assert learning.partition_variables([1, 1], 2) == [[0], [1]]
    with pytest.raises(ValueError, match='num_groups'):
        learning.partition_variables([1, 1], 3)


def test_public_block_norms_match_numpy(grouped_basis):
    basis = grouped_basis
    grads = _per_variable(25, seed=13, rank=6)
    flat = np.concatenate([g.reshape(25, -1) for g in grads],
                          axis=1).astype(np.float64)
    for clip in (None, 0.5):
        x = flat
        if clip is not None:
            norms = np.linalg.norm(flat, axis=1, keepdims=True)
            x = flat * np.minimum(1.0, clip / norms)
        dense = reference.dense_principal_blocks(basis)
        expected = [np.mean(np.linalg.norm(x @ u, axis=1)) for u in dense]
        everything = np.concatenate(dense, axis=1)
        left = x - (x @ everything) @ everything.T
        expected.append(np.mean(np.linalg.norm(left, axis=1)))
        got = block_statistics.public_block_norms(basis, grads,
                                                  clip_norm=clip,
                                                  chunk_size=7)
        np.testing.assert_allclose(got, expected, rtol=1e-5)
        np.testing.assert_allclose(
            block_statistics.public_block_norms(basis, flat,
                                                clip_norm=clip), got,
            rtol=1e-6)


def _tiny_model(seed):
    init = tf.keras.initializers.GlorotUniform
    return tf.keras.Sequential([
        tf.keras.layers.Dense(6, activation='tanh', input_shape=(5,),
                              kernel_initializer=init(seed)),
        tf.keras.layers.Dense(3, kernel_initializer=init(seed + 1)),
    ])


def test_keras_public_gradients_match_tape():
    model = _tiny_model(0)
    rng = np.random.default_rng(14)
    x = rng.standard_normal((7, 5)).astype(np.float32)
    y = rng.integers(0, 3, 7)
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    grads = basis_refresh.public_per_example_gradients(model, loss, x, y,
                                                       batch_size=3)
    for i in range(7):
        with tf.GradientTape() as tape:
            value = loss(y[i:i + 1], model(x[i:i + 1]))
        expected = tape.gradient(value, model.trainable_variables)
        for g, e in zip(grads, expected):
            np.testing.assert_allclose(g[i], e.numpy(), atol=1e-6)
    groups = learning.groups_by_layer(model)
    assert groups == [[0, 1], [2, 3]]
    matrices = basis_refresh.public_gradient_matrices(model, loss, x, y,
                                                      groups=groups)
    assert [m.shape for m in matrices] == [(7, 36), (7, 21)]
    np.testing.assert_allclose(matrices[1][:, :18], grads[2].reshape(7, -1),
                               atol=1e-6)


def test_public_gradients_reuse_their_trace_and_follow_the_model():
    model = tf.keras.Sequential([tf.keras.layers.Input((5,)),
                                 tf.keras.layers.Dense(4, activation='tanh'),
                                 tf.keras.layers.Dense(3)])
    rng = np.random.default_rng(1)
    x = rng.standard_normal((7, 5)).astype(np.float32)
    y = rng.integers(0, 3, 7)
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def expected():
        with tf.GradientTape() as tape:
            value = loss(y[6:], model(x[6:]))  # The padded chunk's row.
        return tape.gradient(value, model.trainable_variables)

    basis_refresh.public_per_example_gradients(model, loss, x, y,
                                               batch_size=3)
    model.set_weights([w + 0.5 for w in model.get_weights()])
    grads = basis_refresh.public_per_example_gradients(model, loss, x, y,
                                                       batch_size=3)
    for g, e in zip(grads, expected()):
        np.testing.assert_allclose(g[6], e.numpy(), atol=1e-6)
    (traced,) = basis_refresh._TRACED[model].values()
    assert traced.experimental_get_tracing_count() == 1
    model.layers[0].trainable = False  # Other variables: another trace.
    grads = basis_refresh.public_per_example_gradients(model, loss, x, y,
                                                       batch_size=3)
    assert [g.shape for g in grads] == [(7, 4, 3), (7, 3)]
    for g, e in zip(grads, expected()):
        np.testing.assert_allclose(g[6], e.numpy(), atol=1e-6)


def test_basis_refresh_callback_refreshes_every_k_steps():
    model = _tiny_model(1)
    model.compile(optimizer=tf.keras.optimizers.SGD(0.5),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    rng = np.random.default_rng(15)
    x = rng.standard_normal((40, 5)).astype(np.float32)
    y = rng.integers(0, 3, 40)
    public = (x[:12], y[:12])
    seen = []

    def record(basis):
        seen.append((basis, [w.copy() for w in model.get_weights()]))

    per_example_loss = tf.keras.losses.SparseCategoricalCrossentropy(
        from_logits=True)
    callback = basis_refresh.BasisRefresh(
        model, public, per_example_loss, every_steps=2, on_refresh=record,
        ranks=[2, 3], groups=learning.groups_by_layer(model))
    model.fit(x[12:], y[12:], batch_size=4, epochs=1, verbose=0,
              callbacks=[callback])  # 7 steps: refresh before 0, 2, 4, 6
    assert callback.refresh_count == 4 and len(seen) == 4
    assert callback.basis is seen[-1][0]
    assert [b.metadata['seed'] for b, _ in seen] == [0, 1, 2, 3]
    # Each basis is the one learned from the public data alone at the
    # weights of its refresh, which changed in between.
    assert not np.allclose(seen[0][1][0], seen[2][1][0])
    for basis, weights in (seen[0], seen[2]):
        model.set_weights(weights)
        again = learning.learn_basis(
            basis_refresh.public_per_example_gradients(
                model, per_example_loss, *public), [2, 3],
            groups=learning.groups_by_layer(model),
            seed=basis.metadata['seed'])
        for a, b in zip(again.group_matrices, basis.group_matrices):
            np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6)
