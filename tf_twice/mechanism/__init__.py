"""Mechanisms on per-example gradients: the clip-mask-noise-normalise step.

TensorFlow ops on tensors: nothing here builds Keras objects or computes
privacy. ``randomness`` holds the step keys and the Philox stream layout of
masks and noise; ``aggregation`` is the one clip-mask-noise-normalise
aggregation (one block or several), built on the per-tensor ``kernels``, the
argument checks of ``arguments`` and the dtype and rounding rules of
``precision``; ``hybrid`` runs it on hybrid-clipping blocks of a
``HybridBasis`` (``basis``; its structure and tensor layouts in
``basis_layout``, its file format in ``basis_io``);
``aggregator.PrivateAggregator`` runs one logical batch for every training
path, on one device or several, and owns the secret step keys
(``step_keys``).
"""

# First: refuses, naming the fix, a tf.keras that tf_twice cannot use.
from tf_twice import _keras  # noqa: F401  pylint: disable=unused-import
from tf_twice.config import MASK_PRECISION_BITS
from tf_twice.config import effective_coordinate_sampling_rate
from tf_twice.mechanism.aggregation import add_block_noise_and_normalize
from tf_twice.mechanism.aggregation import add_noise_and_normalize
from tf_twice.mechanism.aggregation import clipped_masked_block_sums
from tf_twice.mechanism.aggregation import clipped_masked_sum
from tf_twice.mechanism.aggregation import validate_params
from tf_twice.mechanism.hybrid import BasisVariables
from tf_twice.mechanism.aggregator import PrivateAggregator
from tf_twice.mechanism.step_keys import StepKeys
from tf_twice.mechanism.randomness import coordinate_masks
from tf_twice.mechanism.randomness import draw_step_key
from tf_twice.mechanism.randomness import standard_normal_noise
