"""Distribution checks of ``privacy_audit_test``, in a process of its own.

``python -m tests.keras.privacy_audit_worker`` sets up two logical CPUs
(before TensorFlow initialises its devices, which the test process has
already done) and prints ``RESULT {json}``:

* ``clipping``: for each optimizer clipping setting, the single-device
  update of a ledgered ``fit`` and the largest difference between it and
  the two-replica update (MirroredStrategy) of the same logical batch and
  key, or the error of a refused run;
* ``distributed_dataset``: the refusal of a dataset the caller distributed
  itself (each replica would get a batch of its own, not a share of one
  Poisson logical batch).
"""

import json

import numpy as np
import tensorflow as tf

_CPU = tf.config.list_physical_devices('CPU')[0]
tf.config.set_logical_device_configuration(
    _CPU, [tf.config.LogicalDeviceConfiguration()] * 2)

# pylint: disable=wrong-import-position
from tests import tiny_models  # noqa: E402
from tf_twice import sampling  # noqa: E402
from tf_twice.config import TwiceSamplingConfig  # noqa: E402
from tf_twice.keras import DPModel, PrivacyLedger  # noqa: E402

NUM_EXAMPLES = 24
CLIPPING = [{}, {'clipnorm': 0.01}, {'global_clipnorm': 0.01}]
_MIRRORED = tf.distribute.MirroredStrategy(['/cpu:0', '/cpu:1'])


def _config():
    return TwiceSamplingConfig.single(
        num_examples=NUM_EXAMPLES, expected_batch_size=6.0, l2_norm_clip=0.6,
        linf_norm_clip=0.15, coordinate_sampling_rate=0.5,
        noise_multiplier=1.0)


def _model(strategy, clipping):
    with strategy.scope():
        dp = DPModel(tiny_models.linear(), _config(), physical_batch_size=2)
        dp.compile(optimizer=tf.keras.optimizers.SGD(1.0, **clipping),
                   loss=tf.keras.losses.SparseCategoricalCrossentropy(
                       from_logits=True))
    return dp


def _update(strategy, clipping):
    """The update of one ledgered step on a fixed key, or the refusal."""
    x, y = tiny_models.data(NUM_EXAMPLES, seed=3)
    dp = _model(strategy, clipping)
    tiny_models.fix_next_step_key(dp)
    ledger = PrivacyLedger.for_model(dp, delta=1e-5, verbose=0)
    data = sampling.poisson_batches(x, y, physical_batch_size=2,
                                    expected_batch_size=6.0, steps=1, seed=7)
    before = [v.numpy() for v in dp.trainable_variables]
    try:
        dp.fit(data, callbacks=[ledger], verbose=0)
    except ValueError as error:
        return {'refused': str(error),
                'iterations': int(dp.optimizer.iterations.numpy())}
    return {'update': np.concatenate(
        [(v.numpy() - b).ravel()
         for v, b in zip(dp.trainable_variables, before)]).tolist()}


def main():
    result = {'clipping': []}
    for clipping in CLIPPING:
        single = _update(tf.distribute.get_strategy(), clipping)
        two = _update(_MIRRORED, clipping)
        entry = {'clipping': clipping, 'two_replicas': two,
                 'single_update': single['update']}
        if 'update' in two:
            entry['max_difference'] = float(np.max(np.abs(
                np.subtract(two['update'], single['update']))))
        result['clipping'].append(entry)
    x, y = tiny_models.data(NUM_EXAMPLES, seed=3)
    dp = _model(_MIRRORED, {})
    ledger = PrivacyLedger.for_model(dp, delta=1e-5, verbose=0)
    data = _MIRRORED.experimental_distribute_dataset(sampling.poisson_batches(
        x, y, physical_batch_size=2, expected_batch_size=6.0, steps=1,
        seed=7))
    try:
        dp.fit(data, callbacks=[ledger], verbose=0)
        result['distributed_dataset'] = 'trained'
    except ValueError as error:
        result['distributed_dataset'] = str(error)
    result['distributed_dataset_iterations'] = int(
        dp.optimizer.iterations.numpy())
    print('RESULT ' + json.dumps(result))


if __name__ == '__main__':
    main()
