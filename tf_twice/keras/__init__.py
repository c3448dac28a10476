"""Keras integration: the per-example DP training path, guards, the ledger.

One import per line, so that modules can be added without touching others.
"""

# First: refuses, naming the fix, a tf.keras that tf_twice cannot use.
from tf_twice import _keras  # noqa: F401  pylint: disable=unused-import
from tf_twice.keras.basis_refresh import BasisRefresh
from tf_twice.keras.basis_refresh import public_per_example_gradients
from tf_twice.keras.dp_model import DPModel
from tf_twice.keras.hybrid_planning import HybridPlan
from tf_twice.keras.hybrid_planning import plan_hybrid_clipping
from tf_twice.keras.per_example import default_physical_batch_size
from tf_twice.keras.guards import NonPoissonInputWarning
from tf_twice.keras.guards import check_ledger_event
from tf_twice.keras.guards import check_no_example_mixing
from tf_twice.keras.guards import check_per_example_loss
from tf_twice.keras.guards import check_poisson_input
from tf_twice.keras.ledger import PrivacyLedger
from tf_twice.keras.private_training import PrivateTraining
from tf_twice.keras.private_training import make_private
