"""RDP to (epsilon, delta) conversions."""

from __future__ import annotations

import enum
import math
from typing import Sequence, Tuple, Union

from dp_accounting.rdp import rdp_privacy_accountant
import numpy as np


class Conversion(enum.Enum):
    """Which RDP-to-DP conversion to use.

    DP_ACCOUNTING: dp_accounting's `compute_epsilon` (Balle et al. 2020,
      arXiv:2004.00010, Prop. 12), the default and the tightest.
    BASIC: eps = min_alpha rdp(alpha) + log(1/delta) / (alpha - 1) (Mironov
      2017, arXiv:1702.07476, Prop. 3), the conversion the paper's tables
      use; offered only to reproduce them. Both are sound; BASIC is looser.
    """
    DP_ACCOUNTING = 'dp_accounting'
    BASIC = 'basic'


ConversionLike = Union[Conversion, str]


def as_conversion(conversion: ConversionLike) -> Conversion:
    try:
        return Conversion(conversion if isinstance(conversion, str)
                          else conversion.value)
    except (ValueError, AttributeError):
        allowed = ', '.join(repr(c.value) for c in Conversion)
        raise ValueError(f'conversion must be one of {allowed}; got '
                         f'{conversion!r}.') from None


def rdp_to_epsilon(orders: Sequence[float], rdp: Sequence[float],
                   delta: float,
                   conversion: ConversionLike = Conversion.DP_ACCOUNTING
                   ) -> Tuple[float, float]:
    """(epsilon, optimal order) for an RDP curve at target `delta`."""
    conversion = as_conversion(conversion)
    if conversion is Conversion.DP_ACCOUNTING:
        eps, order = rdp_privacy_accountant.compute_epsilon(orders, rdp, delta)
        return float(eps), float(order)
    orders = np.asarray(orders, dtype=np.float64)
    eps = np.asarray(rdp, dtype=np.float64) + math.log(1.0 / delta) / (
        orders - 1.0)
    best = int(np.argmin(eps))
    return float(eps[best]), float(orders[best])
