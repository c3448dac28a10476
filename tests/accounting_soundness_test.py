"""Soundness of the accountant at adversarial settings.

Every epsilon the accountant reports must bound the true one from above.
"""

import numpy as np
import pytest

from tf_twice.accounting import epsilon_after_steps
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
