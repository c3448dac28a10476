"""Tests of the guard rails (tf_twice.keras.guards)."""

import re
import warnings

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

from tests import markers
from tf_twice import optimizers
from tf_twice import sampling
from tf_twice.accounting import TwiceSampledGaussianDpEvent
from tf_twice.config import Block, TwiceSamplingConfig
from tf_twice.keras import DPModel, PrivacyLedger
from tf_twice.keras import guards
from tf_twice.hybrid import learning


def _dense(name='plain'):
    return tf.keras.Sequential([
        tf.keras.layers.Dense(4, input_shape=(3,)),
        tf.keras.layers.LayerNormalization(),
        tf.keras.layers.Dense(2),
    ], name=name)


def test_no_batch_norm_passes_group_and_layer_norm():
    inputs = tf.keras.Input([4, 4, 4])
    h = tf.keras.layers.GroupNormalization(groups=2)(inputs)
    h = tf.keras.layers.LayerNormalization()(h)
    model = tf.keras.Model(inputs, tf.keras.layers.Flatten()(h))
    guards.check_no_example_mixing(model)
    guards.check_no_example_mixing(_dense())


def test_batch_norm_top_level_fails():
    model = tf.keras.Sequential([
        tf.keras.layers.Dense(4, input_shape=(3,)),
        tf.keras.layers.BatchNormalization(name='bn'),
    ])
    with pytest.raises(ValueError, match=r"bn.*GroupNormalization"):
        guards.check_no_example_mixing(model)


def test_batch_norm_in_nested_models_fails():
    inner = tf.keras.Sequential([
        tf.keras.layers.Dense(4, input_shape=(3,)),
        tf.keras.layers.BatchNormalization(name='deep_bn'),
    ], name='inner')
    middle = tf.keras.Sequential([inner, tf.keras.layers.Dense(2)],
                                 name='middle')
    inputs = tf.keras.Input([3])
    outer = tf.keras.Model(inputs, middle(inputs), name='outer')
    with pytest.raises(ValueError, match='outer/middle/inner/deep_bn'):
        guards.check_no_example_mixing(outer)


def test_batch_norm_in_custom_layer_fails():
    class Block(tf.keras.layers.Layer):

        def __init__(self):
            super().__init__(name='block')
            self.norm = tf.keras.layers.BatchNormalization(
                synchronized=True, name='synced')

        def call(self, x):
            return self.norm(x)

    with pytest.raises(ValueError, match='block/synced.*BatchNormalization'):
        guards.check_no_example_mixing(Block())


def test_a_layer_named_like_batch_norm_fails():
    class SyncBatchNormCopy(tf.keras.layers.Layer):  # Not a subclass.

        def call(self, x):
            return x

    with pytest.raises(ValueError, match='SyncBatchNormCopy'):
        guards.check_no_example_mixing(SyncBatchNormCopy(name='copy'))


def test_custom_layer_declaring_example_mixing_fails():
    class BatchAttention(tf.keras.layers.Layer):
        mixes_examples = True  # Attends across the batch axis.

        def call(self, x):
            return x - tf.reduce_mean(x, axis=0, keepdims=True)

    inputs = tf.keras.Input([3])
    model = tf.keras.Model(inputs, BatchAttention(name='attend')(inputs),
                           name='net')
    with pytest.raises(ValueError, match='net/attend.*mixes_examples'):
        guards.check_no_example_mixing(model)


def test_normalisation_adapted_on_data_fails():
    adapted = tf.keras.layers.Normalization(name='norm')
    adapted.adapt(np.arange(12, dtype=np.float32).reshape(4, 3))
    model = tf.keras.Sequential([adapted, tf.keras.layers.Dense(2)])
    with pytest.raises(ValueError, match='norm.*adapted on data'):
        guards.check_no_example_mixing(model)
    # Constants (e.g. from public data) are fine.
    fixed = tf.keras.Sequential([
        tf.keras.layers.Normalization(mean=[0.0] * 3, variance=[1.0] * 3,
                                      input_shape=(3,)),
        tf.keras.layers.Dense(2)])
    guards.check_no_example_mixing(fixed)


def test_adapted_lookup_and_stateful_layers_fail():
    lookup = tf.keras.layers.IntegerLookup(name='ids')
    lookup.adapt(np.array([7, 123456, 42]))
    with pytest.raises(ValueError, match='ids.*adapted on data'):
        guards.check_no_example_mixing(tf.keras.Sequential([lookup]))
    rnn = tf.keras.Sequential([
        tf.keras.Input(shape=(3, 1), batch_size=4),
        tf.keras.layers.SimpleRNN(2, stateful=True, name='rnn')])
    with pytest.raises(ValueError, match='rnn.*stateful'):
        guards.check_no_example_mixing(rnn)


@pytest.mark.parametrize('make, adapt_on', [
    (lambda: tf.keras.layers.Discretization(num_bins=3, name='bins'),
     np.arange(12, dtype=np.float32)),
    (lambda: tf.keras.layers.StringLookup(name='words'),
     np.array(['a', 'b', 'a'])),
    (lambda: tf.keras.layers.TextVectorization(name='text'),
     np.array(['a b', 'c'])),
])
def test_other_adapted_layers_fail_and_explicit_ones_pass(make, adapt_on):
    adapted = make()
    adapted.adapt(adapt_on)
    with pytest.raises(ValueError, match='adapted on data'):
        guards.check_no_example_mixing(tf.keras.Sequential([adapted]))
    for fixed in (tf.keras.layers.Discretization(bin_boundaries=[0.0, 1.0]),
                  tf.keras.layers.StringLookup(vocabulary=['a', 'b']),
                  tf.keras.layers.TextVectorization(vocabulary=['a', 'b'])):
        guards.check_no_example_mixing(tf.keras.Sequential([fixed]))
    guards.check_no_example_mixing(tf.keras.Sequential([
        tf.keras.layers.SimpleRNN(2, input_shape=(3, 1)),
        tf.keras.layers.IntegerLookup(vocabulary=[1, 2, 3])]))


def test_check_no_example_mixing_rejects_non_models():
    with pytest.raises(ValueError, match='model'):
        guards.check_no_example_mixing('model')


@pytest.mark.parametrize('loss', [
    tf.keras.losses.SparseCategoricalCrossentropy(
        reduction='none'),
    tf.keras.losses.MeanSquaredError(reduction='none'),
    'sparse_categorical_crossentropy',
    'categorical_crossentropy',
    'mse',
    tf.keras.losses.binary_crossentropy,
    lambda y_true, y_pred: tf.reduce_sum(tf.square(y_pred), axis=-1),
    [tf.keras.losses.mae, 'mse'],
    {'out': 'mse'},
])
def test_per_example_losses_pass(loss):
    guards.check_per_example_loss(loss)


@pytest.mark.skipif(markers.KERAS_MAJOR == 2,
                    reason='reduction=None is Keras 3\'s "none"')
def test_keras_3_reduction_none_is_per_example():
    guards.check_per_example_loss(
        tf.keras.losses.SparseCategoricalCrossentropy(reduction=None))


@pytest.mark.parametrize('loss, match', [
    (tf.keras.losses.SparseCategoricalCrossentropy(), 'reduction'),
    (tf.keras.losses.MeanSquaredError(reduction='sum'), 'reduction'),
    ('SparseCategoricalCrossentropy', 'reduction'),
    (lambda y_true, y_pred: tf.reduce_mean(tf.square(y_pred)), 'reduced'),
    (lambda y_true, y_pred: tf.reduce_mean(tf.square(y_pred), axis=0),
     'reduced'),
    (['mse', tf.keras.losses.MeanSquaredError()], r'\[1\].*reduction'),
    (3, 'callable'),
])
def test_batch_losses_fail(loss, match):
    with pytest.raises(ValueError, match=match):
        guards.check_per_example_loss(loss)


def test_custom_loss_class_with_none_reduction_is_probed():
    class Sneaky(tf.keras.losses.Loss):

        def call(self, y_true, y_pred):
            return tf.reduce_mean(y_pred)  # Scalar despite reduction NONE.

    with pytest.raises(ValueError, match='reduced'):
        guards.check_per_example_loss(
            Sneaky(reduction='none'))


def test_loss_probe_with_user_batches():
    def needs_pairs(y_true, y_pred):
        return tf.reduce_sum(y_true * y_pred[:, :2], axis=-1)

    y_true, y_pred = tf.ones([5, 2]), tf.ones([5, 7])
    guards.check_per_example_loss(needs_pairs, y_true=y_true, y_pred=y_pred)
    with pytest.raises(ValueError, match='both y_true and y_pred'):
        guards.check_per_example_loss(needs_pairs, y_true=y_true)

    def unprobeable(y_true, y_pred):
        raise RuntimeError('needs special inputs')

    with pytest.raises(ValueError, match='y_true=.*y_pred='):
        guards.check_per_example_loss(unprobeable)


def _poisson(q1=0.5):
    x = np.zeros([20, 3], np.float32)
    return sampling.poisson_batches(x, np.zeros(20), physical_batch_size=4,
                                    example_sampling_rate=q1, steps=3, seed=0)


def test_poisson_input_passes():
    ds = _poisson()
    info = guards.check_poisson_input(ds, example_sampling_rate=0.5)
    assert info.example_sampling_rate == 0.5
    assert guards.check_poisson_input(ds.prefetch(1).take(2)) == info


@pytest.mark.parametrize('make', [
    lambda: tf.data.Dataset.from_tensor_slices(
        (np.zeros([20, 3]), np.zeros(20))).shuffle(20).batch(5),
    lambda: _poisson().map(lambda x, y, w: (x, y, w)),
    lambda: _poisson().cache(),
    lambda: np.zeros([20, 3]),
])
def test_non_poisson_input_fails_or_warns(make):
    data = make()
    with pytest.raises(ValueError, match='not Poisson sampling'):
        guards.check_poisson_input(data)
    with pytest.warns(guards.NonPoissonInputWarning,
                      match='EPSILON DOES NOT HOLD'):
        assert guards.check_poisson_input(data, strict=False) is None


def test_poisson_rate_mismatch_fails_even_when_not_strict():
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        with pytest.raises(ValueError, match='must be equal'):
            guards.check_poisson_input(_poisson(0.5),
                                       example_sampling_rate=0.25,
                                       strict=False)
    with pytest.raises(ValueError, match='example_sampling_rate'):
        guards.check_poisson_input(_poisson(), example_sampling_rate=2.0)
    with pytest.raises(ValueError, match='strict'):
        guards.check_poisson_input(_poisson(), strict='yes')


# --- the ledger's event against the model's ---------------------------------

N = 1003
CONFIG = TwiceSamplingConfig.single(
    num_examples=N, expected_batch_size=64.0, l2_norm_clip=1.0,
    linf_norm_clip=0.25, noise_multiplier=1.1, coordinate_sampling_rate=0.5)
DELTA = 1e-5


def _event(**changes):
    fields = dict(example_sampling_rate=64 / N, coordinate_sampling_rate=0.5,
                  noise_multiplier=1.1, l2_norm_clip=1.0,
                  linf_norm_clip=0.25)
    fields.update(changes)
    return TwiceSampledGaussianDpEvent(**fields)


def _named(field, value):
    """The refusal shows the ledger's value of the field."""
    return re.escape(f'{field}={value!r}') + '.*for_model'


def test_the_models_own_event_passes():
    model = DPModel(_dense(), CONFIG, physical_batch_size=4)
    assert model.dp_event() == _event() == CONFIG.dp_event()
    guards.check_ledger_event(_event(), model)
    ledger = PrivacyLedger.for_model(model, delta=DELTA)
    assert ledger.event == model.dp_event()
    guards.check_ledger_event(ledger.event, model)


@pytest.mark.parametrize('field, value', [
    ('noise_multiplier', 1.2),
    ('noise_multiplier', 1.1 * (1 + 1e-6)),
    ('l2_norm_clip', 0.5),
    ('linf_norm_clip', 0.1),  # Understates the sensitivity.
    ('linf_norm_clip', None),
    ('coordinate_sampling_rate', 0.25),
    ('example_sampling_rate', 65 / N),
    ('block_dimensions', 33),
])
def test_an_event_differing_in_any_field_is_refused(field, value):
    model = DPModel(_dense(), CONFIG, physical_batch_size=4)
    with pytest.raises(ValueError, match=_named(field, value)):
        guards.check_ledger_event(_event(**{field: value}), model)


@pytest.mark.parametrize('event', [
    # Descriptions that bound the same step are refused too: only the
    # model's own event is accounted (build it with for_model).
    _event(noise_multiplier=(1.1,), l2_norm_clip=(1.0,),
           linf_norm_clip=(0.25,)),
    _event(block_dimensions=34),  # d of _dense(), but not the model's event.
    dp_accounting.PoissonSampledDpEvent(64 / N,
                                        dp_accounting.GaussianDpEvent(1.1)),
])
def test_only_the_models_own_event_passes(event):
    model = DPModel(_dense(), CONFIG, physical_batch_size=4)
    with pytest.raises(ValueError, match='for_model'):
        guards.check_ledger_event(event, model)


def test_for_model_builds_exactly_the_models_event():
    model = DPModel(_dense(), CONFIG, physical_batch_size=4)
    assert PrivacyLedger.for_model(model, delta=DELTA).event == _event()
    silent = DPModel(_dense(), TwiceSamplingConfig.single(
        num_examples=N, expected_batch_size=64.0, noise_multiplier=0.0,
        non_private=True), physical_batch_size=4)
    with pytest.raises(ValueError, match='non_private'):
        PrivacyLedger.for_model(silent, delta=DELTA)
    with pytest.raises(ValueError, match='non_private'):
        guards.check_ledger_event(_event(), silent)
    # n is validated once, by the config the event is derived from.
    for bad in (63, 0, 64.0, True, None):
        with pytest.raises(ValueError, match='num_examples'):
            TwiceSamplingConfig.single(num_examples=bad,
                                       expected_batch_size=64.0,
                                       noise_multiplier=1.1)


def _compiled():
    """A DPModel without a config, compiled with a tf_twice DP optimizer."""
    model = DPModel(_dense(), physical_batch_size=4)
    optimizer = optimizers.TwiceSamplingDPKerasSGDOptimizer(
        CONFIG, learning_rate=0.1)
    model.compile(optimizer=optimizer, loss=tf.keras.losses.MeanSquaredError())
    return model


@markers.needs_tf_privacy_optimizers
def test_optimizer_model_has_the_optimizers_event():
    model = _compiled()
    assert model.config == CONFIG and model.dp_event() == _event()
    guards.check_ledger_event(_event(), model)
    assert PrivacyLedger.for_model(model, delta=DELTA).event == _event()
    with pytest.raises(ValueError, match=_named('noise_multiplier', 9.0)):
        guards.check_ledger_event(_event(noise_multiplier=9.0), model)


def test_plain_models_and_dp_models_without_a_mechanism():
    # A plain Keras model's steps are counted as the given event.
    plain = _dense()
    guards.check_ledger_event(_event(noise_multiplier=9.0), plain)
    plain.compile(optimizer='sgd', loss='mse')
    guards.check_ledger_event(_event(noise_multiplier=9.0), plain)
    # A DPModel with no mechanism yet has no event to account.
    with pytest.raises(ValueError, match='no DP mechanism yet'):
        guards.check_ledger_event(_event(), DPModel(_dense()))


@markers.needs_tf_privacy_optimizers
def test_plain_model_with_dp_optimizer_is_refused():
    model = _dense()
    model.compile(optimizer=optimizers.TwiceSamplingDPKerasSGDOptimizer(
        CONFIG, learning_rate=0.1), loss='mse')
    with pytest.raises(ValueError, match=r'not isolated.*DPModel\(model\)'):
        guards.check_ledger_event(_event(), model)


# --- several blocks (hybrid clipping) ---------------------------------------

BLOCKS = TwiceSamplingConfig(
    num_examples=N, expected_batch_size=64.0, coordinate_sampling_rate=0.5,
    blocks=(Block(l2_norm_clip=0.8, noise_multiplier=1.2, linf_norm_clip=0.1),
            Block(l2_norm_clip=0.6, noise_multiplier=2.0)))


def _basis():
    """A basis of _dense()'s 34 parameters: a principal block of rank 7."""
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal((16,) + tuple(v.shape)).astype(np.float32)
             for v in _dense().trainable_variables]
    return learning.learn_basis(grads, [7])


def _blocks_event(**changes):
    fields = dict(example_sampling_rate=64 / N, coordinate_sampling_rate=0.5,
                  noise_multiplier=(1.2, 2.0), l2_norm_clip=(0.8, 0.6),
                  linf_norm_clip=(0.1, None), block_dimensions=(7, 34))
    fields.update(changes)
    return TwiceSampledGaussianDpEvent(**fields)


def test_multi_block_event_is_the_models_block_by_block():
    model = DPModel(_dense(), BLOCKS, physical_batch_size=4, basis=_basis())
    assert model.dp_event() == _blocks_event()
    assert model.config.dimensions == (7, 34)
    guards.check_ledger_event(_blocks_event(), model)
    assert PrivacyLedger.for_model(model, delta=DELTA).event == (
        _blocks_event())


@pytest.mark.parametrize('changes', [
    dict(noise_multiplier=(1.2, 2.1)),
    dict(l2_norm_clip=(0.7, 0.6)),
    dict(linf_norm_clip=(0.1, 0.05)),
    dict(linf_norm_clip=None),
    dict(block_dimensions=(6, 34)),
    dict(block_dimensions=None),  # Looser, but not the model's event.
    dict(noise_multiplier=(1.2, 2.0, 1.0), l2_norm_clip=(0.8, 0.6, 1.0),
         linf_norm_clip=None, block_dimensions=None),
    dict(noise_multiplier=1.2, l2_norm_clip=0.8, linf_norm_clip=0.1,
         block_dimensions=None),
])
def test_multi_block_mismatch_is_refused(changes):
    model = DPModel(_dense(), BLOCKS, physical_batch_size=4, basis=_basis())
    field, value = next(iter(changes.items()))
    with pytest.raises(ValueError, match=_named(field, value)):
        guards.check_ledger_event(_blocks_event(**changes), model)
