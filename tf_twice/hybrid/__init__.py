"""Hybrid clipping set-up, host side: the basis and the budgets.

``learning.learn_basis`` learns a ``HybridBasis`` from PUBLIC per-example
gradients; ``budgets.plan_blocks`` turns a one-block ``TwiceSamplingConfig``
and that basis into the per-block config that training runs (the global l2
budget split over blocks by one of ``budget_splits.BUDGET_SPLITS``, from the
public statistics of ``block_statistics``; l-infinity clips; per-block noise
optimised for a budget), and ``budgets.replanned_block_scales`` re-splits
that budget at a basis refresh, at the same epsilon;
``diagnostics.gradient_geometry`` measures the per-example geometry that
hybrid clipping exploits, ``stages.staged_updates`` a mechanism's update
after its clip, masks and noise;
``gradients.read_gradients`` is the one reader of public per-example
gradients they share. The training step that uses basis and config is
``tf_twice.mechanism.hybrid``.
"""

from tf_twice.hybrid.block_statistics import PublicBlockStatistics
from tf_twice.hybrid.block_statistics import public_block_norms
from tf_twice.hybrid.block_statistics import public_block_statistics
from tf_twice.hybrid.budget_splits import BUDGET_SPLITS
from tf_twice.hybrid.budget_splits import quantile_l2_budget
from tf_twice.hybrid.budget_splits import split_l2_budget
from tf_twice.hybrid.budget_splits import variance_optimal_l2_budget
from tf_twice.hybrid.budgets import hybrid_noise_multipliers
from tf_twice.hybrid.budgets import linf_clips_from_d0
from tf_twice.hybrid.budgets import plan_blocks
from tf_twice.hybrid.budgets import replanned_block_scales
from tf_twice.hybrid.diagnostics import GradientGeometry
from tf_twice.hybrid.diagnostics import coordinate_significance
from tf_twice.hybrid.diagnostics import gradient_geometry
from tf_twice.hybrid.learning import DEFAULT_POWER_ITERATIONS
from tf_twice.hybrid.learning import group_matrices
from tf_twice.hybrid.learning import groups_by_layer
from tf_twice.hybrid.learning import learn_basis
from tf_twice.hybrid.learning import partition_variables
from tf_twice.hybrid.stages import STAGES
from tf_twice.hybrid.stages import staged_updates
from tf_twice.hybrid.learning import split_group_ranks
