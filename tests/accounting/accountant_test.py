"""Tests of the DpEvent and the accountant extension."""

import attr
import dp_accounting
from dp_accounting.rdp import rdp_privacy_accountant
import numpy as np
import pytest

import tf_twice
from tf_twice.accounting import TwiceSampledGaussianDpEvent
from tf_twice.accounting import TwiceSamplingRdpAccountant
from tf_twice.accounting import twice_sampling_rdp

pytestmark = pytest.mark.tf_free  # Run in one environment (conftest).

ORDERS = np.array(rdp_privacy_accountant.DEFAULT_RDP_ORDERS)


def _event(**overrides):
    kwargs = dict(example_sampling_rate=0.01, coordinate_sampling_rate=0.5,
                  noise_multiplier=1.1, l2_norm_clip=1.0, linf_norm_clip=0.1)
    kwargs.update(overrides)
    return TwiceSampledGaussianDpEvent(**kwargs)


def _one_step(event):
    return twice_sampling_rdp(
        ORDERS, example_sampling_rate=event.example_sampling_rate,
        coordinate_sampling_rate=event.coordinate_sampling_rate,
        noise_multiplier=event.noise_multiplier,
        l2_norm_clip=event.l2_norm_clip, linf_norm_clip=event.linf_norm_clip,
        block_dimensions=event.block_dimensions)


def test_reexported_from_package():
    assert tf_twice.TwiceSamplingRdpAccountant is TwiceSamplingRdpAccountant
    assert tf_twice.twice_sampling_rdp is twice_sampling_rdp


def test_event_is_frozen_attrs_dp_event_with_keyword_construction():
    event = _event()
    assert isinstance(event, dp_accounting.DpEvent)
    assert attr.has(type(event))
    with pytest.raises(attr.exceptions.FrozenInstanceError):
        event.noise_multiplier = 2.0
    positional = TwiceSampledGaussianDpEvent(0.01, 0.5, 1.1, 1.0, 0.1)
    assert positional == event and hash(positional) == hash(event)


def test_event_without_linf_clip_needs_no_linf_argument():
    # DP-SGD (q2 = 1, no l-infinity clip) is dp_accounting's Poisson
    # subsampled Gaussian; its event is written without the argument.
    event = TwiceSampledGaussianDpEvent(
        example_sampling_rate=0.01, coordinate_sampling_rate=1.0,
        noise_multiplier=1.1, l2_norm_clip=1.0)
    assert event == _event(coordinate_sampling_rate=1.0, linf_norm_clip=None)
    orders = list(range(2, 65))  # Integer orders: exact for both.
    stock = dp_accounting.rdp.RdpAccountant(orders).compose(
        dp_accounting.PoissonSampledDpEvent(
            0.01, dp_accounting.GaussianDpEvent(1.1)), 100)
    ours = TwiceSamplingRdpAccountant(orders).compose(event, 100)
    assert ours.get_epsilon(1e-5) == pytest.approx(stock.get_epsilon(1e-5),
                                                   rel=1e-9)


_PER_BLOCK_RATES = dict(
    coordinate_sampling_rate=[1.0, 0.5], noise_multiplier=[1.0, 2.0],
    l2_norm_clip=[0.5, 1.0], linf_norm_clip=[None, 0.1])


@pytest.mark.parametrize('event', [
    _event(),
    _event(noise_multiplier=[1.0, 2.0], l2_norm_clip=[0.5, 1.0],
           linf_norm_clip=[0.1, None], block_dimensions=[10, 1000]),
    _event(**_PER_BLOCK_RATES),
])
def test_named_tuple_round_trip(event):
    named = event.to_named_tuple()
    assert named.class_name == 'TwiceSampledGaussianDpEvent'
    assert dp_accounting.DpEvent.from_named_tuple(named) == event
    composed = dp_accounting.SelfComposedDpEvent(event, 7)
    assert dp_accounting.DpEvent.from_named_tuple(
        composed.to_named_tuple()) == composed


def test_event_lists_become_tuples():
    event = _event(noise_multiplier=[1.0, 2.0], l2_norm_clip=np.array([1., 2.]),
                   linf_norm_clip=[0.1, 0.2])
    assert event.noise_multiplier == (1.0, 2.0)
    assert event.l2_norm_clip == (1.0, 2.0)
    hash(event)


@pytest.mark.parametrize('overrides,message', [
    (dict(example_sampling_rate=0.0), 'example_sampling_rate'),
    (dict(coordinate_sampling_rate=2.0), 'coordinate_sampling_rate'),
    (dict(noise_multiplier=-1.0), 'noise_multiplier'),
    (dict(noise_multiplier=[1.0, 1.0], l2_norm_clip=[1.0, 1.0, 1.0]),
     'equal lengths'),
    (dict(coordinate_sampling_rate=[1.0, 0.0], noise_multiplier=[1.0, 1.0]),
     r'coordinate_sampling_rate\[1\]'),
    (dict(coordinate_sampling_rate=[1.0, 0.5]),
     'coordinate_sampling_rate must be one rate for every block or one per'),
])
def test_event_validates(overrides, message):
    with pytest.raises(ValueError, match=message):
        _event(**overrides)


@pytest.mark.parametrize('steps', [1, 10, 10_000])
def test_composition_is_steps_times_one_step(steps):
    event = _event()
    accountant = TwiceSamplingRdpAccountant()
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, steps))
    np.testing.assert_allclose(accountant.rdp, steps * _one_step(event),
                               rtol=1e-12)
    # One step at a time gives the same.
    stepwise = TwiceSamplingRdpAccountant()
    for _ in range(min(steps, 50)):
        stepwise.compose(event)
    np.testing.assert_allclose(stepwise.rdp, min(steps, 50) * _one_step(event),
                               rtol=1e-12)


def test_per_block_rates_compose_and_reduce_to_one_rate():
    event = _event(**_PER_BLOCK_RATES)
    assert event.coordinate_sampling_rate == (1.0, 0.5)
    accountant = TwiceSamplingRdpAccountant().compose(event, 30)
    np.testing.assert_allclose(accountant.rdp, 30 * _one_step(event),
                               rtol=1e-12)
    one_rate = dict(_PER_BLOCK_RATES, coordinate_sampling_rate=0.5)
    np.testing.assert_allclose(
        _one_step(_event(**dict(one_rate, coordinate_sampling_rate=[0.5,
                                                                    0.5]))),
        _one_step(_event(**one_rate)), rtol=1e-12)
    # Keeping the first block unmasked adds to the RDP; masking it less
    # cannot lower it.
    assert (_one_step(event) > _one_step(_event(**one_rate))).all()
    # The event's record of its blocks carries the rates, one per block.
    assert event.blocks().coordinate_sampling_rates == (1.0, 0.5)
    assert _event(**one_rate).blocks().coordinate_sampling_rates == (0.5,
                                                                     0.5)


def test_epsilon_uses_dp_accountings_conversion():
    event = _event()
    accountant = TwiceSamplingRdpAccountant()
    accountant.compose(event, 2000)
    expected = rdp_privacy_accountant.compute_epsilon(
        ORDERS, 2000 * _one_step(event), 1e-5)
    assert accountant.get_epsilon_and_optimal_order(1e-5) == expected
    assert accountant.get_epsilon(1e-5) == expected[0]


def test_composes_next_to_stock_events():
    ours = _event()
    stock = dp_accounting.PoissonSampledDpEvent(
        0.02, dp_accounting.GaussianDpEvent(1.3))
    accountant = TwiceSamplingRdpAccountant()
    accountant.compose(dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(ours, 30),
        dp_accounting.SelfComposedDpEvent(stock, 20),
        dp_accounting.GaussianDpEvent(5.0),
    ]))
    reference = rdp_privacy_accountant.RdpAccountant()
    reference.compose(dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(stock, 20),
        dp_accounting.GaussianDpEvent(5.0)]))
    np.testing.assert_allclose(
        accountant.rdp, 30 * _one_step(ours) + reference._rdp,  # pylint: disable=protected-access
        rtol=1e-12)


def test_stock_events_are_deferred_to_the_parent():
    stock = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        0.01, dp_accounting.GaussianDpEvent(1.0)), 1000)
    ours = TwiceSamplingRdpAccountant().compose(stock)
    theirs = rdp_privacy_accountant.RdpAccountant().compose(stock)
    assert ours.get_epsilon(1e-5) == theirs.get_epsilon(1e-5)


def test_event_cannot_be_nested_in_poisson_sampling():
    nested = dp_accounting.PoissonSampledDpEvent(0.1, _event())
    accountant = TwiceSamplingRdpAccountant()
    assert not accountant.supports(nested)
    with pytest.raises(dp_accounting.UnsupportedEventError):
        accountant.compose(nested)
    assert accountant.supports(dp_accounting.SelfComposedDpEvent(_event(), 3))


def test_replace_one_adjacency_is_refused():
    accountant = TwiceSamplingRdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    assert not accountant.supports(_event())


def test_distinct_events_are_not_confused_by_the_cache():
    a, b = _event(), _event(coordinate_sampling_rate=0.25)
    accountant = TwiceSamplingRdpAccountant()
    accountant.compose(a, 3)
    accountant.compose(b, 5)
    np.testing.assert_allclose(accountant.rdp,
                               3 * _one_step(a) + 5 * _one_step(b), rtol=1e-12)


def test_custom_orders_and_bad_orders():
    accountant = TwiceSamplingRdpAccountant(orders=[2, 4, 8])
    accountant.compose(_event())
    assert accountant.rdp.shape == (3,)
    with pytest.raises(ValueError, match='orders must'):
        TwiceSamplingRdpAccountant(orders=[0.5, 2])
