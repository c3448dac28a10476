"""A mechanism's update after each of its stages: clip, masks, noise.

A DP-SGD mechanism can lose progress at three places: its clipping (a biased
mean), its coordinate masks (variance, no bias: the masked sum is divided by
its expected keep rate) and its DP noise. ``staged_updates`` runs the
library's own step (``mechanism.hybrid.block_sums`` then ``noisy_update``)
on one batch three times with one key, each time with one more stage on:

* ``'clip'``: the config's clips, every block unmasked, no noise: the
  clipped sum divided by the expected batch size;
* ``'masks'``: the config's masks too (the key's), no noise;
* ``'noise'``: the config's whole mechanism, the key's masks and noise.

With one key the stages are nested: ``'noise'`` minus ``'masks'`` is the
noise alone. A stage that shrinks the one-step progress of the update (e.g.
the loss decrease of one SGD step, ``examples/stage_probe.py``) is where the
mechanism loses; masks on the principal coefficients of hybrid clipping were
found that way (docs/hybrid_clipping.md).

The first two stages are not private (no noise): they are measurements, for
diagnosis, and nothing they return may be released.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import attr
import tensorflow as tf

from tf_twice import config as config_lib
from tf_twice.mechanism import basis as basis_lib
from tf_twice.mechanism import hybrid as hybrid_mechanism

__all__ = ['STAGES', 'stage_config', 'staged_updates']

STAGES = ('clip', 'masks', 'noise')


def stage_config(config: config_lib.TwiceSamplingConfig, stage: str
                 ) -> config_lib.TwiceSamplingConfig:
    """``config`` with the stages after ``stage`` off (see the module)."""
    if stage not in STAGES:
        raise ValueError(f'stage must be one of {STAGES}; got {stage!r}.')
    if stage == 'noise':
        return config
    rates = (config.coordinate_sampling_rates if stage == 'masks'
             else (1.0,) * config.num_blocks)
    return attr.evolve(
        config, non_private=True, coordinate_sampling_rate=1.0,
        blocks=tuple(attr.evolve(b, noise_multiplier=0.0,
                                 coordinate_sampling_rate=q2)
                     for b, q2 in zip(config.blocks, rates)))


def staged_updates(per_example_grads: Sequence[tf.Tensor],
                   config: config_lib.TwiceSamplingConfig,
                   *,
                   key: tf.Tensor,
                   basis: Optional[basis_lib.HybridBasis] = None,
                   block_scales: Optional[Sequence[float]] = None,
                   stages: Sequence[str] = STAGES
                   ) -> Dict[str, List[tf.Tensor]]:
    """The update of one batch after each stage, one key for all.

    Args:
      per_example_grads: one tensor [B, *var_shape] per trainable variable:
        the examples of one Poisson batch (the config's expected batch size
        divides every stage's sum).
      config: the mechanism (calibrated: the noise stage adds its noise).
      key: a step key (``tf_twice.mechanism.draw_step_key``); the masks and
        the noise are the key's, the same in every stage.
      basis, block_scales: hybrid clipping's basis and block scales
        (``mechanism.hybrid.block_sums``), or None.
      stages: the stages to run, a subset of ``STAGES``.

    Returns:
      {stage: the update, one float64 tensor per variable}.
    """
    scales = (None if block_scales is None
              else tf.constant(block_scales, tf.float64))
    updates = {}
    for stage in stages:
        staged = stage_config(config, stage)
        sums = hybrid_mechanism.block_sums(
            per_example_grads, staged, basis=basis, block_scales=scales,
            key=key)
        sums = [[tf.cast(t, tf.float64) for t in block] for block in sums]
        updates[stage] = hybrid_mechanism.noisy_update(
            sums, staged, basis=basis, block_scales=scales, key=key)
    return updates
