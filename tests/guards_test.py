"""Tests of the guard rails (tf_twice.keras.guards)."""

import warnings

import numpy as np
import pytest
import tensorflow as tf

from tf_twice import sampling
from tf_twice.keras import guards


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
    guards.check_no_batch_norm(model)
    guards.check_no_batch_norm(_dense())


def test_batch_norm_top_level_fails():
    model = tf.keras.Sequential([
        tf.keras.layers.Dense(4, input_shape=(3,)),
        tf.keras.layers.BatchNormalization(name='bn'),
    ])
    with pytest.raises(ValueError, match=r"bn.*GroupNormalization"):
        guards.check_no_batch_norm(model)


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
        guards.check_no_batch_norm(outer)


def test_batch_norm_in_custom_layer_fails():
    class Block(tf.keras.layers.Layer):

        def __init__(self):
            super().__init__(name='block')
            self.norm = tf.keras.layers.experimental.SyncBatchNormalization()

        def call(self, x):
            return self.norm(x)

    with pytest.raises(ValueError, match='SyncBatchNormalization'):
        guards.check_no_batch_norm(Block())


def test_check_no_batch_norm_rejects_non_models():
    with pytest.raises(ValueError, match='model'):
        guards.check_no_batch_norm('model')


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


def test_normalization():
    assert guards.check_normalization('expected') == 'expected'
    assert guards.check_normalization('expected_batch_size') == (
        'expected_batch_size')
    for realised in ('realized', 'realised', 'batch_size', 'actual'):
        with pytest.raises(ValueError, match='realised batch size'):
            guards.check_normalization(realised)
    with pytest.raises(ValueError, match='must be one of'):
        guards.check_normalization('median')
    with pytest.raises(ValueError, match='must be one of'):
        guards.check_normalization(None)
