"""Guards for tf.distribute: each example summed once.

Under a strategy a logical batch is split over the replicas, whose clipped
masked sums are added before the noise; only replica 0 returns the noisy
update, the others zeros (``PrivateAggregator.finish``), so what the
optimizer does per replica (Keras 3 clips each replica's update before the
sum) acts on the noisy update or on zeros: post-processing. One user
setting would break the sum without an error: a multi-worker dataset that
every worker reads whole, or with different seeds (`check_sharding`). It
raises ValueError naming the setting and the fix. Part of
`tf_twice.keras.guards`, which re-exports it.
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf

from tf_twice import sampling

__all__ = ['check_sharding']


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
