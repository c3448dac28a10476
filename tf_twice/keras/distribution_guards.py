"""Guards for tf.distribute: each example summed once, noise added once.

Under a strategy a logical batch is split over the replicas, whose clipped
masked sums are added, with the noise on one replica only
(``PrivateAggregator.finish``). Two user settings would break that without
an error: a multi-worker dataset that every worker reads whole, or with
different seeds (`check_sharding`), and Keras 3 optimizer clipping that acts
on one replica's noise-free share before the sum
(`check_update_is_post_processing`). Both raise ValueError naming the
setting and the fix. Part of `tf_twice.keras.guards`, which re-exports them.
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf

from tf_twice import _keras
from tf_twice import sampling

__all__ = ['check_sharding', 'check_update_is_post_processing']


def check_sharding(strategy: tf.distribute.Strategy, x: Any) -> None:
    """Refuses input that every worker of a multi-worker strategy reads whole.

    Each logical batch must be split over all replicas of all workers, so
    that every example is clipped and summed once. With auto-sharding OFF
    each worker processes every row itself and each example is counted once
    per worker: W times the sensitivity the accountant assumes.
    """
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return
    if isinstance(x, tf.data.Dataset) and (
            x.options().experimental_distribute.auto_shard_policy
            == tf.data.experimental.AutoShardPolicy.OFF):
        raise ValueError(
            'x has auto_shard_policy OFF under MultiWorkerMirroredStrategy: '
            'every worker would process every example of a logical batch, '
            'counting each example once per worker. Keep the default policy '
            '(AUTO, which splits each logical batch over all replicas), and '
            'give every worker the same dataset (poisson_batches with the '
            'same seed).')
    info = sampling.get_poisson_sampling_info(x)
    if info is not None and not _same_on_every_replica(
            strategy, (info.seed, info.start_step)):
        # Each worker would take its share of a DIFFERENT logical batch: the
        # union is no Poisson sample and an example may be summed twice.
        raise ValueError(
            'The workers\' poisson_batches have different seeds (or '
            'start_step): each worker would take its slice of a different '
            'logical batch, so an example could be summed more than once in '
            'a step. Build the dataset on every worker with the same SECRET '
            'seed (e.g. drawn once with secrets.randbits(63) and sent to the '
            'workers over a private channel).')


def _same_on_every_replica(strategy: tf.distribute.Strategy,
                           values: Sequence[int]) -> bool:
    """Whether the integers ``values`` are equal on every replica."""
    # 16-bit words are exact in float32.
    words = tf.constant([[(int(v) >> shift) & 0xFFFF for v in values
                          for shift in (0, 16, 32, 48)]], tf.float32)

    @tf.function
    def gather():
        return strategy.run(lambda: tf.distribute.get_replica_context()
                            .all_gather(words, axis=0))

    gathered = strategy.experimental_local_results(gather())[0].numpy()
    return bool((gathered == gathered[:1]).all())


def check_update_is_post_processing(model: Any) -> None:
    """Refuses optimizer clipping that would act on one replica's share.

    Under a strategy with R > 1 replicas each replica holds its share of
    the update (only replica 0 holds the noise) and the optimizer's
    cross-replica SUM is the released noisy update. Keras 3 applies
    ``clipnorm``, ``clipvalue`` and ``global_clipnorm`` to every replica's
    share BEFORE that sum (Keras 2 after it), so the update applied would
    contain the clipped noise-free sums of the other replicas' examples: a
    function of private data that is not post-processing of the noisy
    update, which no accountant covers (and not the single-device update).

    Raises:
      ValueError: naming the setting and the fix.
    """
    if not _keras.IS_KERAS_3:
        return
    strategy = getattr(model, 'distribute_strategy', None)
    if strategy is None or strategy.num_replicas_in_sync <= 1:
        return
    optimizer = getattr(model, 'optimizer', None)
    # A LossScaleOptimizer clips with its inner optimizer.
    for opt in (optimizer, getattr(optimizer, 'inner_optimizer', None)):
        for name in ('clipnorm', 'clipvalue', 'global_clipnorm'):
            if getattr(opt, name, None) is not None:
                raise ValueError(
                    f'{type(opt).__name__}({name}={getattr(opt, name)!r}) '
                    f'under {type(strategy).__name__} with '
                    f'{strategy.num_replicas_in_sync} replicas: Keras 3 clips '
                    'each replica\'s share of the update before summing the '
                    'replicas, so the applied update would hold clipped '
                    'noise-free sums of private examples, which the privacy '
                    'ledger does not account. Remove the optimizer\'s '
                    'clipping (DP clipping is per example, in the config), '
                    'or train on one replica.')
