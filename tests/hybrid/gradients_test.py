"""Tests of the one reader of per-example gradients (hybrid.gradients)."""

import math

import numpy as np
import pytest
import tensorflow as tf

from tf_twice.hybrid import diagnostics
from tf_twice.hybrid import gradients as gradients_lib
from tf_twice.hybrid import learning

pytestmark = pytest.mark.keras_free  # Once per TensorFlow (conftest).

SHAPES = [(2, 3), (4,), (1, 2, 2)]  # d = 6 + 4 + 4 = 14
D = 14


def _matrix(n=5, seed=0):
    return np.random.default_rng(seed).standard_normal((n, D)).astype(
        np.float32)


def _cut(matrix):
    cuts = np.cumsum([math.prod(s) for s in SHAPES])[:-1]
    return [p.reshape((matrix.shape[0],) + s)
            for p, s in zip(np.split(matrix, cuts, axis=1), SHAPES)]


def test_both_forms_read_into_both_layouts():
    matrix = _matrix()
    for given in (matrix, tf.constant(matrix), _cut(matrix)):
        got = gradients_lib.read_gradients(given, 'g', layout='matrix')
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, matrix)
        per_variable = gradients_lib.read_gradients(
            given, 'g', layout='per_variable', variable_shapes=SHAPES)
        assert [t.shape[1:] for t in per_variable] == SHAPES
        for a, b in zip(per_variable, _cut(matrix)):
            np.testing.assert_array_equal(a, b)
    # Without shapes a matrix stays one variable of shape (d,).
    whole = gradients_lib.read_gradients(matrix, 'g', layout='per_variable')
    assert len(whole) == 1
    np.testing.assert_array_equal(whole[0], matrix)


def test_float64_input_is_read_as_float32():
    matrix = _matrix().astype(np.float64)
    got = gradients_lib.read_gradients(list(_cut(matrix)), 'g',
                                       layout='matrix')
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, matrix.astype(np.float32))


@pytest.mark.parametrize('given, kwargs, match', [
    (np.ones((2, 3, 4)), {}, r'g as one array must be 2-D \[n, d\]'),
    ([], {}, 'g must hold at least one variable'),
    ([np.ones((3, 2)), np.ones((4, 2))], {}, 'same n >= 1 examples'),
    (np.ones((0, 4)), {}, 'same n >= 1 examples'),
    ([np.float32(1.0)], {}, 'same n >= 1 examples'),
    (np.full((2, 3), np.nan), {}, 'g must be finite'),
    ([np.ones((2, 3)), np.full((2, 1), np.inf)], {}, 'g must be finite'),
    (np.ones((2, 5)), dict(variable_shapes=[(2,), (2,)]),
     'variable_shapes must cover the d = 5 coordinates of g'),
    ([np.ones((2, 3))], dict(variable_shapes=[(4,)]),
     'variable_shapes must match the g'),
    (np.ones((2, 4)), dict(variable_shapes=[(0,)]), 'variable_shapes'),
    (np.ones((2, 4)), dict(layout='rows'), 'layout must be one of'),
])
def test_refusals_name_the_argument(given, kwargs, match):
    kwargs = dict(dict(layout='per_variable'), **kwargs)
    with pytest.raises(ValueError, match=match):
        gradients_lib.read_gradients(given, 'g', **kwargs)


def test_learning_and_diagnostics_read_alike():
    # The same bad input is refused by both tools with the same message.
    ragged = [np.ones((3, 4), np.float32), np.ones((2, 4), np.float32)]
    for call in (lambda g: learning.learn_basis(g, [1]),
                 diagnostics.gradient_geometry,
                 diagnostics.coordinate_significance):
        with pytest.raises(ValueError, match='same n >= 1 examples'):
            call(ragged)
    # And the same good input in either form gives the same results.
    matrix = _matrix(12, seed=3)
    for given in (matrix, _cut(matrix)):
        np.testing.assert_array_equal(
            diagnostics.coordinate_significance(given),
            np.mean(np.abs(matrix, dtype=np.float64), axis=0))
    basis_a = learning.learn_basis(matrix, [2], variable_shapes=SHAPES)
    basis_b = learning.learn_basis(_cut(matrix), [2])
    basis_c = learning.learn_basis(lambda: _cut(matrix), [2])
    for other in (basis_b, basis_c):
        assert other.variable_shapes == basis_a.variable_shapes
        np.testing.assert_array_equal(other.group_matrices[0].numpy(),
                                      basis_a.group_matrices[0].numpy())
