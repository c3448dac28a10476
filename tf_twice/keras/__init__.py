"""Keras integration: the per-example DP training path, guards, the ledger.

One import per line, so that modules can be added without touching others.
"""

from tf_twice.keras.dp_model import DPModel
from tf_twice.keras.dp_model import make_private
from tf_twice.keras.guards import NonPoissonInputWarning
from tf_twice.keras.guards import check_event_matches
from tf_twice.keras.guards import check_event_matches_model
from tf_twice.keras.guards import check_no_example_mixing
from tf_twice.keras.guards import check_per_example_loss
from tf_twice.keras.guards import check_poisson_input
from tf_twice.keras.guards import dp_event_from_params
from tf_twice.keras.guards import model_dp_params
from tf_twice.keras.ledger import PrivacyLedger
