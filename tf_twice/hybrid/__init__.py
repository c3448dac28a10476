"""Hybrid clipping set-up from PUBLIC data: per-block budgets and noise.

``budgets.plan_blocks`` turns a one-block ``TwiceSamplingConfig`` and a
``HybridBasis`` into the per-block config that DPModel runs (clips from public
projection norms, l-infinity clips, per-block noise optimised for a budget).
The basis itself is learned by ``tf_twice.mechanism.basis.learn_basis``; the
training step that uses both is ``tf_twice.mechanism.hybrid``.
"""

from tf_twice.hybrid.budgets import hybrid_noise_multipliers
from tf_twice.hybrid.budgets import linf_clips_from_d0
from tf_twice.hybrid.budgets import plan_blocks
from tf_twice.hybrid.budgets import public_block_norms
from tf_twice.hybrid.budgets import split_l2_budget
