"""Every accounting entry point refuses what would make its epsilon unsound.

The range checks of the accounting modules live in ``tf_twice._validate``
(moved there from ``accounting/blocks.py``). Each entry point is called once
with valid arguments (so a refusal below cannot come from a wrong call) and
then with each argument replaced by values that must be refused: noise 0 (no
privacy, epsilon infinite: only ``non_private`` configs may say it), rates
of 0 or above 1, non-finite, negative or boolean numbers, numpy NaN and
booleans, strings, non-integer step counts. A value that slipped through
would give an epsilon for a mechanism that does not exist.
"""

import math

import numpy as np
import pytest

from tf_twice import accounting
from tf_twice.accounting import budget as budget_lib
from tf_twice.config import Block, TwiceSamplingConfig

pytestmark = pytest.mark.tf_free  # Run in one environment (conftest).

NAN, INF = math.nan, math.inf

POSITIVE = [0, 0.0, -1.0, NAN, INF, -INF, True, np.float32(NAN),
            np.bool_(True), '1.0', None]
RATE = [0, 0.0, -0.1, 1.0000001, 2, NAN, INF, True, np.float32(1.5),
        np.bool_(True), '0.5', None]
PROBABILITY = [0, 1, 1.0, -1e-5, NAN, INF, True, '1e-5', None]
COUNT = [0, -1, 1.5, 2.0, True, NAN, '3', None]

_EVENT = dict(example_sampling_rate=0.1, coordinate_sampling_rate=0.5,
              noise_multiplier=1.0, l2_norm_clip=1.0, linf_norm_clip=0.5)
_STEPS = dict(steps=10, delta=1e-5, example_sampling_rate=0.1,
              coordinate_sampling_rate=0.5, noise_multiplier=1.0,
              l2_norm_clip=1.0, linf_norm_clip=0.5)
_CALIBRATE = dict(target_epsilon=2.0, delta=1e-5, steps=10,
                  example_sampling_rate=0.1, coordinate_sampling_rate=0.5,
                  l2_norm_clip=1.0, linf_norm_clip=0.5)
_OPTIMIZE = dict(target_epsilon=2.0, delta=1e-5, steps=10,
                 example_sampling_rate=0.1, coordinate_sampling_rate=0.5,
                 l2_norm_clips=[1.0, 1.0], linf_norm_clips=[None, None],
                 ranks=[4, 40])
_STATEMENT = dict(number_of_examples=1000, batch_size=100, num_epochs=1,
                  noise_multiplier=1.0, delta=1e-5,
                  coordinate_sampling_rate=0.5, l2_norm_clip=1.0,
                  linf_norm_clip=0.5)
_CONFIG = dict(num_examples=100, expected_batch_size=10.0,
               coordinate_sampling_rate=0.5, l2_norm_clip=1.0,
               noise_multiplier=1.0, linf_norm_clip=0.5)


def _event(**kw):
    return accounting.TwiceSampledGaussianDpEvent(**dict(_EVENT, **kw))


def _charge(count):
    budget = budget_lib.PrivacyBudget(_event(), 1e-5)
    budget.charge(count)
    return budget.epsilon


# (name, function of the replaced arguments, the arguments' bad values)
ENTRY_POINTS = [
    ('event', _event, {
        'example_sampling_rate': RATE, 'coordinate_sampling_rate': RATE,
        'noise_multiplier': POSITIVE, 'l2_norm_clip': POSITIVE,
        'linf_norm_clip': POSITIVE[:-1], 'block_dimensions': COUNT[:-1]}),
    ('rdp', lambda **kw: accounting.twice_sampling_rdp(
        **dict(dict(_EVENT, orders=[2, 8]), **kw)), {
            'example_sampling_rate': RATE,
            'coordinate_sampling_rate': RATE,
            'noise_multiplier': POSITIVE, 'l2_norm_clip': POSITIVE,
            'orders': [[1.0], [0.5], [NAN], [INF], [], [2, NAN]]}),
    ('epsilon_after_steps', lambda **kw: accounting.epsilon_after_steps(
        **dict(_STEPS, **kw)), {
            'steps': COUNT, 'delta': PROBABILITY,
            'example_sampling_rate': RATE,
            'coordinate_sampling_rate': RATE,
            'noise_multiplier': POSITIVE, 'l2_norm_clip': POSITIVE,
            'linf_norm_clip': POSITIVE[:-1]}),
    ('calibrate', lambda **kw: accounting.calibrate_noise_multiplier(
        **dict(_CALIBRATE, **kw)), {
            'target_epsilon': POSITIVE, 'steps': COUNT,
            'delta': PROBABILITY, 'coordinate_sampling_rate': RATE,
            'l2_norm_clip': POSITIVE}),
    ('optimize', lambda **kw: accounting.optimize_block_noise(
        **dict(_OPTIMIZE, **kw)), {
            'target_epsilon': POSITIVE, 'delta': PROBABILITY,
            'coordinate_sampling_rate': RATE,
            'l2_norm_clips': [[1.0, v] for v in POSITIVE],
            'ranks': [[4, v] for v in COUNT]}),
    ('statement', lambda **kw: (
        accounting.compute_twice_sampling_privacy_statement(
            **dict(_STATEMENT, **kw))), {
                'number_of_examples': COUNT, 'batch_size': POSITIVE,
                'num_epochs': POSITIVE, 'delta': PROBABILITY,
                'noise_multiplier': POSITIVE,
                'coordinate_sampling_rate': RATE}),
    ('config', lambda **kw: TwiceSamplingConfig.single(
        **dict(_CONFIG, **kw)).dp_event(), {
            'num_examples': COUNT, 'expected_batch_size': POSITIVE + [101.0],
            'coordinate_sampling_rate': RATE + [1e-6],
            'noise_multiplier': [v for v in POSITIVE if v is not None],
            'l2_norm_clip': POSITIVE, 'linf_norm_clip': POSITIVE[:-1],
            'non_private': [1, 'yes', np.bool_(True)]}),
    ('block', lambda **kw: Block(**dict(l2_norm_clip=1.0,
                                        noise_multiplier=1.0, **kw)), {
        'dimension': COUNT[:-1]}),
    ('ledger', lambda **kw: budget_lib.PrivacyBudget(
        _event(), **dict(dict(delta=1e-5), **kw)).epsilon, {
            'delta': PROBABILITY, 'target_epsilon': POSITIVE[:-1],
            'max_steps': [-1, 1.5, True, NAN, '3'],
            'save_every_steps': COUNT[:-1],
            'orders': [[1.0], [0.5], [NAN], [INF], []]}),
    ('charge', lambda count=1: _charge(count), {'count': COUNT}),
]


@pytest.mark.parametrize('name, call, bad', ENTRY_POINTS,
                         ids=[e[0] for e in ENTRY_POINTS])
def test_entry_point_refuses_every_bad_value(name, call, bad):
    good = call()
    if isinstance(good, float):
        assert 0 <= good < INF, name
    accepted = []
    for argument, values in bad.items():
        for value in values:
            try:
                call(**{argument: value})
            except ValueError:
                continue
            accepted.append(f'{argument}={value!r}')
    assert not accepted, f'{name} accepted {accepted}'


def test_linf_clip_above_l2_clip_is_the_l2_clip_not_a_tighter_bound():
    # c_inf >= c2 has no effect after l2 clipping: the bound is the l2
    # one, never a smaller one.
    above = accounting.epsilon_after_steps(**dict(_STEPS, linf_norm_clip=5.0))
    none = accounting.epsilon_after_steps(**dict(_STEPS, linf_norm_clip=None))
    assert above == none


def test_an_event_with_fewer_coordinates_than_d0_is_a_smaller_epsilon():
    # Why a block dimension must be the model's (tests/keras/
    # privacy_audit_test.py): the accountant trusts it.
    small = accounting.epsilon_after_steps(**dict(
        _STEPS, linf_norm_clip=0.1, block_dimensions=1))
    full = accounting.epsilon_after_steps(**dict(
        _STEPS, linf_norm_clip=0.1))
    assert small < full / 2
