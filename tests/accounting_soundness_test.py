"""Soundness of the accountant at adversarial settings.

Every epsilon the accountant reports must bound the true one from above.
"""

import math

import numpy as np
import pytest

from tf_twice.accounting import calibration
from tf_twice.accounting import epsilon_after_steps
from tf_twice.accounting import TwiceSampledGaussianDpEvent
from tf_twice.accounting import TwiceSamplingRdpAccountant
from tf_twice.accounting import twice_sampling_rdp

# ---------------------------------------------------------------------------
# Orders: a fractional order uses the next integer order, never the one below.


@pytest.mark.parametrize('order,ceiling', [
    (1 + 1e-13, 2), (1.0000000000000002, 2), (2 + 5e-13, 3),
    (3.0000000000000004, 4), (64 + 1e-11, 65)])
def test_order_a_rounding_error_above_an_integer_uses_the_next_one(
        order, ceiling):
    kwargs = dict(example_sampling_rate=0.1, coordinate_sampling_rate=0.5,
                  noise_multiplier=0.8, linf_norm_clip=0.1)
    ours = twice_sampling_rdp([order, ceiling], **kwargs)
    assert ours[0] == ours[1]  # Also not NaN.
    if ceiling > 2:  # Strictly above the integer order below the order.
        assert ours[0] > twice_sampling_rdp([ceiling - 1], **kwargs)[0]


def test_no_order_yields_a_nan_epsilon():
    # A NaN RDP reads as epsilon 0 in dp_accounting's compute_epsilon
    # (max(0, nan) is 0). An order just above 1 is not order 1 (0/0).
    orders = [1 + 1e-13, 1.5, 2.0, 3.0]
    for conversion in ('dp_accounting', 'basic'):
        eps = epsilon_after_steps(
            steps=100, delta=1e-5, example_sampling_rate=0.1,
            coordinate_sampling_rate=0.5, noise_multiplier=1.0,
            linf_norm_clip=0.1, orders=orders, conversion=conversion)
        assert eps == epsilon_after_steps(
            steps=100, delta=1e-5, example_sampling_rate=0.1,
            coordinate_sampling_rate=0.5, noise_multiplier=1.0,
            linf_norm_clip=0.1, orders=orders[1:], conversion=conversion)


# ---------------------------------------------------------------------------
# Noise so small that the tables would overflow: +inf, never 0 or NaN.


@pytest.mark.parametrize('z', [1e-154, 1e-160, 1e-200, 1e-300])
@pytest.mark.parametrize('q1,q2,linf', [(0.1, 0.5, 0.1), (1.0, 0.5, 0.1),
                                        (0.1, 1.0, None), (1.0, 1.0, None),
                                        (1e-6, 1e-6, 0.5)])
def test_tiny_noise_is_never_reported_private(z, q1, q2, linf):
    kwargs = dict(example_sampling_rate=q1, coordinate_sampling_rate=q2,
                  linf_norm_clip=linf)
    orders = [2, 3, 64]
    ours = twice_sampling_rdp(orders, noise_multiplier=z, **kwargs)
    # Less noise cannot lose less privacy than z = 1e-100 (RDP ~ 1e200).
    more_noise = twice_sampling_rdp(orders, noise_multiplier=1e-100, **kwargs)
    assert np.all(np.isfinite(more_noise)) and np.all(more_noise > 1e150)
    assert not np.any(np.isnan(ours))
    assert np.all(ours >= more_noise)
    for conversion in ('dp_accounting', 'basic'):
        assert epsilon_after_steps(
            steps=1, delta=1e-5, noise_multiplier=z, orders=orders,
            conversion=conversion, **kwargs) == math.inf


def test_several_tiny_noise_blocks_overflow_to_infinity():
    # Each block's L(32) is finite (~5.5e307); the sum of four is not.
    ours = twice_sampling_rdp(
        [2, 32], example_sampling_rate=0.5, coordinate_sampling_rate=0.5,
        noise_multiplier=[3e-153] * 4, linf_norm_clip=None)
    assert np.all(ours == math.inf)
    accountant = TwiceSamplingRdpAccountant()
    accountant.compose(TwiceSampledGaussianDpEvent(0.1, 0.5, 1.0, 1.0, 0.1),
                       10)
    accountant.compose(TwiceSampledGaussianDpEvent(0.5, 0.5, [3e-153] * 4,
                                                   1.0, None))
    assert accountant.get_epsilon(1e-5) == math.inf


# ---------------------------------------------------------------------------
# Searches return only noise that the full accountant accepts.


def _undercut(exact, factor):
    """A function below `exact`: a 'bound' that is not one."""
    return lambda s: exact(s) * factor


@pytest.mark.parametrize('lower', [0.01, 1.97])
def test_search_returns_only_scales_the_exact_function_accepts(lower):
    # If the cheap function undercuts the exact one (it must not; a bound
    # computed separately could by a rounding error), the result must still
    # meet the target exactly, not merely by the cheap function. With
    # lower = 1.97 the cheap function already passes at the lower end.
    def exact(s):
        return 2.0 / s

    s = calibration.smallest_scale_meeting(
        _undercut(exact, 0.98), 1.0, lower=lower, upper=100.0,
        tolerance=1e-2, exact_epsilon_of_scale=exact)
    assert exact(s) <= 1.0
    assert 0.99 <= exact(s)
