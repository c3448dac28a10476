"""tf_twice: DP-SGD with twice sampling and hybrid clipping for Keras.

Implements "Geometry of Sensitivity: Twice Sampling and Hybrid Clipping in
Differential Privacy with Optimal Gaussian Noise" (CCS 2023) on top of
TensorFlow Privacy and dp_accounting.

Layers, each importing only downward:
  * ``tf_twice.config`` (no TensorFlow): ``TwiceSamplingConfig``, the one
    description of the mechanism, from which everything below is derived.
  * ``tf_twice.accounting`` (numpy + dp_accounting, no TensorFlow): the RDP of
    twice sampling, the DpEvent, the accountant, noise calibration and
    per-block noise optimisation, privacy statements.
  * ``tf_twice.sampling`` and ``tf_twice.mechanism``: Poisson logical batches
    and the one clip-mask-noise-normalise aggregation.
  * ``tf_twice.hybrid``: hybrid-clipping budgets and noise from public data
    (``plan_blocks``).
  * ``tf_twice.optimizers`` and ``tf_twice.keras``: what Keras users call.

The config and accounting names are re-exported here; importing ``tf_twice``
does not import TensorFlow.
"""

from tf_twice.accounting import *  # pylint: disable=wildcard-import
from tf_twice.accounting import __all__ as _accounting_all
from tf_twice.config import Block
from tf_twice.config import TwiceSamplingConfig

__version__ = '0.1.0'
__all__ = ['Block', 'TwiceSamplingConfig'] + list(_accounting_all)
