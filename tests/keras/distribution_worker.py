"""Runs DP steps under tf.distribute strategies; prints JSON.

A separate process, used by ``distribution_test``:

* ``python -m tests.keras.distribution_worker 0,1`` (or ``4``):
  MirroredStrategy on R logical CPUs (0: no strategy). Logical devices must
  be configured before TensorFlow initialises its devices, which the test
  process has already done.
* ``python -m tests.keras.distribution_worker multi_worker INDEX PORT0 PORT1``:
  worker INDEX of a two-worker MultiWorkerMirroredStrategy on loopback.
"""

import contextlib
import json
import os
import sys
import tempfile

import numpy as np
import tensorflow as tf

MAX_REPLICAS = 4
_MULTI_WORKER = sys.argv[1:2] == ['multi_worker']
if not _MULTI_WORKER:
    _CPU = tf.config.list_physical_devices('CPU')[0]
    tf.config.set_logical_device_configuration(
        _CPU, [tf.config.LogicalDeviceConfiguration()] * MAX_REPLICAS)

# pylint: disable=wrong-import-position
from tests import hybrid_setup  # noqa: E402
from tests import markers  # noqa: E402
from tests import tiny_models  # noqa: E402
from tf_twice import models  # noqa: E402
from tf_twice import optimizers  # noqa: E402
from tf_twice import sampling  # noqa: E402
from tf_twice.config import TwiceSamplingConfig  # noqa: E402
from tf_twice.keras import BasisRefresh, DPModel, PrivacyLedger  # noqa: E402
from tf_twice.mechanism import aggregator as aggregator_lib  # noqa: E402

NUM_EXAMPLES = 24
# Checks of the aggregator both paths share (empty replica shares, extreme
# records) run on the model's path only: the optimizer path differs in how
# the update is applied, which the other tasks check on both
# (distribution_test's MODEL_PATH_ONLY).
MODEL_PATH_ONLY = ('noiseless_conv', 'noiseless_one_row')
# The optimizer path needs the tf_privacy-based DP optimizer classes.
PATHS = ('model', 'optimizer') if (
    markers.KERAS_MAJOR == 2 and markers.HAS_TF_PRIVACY) else ('model',)
# Keras 3's fit fails under MultiWorkerMirroredStrategy for every model (it
# reduces the scalar logs of a step over axis 0): there the workers only
# check the refusals, which come before Keras trains.
MULTI_WORKER_FIT = markers.KERAS_MAJOR == 2


def _config(noise_multiplier):
    """Masked and clipped; noise 0 is a non-private baseline."""
    return TwiceSamplingConfig.single(
        num_examples=NUM_EXAMPLES, expected_batch_size=6.0, l2_norm_clip=0.6,
        linf_norm_clip=0.15, coordinate_sampling_rate=0.5,
        noise_multiplier=noise_multiplier,
        non_private=noise_multiplier == 0)


_STRATEGIES = {}


def _strategy(replicas):
    """MirroredStrategy over ``replicas`` logical CPUs; 0: no strategy."""
    if replicas == 0:
        return tf.distribute.get_strategy()
    # One strategy per process: the collective keys of separate
    # MirroredStrategy instances collide.
    if replicas not in _STRATEGIES:
        _STRATEGIES[replicas] = tf.distribute.MirroredStrategy(
            [f'/cpu:{i}' for i in range(replicas)])
    return _STRATEGIES[replicas]


def _build(path, noise_multiplier, inner_fn, physical_batch_size=3):
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    config = _config(noise_multiplier)
    if path == 'model':
        dp = DPModel(inner_fn(), config,
                     physical_batch_size=physical_batch_size, seed=17)
        dp.compile(optimizer=tf.keras.optimizers.SGD(1.0), loss=loss)
    else:
        dp = DPModel(inner_fn(), physical_batch_size=physical_batch_size)
        dp.compile(optimizer=optimizers.TwiceSamplingDPKerasSGDOptimizer(
            config, learning_rate=1.0, seed=17), loss=loss)
    return dp


def noiseless_update(replicas, path, strategy=None):
    """The update of one logical batch of 11 rows, noise 0, q2 = 0.5."""
    x, y = tiny_models.data(11, seed=3)
    with (strategy or _strategy(replicas)).scope():
        dp = _build(path, 0.0, tiny_models.mlp)
        before = [w.numpy() for w in dp.trainable_variables]
        dp.fit(tf.data.Dataset.from_tensors((x, y)), epochs=1, verbose=0)
        return np.concatenate([(w.numpy() - b).ravel() for w, b in
                               zip(dp.trainable_variables, before)]).tolist()


def noiseless_mixed_float16_update(replicas, path):
    """``noiseless_update`` under 'mixed_float16': float16 per-example
    arithmetic, float32 variables (which several replicas may share)."""
    with tiny_models.dtype_policy('mixed_float16'):
        return noiseless_update(replicas, path)


def noiseless_float16_update(replicas, path):
    """``noiseless_update`` under the 'float16' policy: float16 variables,
    to which only replica 0's update, the whole sum's, is rounded."""
    with tiny_models.dtype_policy('float16'):
        return noiseless_update(replicas, path)


@contextlib.contextmanager
def _largest_update_per_replica():
    """Records, while active, the largest |update| each replica's
    ``PrivateAggregator.finish`` returns (key: replica id; the last step's)."""
    seen = {}
    finish = aggregator_lib.PrivateAggregator.finish

    def spy(self, sums, key, variables):
        update = finish(self, sums, key, variables)
        context = tf.distribute.get_replica_context()
        rid = (tf.constant(0) if context is None
               else context.replica_id_in_sync_group)
        largest = tf.reduce_max(tf.stack(
            [tf.reduce_max(tf.abs(tf.cast(u, tf.float64))) for u in update]))

        def record(r, m):
            seen[int(r)] = float(m)
            return np.int64(0)
        done = tf.numpy_function(record, [rid, largest], tf.int64)
        with tf.control_dependencies([done]):
            return [tf.identity(u) for u in update]

    aggregator_lib.PrivateAggregator.finish = spy
    try:
        yield seen
    finally:
        aggregator_lib.PrivateAggregator.finish = finish


def noiseless_one_row_update(replicas, path):
    """``noiseless_update`` of a one-row logical batch: every replica but
    the first holds an empty share."""
    x, y = tiny_models.data(11, seed=3)
    with _strategy(replicas).scope():
        dp = _build(path, 0.0, tiny_models.mlp)
        before = [w.numpy() for w in dp.trainable_variables]
        dp.fit(tf.data.Dataset.from_tensors((x[:1], y[:1])), epochs=1,
               verbose=0)
        return np.concatenate([(w.numpy() - b).ravel() for w, b in
                               zip(dp.trainable_variables, before)]).tolist()


def _conv_model():
    """The reference CNN's layers at 8x8x1 (conv kernels through the grouped
    convolution where the CPU takes it, dense kernels as outer products)."""
    tf.keras.utils.set_random_seed(0)
    return models.small_cnn((8, 8, 1), num_classes=tiny_models.NUM_CLASSES,
                            padding='same')


def noiseless_conv_update(replicas, path):
    """`noiseless_update` of a conv model whose batch holds an example of
    NaN pixels and one of 1e38 pixels (non-finite gradients, which every
    replica must drop from its own share alone)."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((11, 8, 8, 1)).astype(np.float32)
    x[2] = np.nan
    x[7] = 1e38
    y = rng.integers(0, tiny_models.NUM_CLASSES, 11)
    with _strategy(replicas).scope():
        dp = _build(path, 0.0, _conv_model)
        before = [w.numpy() for w in dp.trainable_variables]
        dp.fit(tf.data.Dataset.from_tensors((x, y)), epochs=1, verbose=0)
        return np.concatenate([(w.numpy() - b).ravel() for w, b in
                               zip(dp.trainable_variables, before)]).tolist()


def _reloads(dp, build):
    """``dp``'s weights (its step count and ledger record included), saved
    to ``.weights.h5`` and ``.keras`` and loaded into a new model from
    ``build`` under the same strategy: per file, True if every weight came
    back, else the error."""
    result = {}
    for name in ('model.weights.h5', 'model.keras'):
        saved = os.path.join(tempfile.mkdtemp(), name)
        if name.endswith('.keras'):
            dp.save(saved)
        else:
            dp.save_weights(saved)
        restored = build()
        restored(np.zeros((0, tiny_models.NUM_FEATURES), np.float32))
        try:  # Built above, so that the file loads into it.
            restored.load_weights(saved)
        except Exception as error:  # pylint: disable=broad-except
            result[name] = f'{type(error).__name__}: {error}'[:500]
            continue
        result[name] = all(np.array_equal(a, b) for a, b in
                           zip(restored.get_weights(), dp.get_weights()))
    return result


def basis_refresh_update(replicas):
    """Two noiseless steps of a hybrid model whose basis a `BasisRefresh`
    re-learns from public data before each step (the refresh, a callback
    of fit, runs in the strategy's cross-replica context): the update and
    the last basis's matrices."""
    x, y = tiny_models.data(11, seed=3)
    with _strategy(replicas).scope():
        dp = DPModel(hybrid_setup.mlp(),
                     hybrid_setup.params(noise_multiplier=(0.0, 0.0, 0.0)),
                     basis=hybrid_setup.basis(), physical_batch_size=3,
                     seed=17)
        dp.compile(optimizer=tf.keras.optimizers.SGD(1.0),
                   loss=hybrid_setup.loss())
        refresh = BasisRefresh(
            dp.inner_model, hybrid_setup.data(32, seed=1),
            hybrid_setup.loss(), every_steps=1, on_refresh=dp.set_basis,
            ranks=hybrid_setup.RANKS, groups=hybrid_setup.GROUPS)
        before = [w.numpy() for w in dp.trainable_variables]
        dp.fit(tf.data.Dataset.from_tensors((x, y)).repeat(2), epochs=1,
               verbose=0, callbacks=[refresh])
        return {
            'refreshes': refresh.refresh_count,
            'update': np.concatenate([
                (w.numpy() - b).ravel()
                for w, b in zip(dp.trainable_variables, before)]).tolist(),
            'basis': np.concatenate([
                m.numpy().ravel()
                for m in refresh.basis.group_matrices]).tolist()}


def noise_std_and_ledger(replicas, path):
    """Update std of zero-gradient steps (pure noise), ledger steps, the
    largest |update| each replica returned (``per_replica``: replica 0 the
    noisy update, every other replica exactly zeros) and the weights'
    reload under the strategy (``reloads``, see ``_reloads``)."""
    z = 2.0
    num_examples, steps = NUM_EXAMPLES, 3

    def zero_model():
        return tf.keras.Sequential([tf.keras.layers.Dense(
            400, input_shape=(tiny_models.NUM_FEATURES,),
            kernel_initializer='zeros', bias_initializer='zeros')])

    x = np.zeros((num_examples, tiny_models.NUM_FEATURES), np.float32)
    y = np.zeros((num_examples,), np.int64)

    def build():
        return _build(path, z, zero_model, physical_batch_size=2)

    with _strategy(replicas).scope():
        dp = build()
        ledger = PrivacyLedger.for_model(dp, delta=1e-5, verbose=0)
        data = sampling.poisson_batches(
            x, y, physical_batch_size=2, expected_batch_size=6.0,
            steps=steps, seed=5)
        with _largest_update_per_replica() as per_replica:
            dp.fit(data, epochs=1, callbacks=[ledger], verbose=0)
        # Zero inputs: the kernel's gradient is 0, so each step adds only
        # lr * z * c2 / (B_exp q2) * N(0, 1) to every kernel entry.
        values = dp.trainable_variables[0].numpy().ravel()
        reloads = _reloads(dp, build)
    return {'std': float(values.std()), 'steps': ledger.steps,
            'iterations': int(dp.optimizer.iterations.numpy()),
            'expected_std': float(np.sqrt(steps) * z * 0.6 / (6.0 * 0.5)),
            'num_values': int(values.size),
            'per_replica': [per_replica[r] for r in sorted(per_replica)],
            'reloads': reloads}


# Optimizer clipping, which Keras 3 applies to each replica's update before
# the sum: it must see the noisy update (replica 0) and zeros.
CLIPPING = ({}, {'clipnorm': 0.01}, {'global_clipnorm': 0.01})


def _ledgered_linear(replicas, clipping):
    with _strategy(replicas).scope():
        dp = DPModel(tiny_models.linear(), _config(1.0),
                     physical_batch_size=2)
        dp.compile(optimizer=tf.keras.optimizers.SGD(1.0, **clipping),
                   loss=tf.keras.losses.SparseCategoricalCrossentropy(
                       from_logits=True))
    return dp, PrivacyLedger.for_model(dp, delta=1e-5, verbose=0)


def optimizer_clipping_updates(replicas):
    """For each of `CLIPPING`, the update of one ledgered noisy step on a
    fixed key, or the refusal."""
    x, y = tiny_models.data(NUM_EXAMPLES, seed=3)
    results = []
    for clipping in CLIPPING:
        dp, ledger = _ledgered_linear(replicas, clipping)
        tiny_models.fix_next_step_key(dp)
        before = [v.numpy() for v in dp.trainable_variables]
        try:
            dp.fit(sampling.poisson_batches(
                x, y, physical_batch_size=2, expected_batch_size=6.0,
                steps=1, seed=7), callbacks=[ledger], verbose=0)
        except ValueError as error:
            results.append({'refused': str(error)})
            continue
        results.append({'update': np.concatenate(
            [(v.numpy() - b).ravel()
             for v, b in zip(dp.trainable_variables, before)]).tolist()})
    return results


def distributed_dataset_refusal(replicas):
    """The refusal of a dataset the caller distributed itself (each replica
    would get a batch of its own, not a share of one logical batch), and
    the steps that ran."""
    x, y = tiny_models.data(NUM_EXAMPLES, seed=3)
    dp, ledger = _ledgered_linear(replicas, {})
    data = _strategy(replicas).experimental_distribute_dataset(
        sampling.poisson_batches(x, y, physical_batch_size=2,
                                 expected_batch_size=6.0, steps=1, seed=7))
    try:
        dp.fit(data, callbacks=[ledger], verbose=0)
        message = 'trained'
    except ValueError as error:
        message = str(error)
    return {'message': message,
            'iterations': int(dp.optimizer.iterations.numpy())}


def multi_worker(index, ports):
    """Both paths' noiseless update on this worker, and the refusal of
    datasets that every worker reads whole (each example counted twice)."""
    os.environ['TF_CONFIG'] = json.dumps({
        'cluster': {'worker': [f'localhost:{p}' for p in ports]},
        'task': {'type': 'worker', 'index': index}})
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    result = {path: noiseless_update(None, path, strategy)
              for path in (PATHS if MULTI_WORKER_FIT else ())}
    x, y = tiny_models.data(11, seed=3)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.OFF)
    with strategy.scope():
        dp = _build('model', 0.0, tiny_models.mlp)
    try:
        dp.fit(tf.data.Dataset.from_tensors((x, y)).with_options(options),
               verbose=0)
        result['unsharded'] = 'trained'
    except ValueError as error:
        result['unsharded'] = str(error)
    # Poisson batches must be the same logical batches on every worker.
    n = len(x)
    own_seed = sampling.poisson_batches(x, y, physical_batch_size=3,
                                        expected_batch_size=6.0, steps=2)
    try:
        dp.fit(own_seed, verbose=0)
        result['own_seeds'] = 'trained'
    except ValueError as error:
        result['own_seeds'] = str(error)
    if MULTI_WORKER_FIT:
        shared = sampling.poisson_batches(x, y, physical_batch_size=3,
                                          expected_batch_size=6.0, steps=2,
                                          seed=n)
        dp.fit(shared, verbose=0)
        result['shared_seed_steps'] = int(dp.optimizer.iterations.numpy())
    return result


def main():
    if _MULTI_WORKER:
        index, ports = int(sys.argv[2]), sys.argv[3:5]
        print('RESULT ' + json.dumps(multi_worker(index, ports)))
        return
    # At most one MirroredStrategy per process (plus 0, no strategy):
    # collective groups of strategies of different sizes clash.
    result = {
        replicas: {
            task: {path: fn(int(replicas), path) for path in PATHS
                   if path == 'model' or task not in MODEL_PATH_ONLY}
            for task, fn in (('noiseless', noiseless_update),
                             ('noiseless_mixed_float16',
                              noiseless_mixed_float16_update),
                             ('noiseless_conv', noiseless_conv_update),
                             ('noiseless_float16', noiseless_float16_update),
                             ('noiseless_one_row', noiseless_one_row_update),
                             ('noise', noise_std_and_ledger))}
        for replicas in sys.argv[1].split(',')}
    for replicas in sys.argv[1].split(','):
        result[replicas]['basis_refresh'] = basis_refresh_update(
            int(replicas))
        result[replicas]['clipping'] = optimizer_clipping_updates(
            int(replicas))
        if int(replicas) > 1:
            result[replicas]['distributed_dataset'] = (
                distributed_dataset_refusal(int(replicas)))
    print('RESULT ' + json.dumps(result))


if __name__ == '__main__':
    main()
