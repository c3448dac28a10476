"""Tests of the guard rails (tf_twice.keras.guards)."""

import warnings

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

from tf_twice import optimizers
from tf_twice.keras import make_private
from tf_twice import sampling
from tf_twice.accounting import TwiceSampledGaussianDpEvent
from tf_twice.keras import guards
from tf_twice.mechanism import aggregation


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
            self.norm = tf.keras.layers.experimental.SyncBatchNormalization()

        def call(self, x):
            return self.norm(x)

    with pytest.raises(ValueError, match='SyncBatchNormalization'):
        guards.check_no_example_mixing(Block())


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
    rnn = tf.keras.Sequential([tf.keras.layers.SimpleRNN(
        2, stateful=True, name='rnn', batch_input_shape=(4, 3, 1))])
    with pytest.raises(ValueError, match='rnn.*stateful'):
        guards.check_no_example_mixing(rnn)
    guards.check_no_example_mixing(tf.keras.Sequential([
        tf.keras.layers.SimpleRNN(2, input_shape=(3, 1)),
        tf.keras.layers.IntegerLookup(vocabulary=[1, 2, 3])]))


def test_check_no_example_mixing_rejects_non_models():
    with pytest.raises(ValueError, match='model'):
        guards.check_no_example_mixing('model')


@pytest.mark.parametrize('loss', [
    tf.keras.losses.SparseCategoricalCrossentropy(
        reduction=tf.keras.losses.Reduction.NONE),
    tf.keras.losses.MeanSquaredError(reduction='none'),
    'sparse_categorical_crossentropy',
    'categorical_crossentropy',
    'mse',
    tf.keras.losses.binary_crossentropy,
    lambda y_true, y_pred: tf.reduce_sum(tf.square(y_pred), axis=-1),
    [tf.keras.losses.mean_absolute_error, 'mse'],
    {'out': 'mse'},
])
def test_per_example_losses_pass(loss):
    guards.check_per_example_loss(loss)


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
            Sneaky(reduction=tf.keras.losses.Reduction.NONE))


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


# --- the ledger's event against the model's parameters ----------------------

PARAMS = dict(l2_norm_clip=1.0, linf_norm_clip=0.25, noise_multiplier=1.1,
              coordinate_sampling_rate=0.5, expected_batch_size=64.0)
N = 1003  # (64 / 1003) * 1003 != 64 in floats: round-off is forgiven.


def _event(**changes):
    fields = dict(example_sampling_rate=64 / N, coordinate_sampling_rate=0.5,
                  noise_multiplier=1.1, l2_norm_clip=1.0,
                  linf_norm_clip=0.25)
    fields.update(changes)
    return TwiceSampledGaussianDpEvent(**fields)


def test_matching_event_passes():
    guards.check_event_matches(_event(), num_examples=N, **PARAMS)
    guards.check_event_matches(_event(), **PARAMS)  # n unknown: q1 unchecked
    # One-block tuples and an l-infinity clip >= c2 (no effect, as None).
    guards.check_event_matches(
        _event(noise_multiplier=(1.1,), l2_norm_clip=[1.0],
               linf_norm_clip=None),
        **dict(PARAMS, linf_norm_clip=3.0))


@pytest.mark.parametrize('changes, field', [
    (dict(noise_multiplier=1.2), 'noise_multiplier'),
    (dict(noise_multiplier=1.1 * (1 + 1e-6)), 'noise_multiplier'),
    (dict(l2_norm_clip=0.5), 'l2_norm_clip'),
    (dict(linf_norm_clip=0.1), 'linf_norm_clip'),  # Understates sensitivity.
    (dict(linf_norm_clip=None), 'linf_norm_clip'),
    (dict(coordinate_sampling_rate=0.25), 'coordinate_sampling_rate'),
    (dict(example_sampling_rate=65 / N), 'example_sampling_rate'),
])
def test_mismatched_field_is_named(changes, field):
    with pytest.raises(ValueError, match=f'{field}=.*for_model'):
        guards.check_event_matches(_event(**changes), num_examples=N,
                                   **PARAMS)


def test_model_without_linf_clip_refuses_event_with_one():
    with pytest.raises(ValueError, match='linf_norm_clip'):
        guards.check_event_matches(_event(),
                                   **dict(PARAMS, linf_norm_clip=None))


def test_event_kind_blocks_and_dimensions():
    gaussian = dp_accounting.PoissonSampledDpEvent(
        0.1, dp_accounting.GaussianDpEvent(1.1))
    with pytest.raises(ValueError, match='TwiceSampledGaussianDpEvent'):
        guards.check_event_matches(gaussian, **PARAMS)
    two_blocks = _event(noise_multiplier=(1.1, 2.0), l2_norm_clip=(1.0, 1.0),
                        linf_norm_clip=None)
    with pytest.raises(ValueError, match='2 blocks'):
        guards.check_event_matches(two_blocks, **PARAMS)
    sized = _event(block_dimensions=3)
    with pytest.raises(ValueError, match='build the model'):
        guards.check_event_matches(sized, **PARAMS)
    with pytest.raises(ValueError, match='block_dimensions=3'):
        guards.check_event_matches(sized, num_parameters=10, **PARAMS)
    guards.check_event_matches(sized, num_parameters=3, **PARAMS)


def test_dp_event_from_params():
    params = aggregation.AggregationParams(**PARAMS)
    assert guards.dp_event_from_params(params, N) == _event()
    for bad in (63, 0, 64.0, True, None):
        with pytest.raises(ValueError, match='num_examples'):
            guards.dp_event_from_params(params, bad)
    silent = aggregation.AggregationParams(**dict(PARAMS,
                                                  noise_multiplier=0.0))
    with pytest.raises(ValueError, match='noise_multiplier must be > 0'):
        guards.dp_event_from_params(silent, N)
    with pytest.raises(ValueError, match='params'):
        guards.dp_event_from_params(PARAMS, N)


def _compiled():
    """A make_private wrapper compiled with a tf_twice DP optimizer."""
    model = make_private(_dense(), physical_batch_size=4)
    optimizer = optimizers.TwiceSamplingDPKerasSGDOptimizer(
        learning_rate=0.1, **PARAMS)
    model.compile(optimizer=optimizer, loss=tf.keras.losses.MeanSquaredError())
    return model


def test_model_dp_params_of_optimizer_and_plain_models():
    assert guards.model_dp_params(_dense()) is None
    plain = _dense()
    plain.compile(optimizer='sgd', loss='mse')
    assert guards.model_dp_params(plain) is None
    model = _compiled()
    assert guards.model_dp_params(model) == aggregation.AggregationParams(
        **PARAMS)
    assert guards.check_event_matches_model(_event(), model, num_examples=N)
    assert not guards.check_event_matches_model(_event(noise_multiplier=9.0),
                                                plain)
    with pytest.raises(ValueError, match='noise_multiplier=9.0'):
        guards.check_event_matches_model(_event(noise_multiplier=9.0), model)
    # _dense() has 3*4+4 + 4+4 (LayerNorm) + 4*2+2 = 34 trainable numbers.
    guards.check_event_matches_model(_event(block_dimensions=34), model)
    with pytest.raises(ValueError, match='block_dimensions'):
        guards.check_event_matches_model(_event(block_dimensions=33), model)


def test_plain_model_with_dp_optimizer_is_refused():
    model = _dense()
    model.compile(optimizer=optimizers.TwiceSamplingDPKerasSGDOptimizer(
        learning_rate=0.1, **PARAMS), loss='mse')
    with pytest.raises(ValueError, match='not isolated.*make_private'):
        guards.model_dp_params(model)


# --- several blocks (hybrid clipping) ---------------------------------------

BLOCKS = dict(l2_norm_clip=(0.8, 0.6), linf_norm_clip=(0.1, None),
              noise_multiplier=(1.2, 2.0), coordinate_sampling_rate=0.5,
              expected_batch_size=64.0)


def _blocks_event(**changes):
    fields = dict(example_sampling_rate=64 / N, coordinate_sampling_rate=0.5,
                  noise_multiplier=(1.2, 2.0), l2_norm_clip=(0.8, 0.6),
                  linf_norm_clip=(0.1, None), block_dimensions=(7, 34))
    fields.update(changes)
    return TwiceSampledGaussianDpEvent(**fields)


def test_multi_block_event_matches_block_by_block():
    guards.check_event_matches(_blocks_event(), num_examples=N,
                               block_dimensions=(7, 34), **BLOCKS)
    # No dimensions in the event: sound, only looser; accepted.
    guards.check_event_matches(_blocks_event(block_dimensions=None),
                               **BLOCKS)
    # An l-infinity clip >= c2 is the same bound as None.
    guards.check_event_matches(
        _blocks_event(linf_norm_clip=(0.1, 5.0)), block_dimensions=(7, 34),
        **BLOCKS)


@pytest.mark.parametrize('changes, match', [
    (dict(noise_multiplier=(1.2, 2.1)), r'noise_multiplier=.*\(block 1\)'),
    (dict(l2_norm_clip=(0.7, 0.6)), r'l2_norm_clip=.*\(block 0\)'),
    (dict(linf_norm_clip=(0.1, 0.05)), r'linf_norm_clip=.*\(block 1'),
    (dict(block_dimensions=(6, 34)), 'block_dimensions=.*principal ranks'),
    (dict(noise_multiplier=(1.2, 2.0, 1.0), l2_norm_clip=(0.8, 0.6, 1.0),
          linf_norm_clip=None, block_dimensions=None), '3 blocks'),
])
def test_multi_block_mismatch_is_named(changes, match):
    with pytest.raises(ValueError, match=match):
        guards.check_event_matches(_blocks_event(**changes), num_examples=N,
                                   block_dimensions=(7, 34), **BLOCKS)


def test_multi_block_event_needs_the_models_dimensions():
    with pytest.raises(ValueError, match="model's basis"):
        guards.check_event_matches(_blocks_event(), **BLOCKS)
    with pytest.raises(ValueError, match='1 block'):
        guards.check_event_matches(_blocks_event(), **PARAMS)


def test_dp_event_from_multi_block_params():
    params = aggregation.AggregationParams(**BLOCKS)
    event = guards.dp_event_from_params(params, N, block_dimensions=(7, 34))
    assert event == _blocks_event()
    assert guards.dp_event_from_params(params, N) == _blocks_event(
        block_dimensions=None)
    with pytest.raises(ValueError, match='one entry per block'):
        guards.dp_event_from_params(params, N, block_dimensions=(7,))
    silent = aggregation.AggregationParams(**dict(
        BLOCKS, noise_multiplier=(1.0, 0.0)))
    with pytest.raises(ValueError, match=r'> 0 for a DP guarantee \(block 1'):
        guards.dp_event_from_params(silent, N)
    assert guards.model_basis(_dense()) is None
