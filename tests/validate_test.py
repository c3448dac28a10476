"""Tests of the one family of argument validators (tf_twice._validate)."""

import math

import numpy as np
import pytest

from tf_twice import _validate
from tf_twice.accounting import blocks as blocks_lib

pytestmark = pytest.mark.tf_free  # Run in one environment (conftest).

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize('check, value, expected', [
    (_validate.real, -2, -2.0),
    (_validate.positive, np.float32(0.5), 0.5),
    (_validate.non_negative, 0, 0.0),
    (_validate.rate, 1, 1.0),
    (_validate.probability, 1e-5, 1e-5),
])
def test_accepted_values_come_back_as_floats(check, value, expected):
    got = check('x', value)
    assert got == expected and type(got) is float


@pytest.mark.parametrize('check, values, message', [
    (_validate.real, [INF, -INF, NAN], 'x must be finite'),
    (_validate.positive, [0, -1.0, INF, NAN],
     r'x must be a finite number > 0'),
    (_validate.non_negative, [-1e-9, INF, NAN],
     r'x must be a finite number >= 0'),
    (_validate.rate, [0, 1.5, -INF, INF, NAN], r'x must be in \(0, 1\]'),
    (_validate.probability, [0, 1, INF, NAN], r'x must be in \(0, 1\)'),
])
def test_refusals_name_the_argument_and_the_range(check, values, message):
    # Non-finite values included: they get the range, not a bare "finite".
    for value in values:
        with pytest.raises(ValueError, match=message):
            check('x', value)


def test_an_l2_clip_is_refused_where_float32_cannot_hold_its_square():
    for value in (1e-12, 0.5, 1e30):
        assert _validate.l2_clip('c2', value) == value
    for value in (1e-13, 1e-30, 2e30, 1e39):
        with pytest.raises(ValueError, match=r'c2 must be a finite number '
                           r'> 0 in \[1e-12, 1e\+30\] \(a float32'):
            _validate.l2_clip('c2', value)
    for value in (0, -1.0, INF, NAN):
        with pytest.raises(ValueError, match=r'c2 must be a finite number '
                           r'> 0; got'):
            _validate.l2_clip('c2', value)


@pytest.mark.parametrize('check', [_validate.real, _validate.positive,
                                   _validate.non_negative, _validate.rate,
                                   _validate.probability])
def test_bools_and_non_numbers_are_refused(check):
    for value in (True, '0.5', None, [0.5]):
        with pytest.raises(ValueError, match='x must be a real number'):
            check('x', value)


def test_integer():
    assert _validate.integer('k', np.int64(3), 1) == 3
    assert type(_validate.integer('k', np.int64(3), 1)) is int
    for value, message in [(0, r'k must be an integer >= 1; got 0'),
                           (2.0, r'k must be an integer >= 1; got 2.0'),
                           (True, r'k must be an integer >= 1; got True')]:
        with pytest.raises(ValueError, match=message):
            _validate.integer('k', value, 1)
    with pytest.raises(ValueError, match=r'k must be an integer in \[0, 4\]'):
        _validate.integer('k', 5, 0, 4)


def test_accounting_blocks_use_the_same_checks():
    # Per-block arguments get _validate's message with the block index.
    for kwargs, name, value in [
            (dict(noise_multiplier=[1.0, INF]), 'noise_multiplier[1]', INF),
            (dict(l2_norm_clip=[NAN]), 'l2_norm_clip[0]', NAN),
            (dict(linf_norm_clip=[0.1, -1.0]), 'linf_norm_clip[1]', -1.0)]:
        arguments = dict(noise_multiplier=1.0, l2_norm_clip=1.0,
                         linf_norm_clip=None)
        arguments.update(kwargs)
        with pytest.raises(ValueError) as direct:
            _validate.positive(name, value)
        with pytest.raises(ValueError) as via_blocks:
            blocks_lib.Blocks.from_arguments(**arguments)
        assert str(via_blocks.value) == str(direct.value)
    for dims in ([3, 0], [3, None]):
        with pytest.raises(ValueError, match=r'block_dimensions\[1\] must '
                                             r'be an integer >= 1'):
            blocks_lib.Blocks.from_arguments(1.0, [1.0, 1.0], None, dims)
