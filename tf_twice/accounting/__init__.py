"""Privacy accounting for twice sampling and hybrid clipping.

Pure numpy, scipy and dp_accounting: neither importing it nor building a
privacy statement imports TensorFlow or tf_privacy.

* `twice_sampling_rdp`: the exact RDP of one step ([COORD] + [TWICE]).
* `TwiceSampledGaussianDpEvent`, `TwiceSamplingRdpAccountant`: the
  dp_accounting extension.
* `epsilon_after_steps`, `epsilon_and_optimal_order_after_steps`: epsilon
  after T identical steps (a float; the tuple adds the optimal order).
* `calibrate_noise_multiplier`, `optimize_block_noise`,
  `hybrid_clipping_noise_multipliers`: noise choice.
* `compute_twice_sampling_privacy[_statement]`: beside tf_privacy's.
"""

from tf_twice.accounting.accountant import TwiceSamplingRdpAccountant
from tf_twice.accounting.calibration import calibrate_noise_multiplier
from tf_twice.accounting.calibration import DEFAULT_ORDERS
from tf_twice.accounting.calibration import epsilon_after_steps
from tf_twice.accounting.calibration import epsilon_and_optimal_order_after_steps
from tf_twice.accounting.calibration import MAX_NOISE_MULTIPLIER
from tf_twice.accounting.calibration import MIN_NOISE_MULTIPLIER
from tf_twice.accounting.conversion import Conversion
from tf_twice.accounting.conversion import rdp_to_epsilon
from tf_twice.accounting.dp_event import TwiceSampledGaussianDpEvent
from tf_twice.accounting.noise_optimization import hybrid_clipping_noise_multipliers
from tf_twice.accounting.noise_optimization import optimize_block_noise
from tf_twice.accounting.rdp import MAX_ORDER
from tf_twice.accounting.rdp import twice_sampling_rdp
from tf_twice.accounting.statement import compute_twice_sampling_privacy
from tf_twice.accounting.statement import compute_twice_sampling_privacy_statement
from tf_twice.accounting.statement import hybrid_noise_variance_ratio
from tf_twice.accounting.statement import noise_variance_ratio

__all__ = [
    'Conversion',
    'DEFAULT_ORDERS',
    'MAX_NOISE_MULTIPLIER',
    'MAX_ORDER',
    'MIN_NOISE_MULTIPLIER',
    'TwiceSampledGaussianDpEvent',
    'TwiceSamplingRdpAccountant',
    'calibrate_noise_multiplier',
    'compute_twice_sampling_privacy',
    'compute_twice_sampling_privacy_statement',
    'epsilon_after_steps',
    'epsilon_and_optimal_order_after_steps',
    'hybrid_clipping_noise_multipliers',
    'hybrid_noise_variance_ratio',
    'noise_variance_ratio',
    'optimize_block_noise',
    'rdp_to_epsilon',
    'twice_sampling_rdp',
]
