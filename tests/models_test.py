"""Tests of the Keras models (tf_twice.models)."""

import numpy as np
import pytest
import tensorflow as tf

from tf_twice import models
from tf_twice.keras import guards


def _num_trainable(model: tf.keras.Model) -> int:
    return int(sum(np.prod(w.shape) for w in model.trainable_weights))


@pytest.fixture(scope='module')
def cnn():
    return models.small_cnn()


@pytest.fixture(scope='module')
def resnet():
    return models.resnet22()


def _all_layers(model):
    """Every layer, nested models' included (``submodules`` is Keras 2's)."""
    layers = []
    for layer in model.layers:
        layers.append(layer)
        if isinstance(layer, tf.keras.Model):
            layers += _all_layers(layer)
    return layers


def test_small_cnn_has_79530_parameters(cnn):
    assert cnn.count_params() == 79_530
    assert _num_trainable(cnn) == 79_530


def test_resnet22_has_291898_trainable_parameters(resnet):
    # The paper's d for ResNet22 on CIFAR-10.
    assert _num_trainable(resnet) == 291_898
    assert resnet.count_params() == 291_898  # No frozen statistics either.


def test_resnet22_count_does_not_depend_on_groups():
    assert _num_trainable(models.resnet22(groups=16)) == 291_898


def test_resnet22_has_22_weighted_layers(resnet):
    weighted = [l for l in resnet.layers
                if isinstance(l, (tf.keras.layers.Conv2D,
                                  tf.keras.layers.Dense))]
    projections = [l for l in weighted if l.name.endswith('_proj')]
    assert len(projections) == 2
    assert len(weighted) - len(projections) == 22


@pytest.mark.parametrize('builder', ['cnn', 'resnet'])
def test_logits_shape(builder, request):
    model = request.getfixturevalue(builder)
    x = np.random.default_rng(0).normal(size=(2, 32, 32, 3))
    logits = model(x.astype(np.float32), training=False)
    assert logits.shape == (2, 10)
    assert np.all(np.isfinite(logits.numpy()))
    # Logits, not probabilities: the last layer has no softmax.
    assert model.layers[-1].get_config()['activation'] == 'linear'


@pytest.mark.parametrize('builder', ['cnn', 'resnet'])
def test_no_batch_normalization(builder, request):
    model = request.getfixturevalue(builder)
    guards.check_no_example_mixing(model)  # Raises if there is one.
    names = [type(l).__name__ for l in _all_layers(model)]
    assert not [n for n in names if 'BatchNorm' in n]


def test_resnet22_uses_group_norm_and_elu(resnet):
    layers = _all_layers(resnet)
    assert any(isinstance(l, tf.keras.layers.GroupNormalization)
               for l in layers)
    assert any(isinstance(l, tf.keras.layers.ELU) for l in layers)
    assert not any(isinstance(l, tf.keras.layers.ReLU) for l in layers)


def test_resnet22_convs_have_no_bias(resnet):
    convs = [l for l in _all_layers(resnet)
             if isinstance(l, tf.keras.layers.Conv2D)]
    assert len(convs) == 23  # Stem, 20 block convs, 2 projections.
    for conv in convs:
        assert not conv.use_bias, conv.name
        assert conv.bias is None, conv.name


def test_resnet22_examples_do_not_mix(resnet):
    # GroupNorm normalises within an example: one example's logits must not
    # depend on the rest of the batch (BatchNorm in training mode would).
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 32, 32, 3)).astype(np.float32)
    together = resnet(x, training=True).numpy()
    alone = resnet(x[:1], training=True).numpy()
    np.testing.assert_allclose(together[:1], alone, rtol=1e-4, atol=1e-5)


def test_small_cnn_on_digits():
    model = models.small_cnn((8, 8, 1), num_classes=10, padding='same')
    x = np.zeros((2, 8, 8, 1), np.float32)
    assert model(x).shape == (2, 10)


def test_small_cnn_valid_padding_refuses_digits_naming_the_fix():
    with pytest.raises(ValueError, match="padding='same'"):
        models.small_cnn((8, 8, 1))


def test_resnet22_on_svhn_shape_and_other_class_counts():
    model = models.resnet22((32, 32, 3), num_classes=100)
    assert model(np.zeros((2, 32, 32, 3), np.float32)).shape == (2, 100)
    assert _num_trainable(model) == 291_898 - 650 + 64 * 100 + 100


@pytest.mark.parametrize('builder', [models.small_cnn, models.resnet22])
@pytest.mark.parametrize('num_classes', [1, 0, -3, 2.0, True])
def test_bad_num_classes(builder, num_classes):
    with pytest.raises(ValueError, match='num_classes'):
        builder(num_classes=num_classes)


@pytest.mark.parametrize('builder', [models.small_cnn, models.resnet22])
@pytest.mark.parametrize('input_shape', [
    (32, 32), (1, 32, 32, 3), (32,), (32, 32, 0), (32, 32.0, 3), 5])
def test_bad_input_shape(builder, input_shape):
    with pytest.raises(ValueError, match='input_shape'):
        builder(input_shape=input_shape)


@pytest.mark.parametrize('groups', [0, 3, 32, 2.0])
def test_resnet22_bad_groups(groups):
    with pytest.raises(ValueError, match='groups'):
        models.resnet22(groups=groups)


def test_small_cnn_bad_padding():
    with pytest.raises(ValueError, match='padding'):
        models.small_cnn(padding='causal')


def test_build_model_by_name():
    model = models.build_model('small_cnn', input_shape=(8, 8, 1),
                               padding='same')
    assert model.name == 'small_cnn'
    assert set(models.MODELS) == {'small_cnn', 'resnet22', 'tanh_cnn',
                                  'linear', 'feature_cnn'}
    assert models.build_model('tanh_cnn').name == 'tanh_cnn'
    with pytest.raises(ValueError, match='name'):
        models.build_model('resnet50')


@pytest.fixture(scope='module')
def tanh():
    return models.tanh_cnn()


def test_tanh_cnn_has_26010_parameters(tanh):
    # The (Fashion-)MNIST CNN of Tramer & Boneh (ICLR 2021).
    assert tanh.count_params() == 26_010
    assert _num_trainable(tanh) == 26_010
    shapes = [tuple(w.shape) for w in tanh.trainable_weights]
    assert shapes == [(8, 8, 1, 16), (16,), (4, 4, 16, 32), (32,),
                      (512, 32), (32,), (32, 10), (10,)]


def test_tanh_cnn_layers(tanh):
    convs = [l for l in tanh.layers if isinstance(l, tf.keras.layers.Conv2D)]
    assert [(c.strides, c.padding) for c in convs] == [
        ((2, 2), 'same'), ((2, 2), 'valid')]
    pools = [l for l in tanh.layers
             if isinstance(l, tf.keras.layers.MaxPool2D)]
    assert [(p.pool_size, p.strides) for p in pools] == [((2, 2), (1, 1))] * 2
    activations = [l.get_config()['activation'] for l in tanh.layers
                   if isinstance(l, (tf.keras.layers.Conv2D,
                                     tf.keras.layers.Dense))]
    assert activations == ['tanh', 'tanh', 'tanh', 'linear']


def test_tanh_cnn_has_no_example_mixing_layer(tanh):
    guards.check_no_example_mixing(tanh)  # Raises if there is one.
    x = np.random.default_rng(2).normal(size=(3, 28, 28, 1))
    together = tanh(x.astype(np.float32), training=True).numpy()
    alone = tanh(x[1:2].astype(np.float32), training=True).numpy()
    assert together.shape == (3, 10)
    np.testing.assert_allclose(together[1:2], alone, rtol=1e-5, atol=1e-6)


def test_tanh_cnn_refuses_small_inputs_by_name():
    assert models.tanh_cnn((13, 13, 1)).output_shape == (None, 10)
    with pytest.raises(ValueError, match='>= 13'):
        models.tanh_cnn((12, 12, 1))
    with pytest.raises(ValueError, match='input_shape'):
        models.tanh_cnn((8, 8, 1))


@pytest.mark.parametrize('name, params', [('linear', 39700),
                                          ('feature_cnn', 35498)])
def test_feature_models_on_scattering_features(name, params):
    # 81 x 7 x 7 ScatterNet features of a 28x28 image, 10 classes; the
    # input normalisation has no parameters (affine=False in Tramer & Boneh).
    model = models.build_model(name)
    assert _num_trainable(model) == params
    norm = model.get_layer('input_norm')
    assert norm.groups == 27 and not norm.trainable_weights
    assert norm.epsilon == 1e-5  # Below the features' variances (1e-6 up).
    guards.check_no_example_mixing(model)  # Raises for a mixing layer.


@pytest.mark.parametrize('name', ['linear', 'feature_cnn'])
def test_feature_models_normalise_each_example_alone(name):
    # Per-example GroupNorm: an affine change of one example's features
    # leaves its logits unchanged, and another example's do not move.
    model = models.build_model(name)
    x = np.random.default_rng(0).normal(size=(3, 7, 7, 81)).astype('float32')
    logits = model(x).numpy()
    scaled = x.copy()
    scaled[0] *= 7.0
    scaled[1] = 1e6 * scaled[1] + 3.0
    # Up to the normalisation's epsilon (1e-5) added to the variance.
    np.testing.assert_allclose(model(scaled).numpy()[0], logits[0],
                               rtol=5e-3, atol=5e-3)
    np.testing.assert_allclose(model(scaled).numpy()[2], logits[2],
                               rtol=1e-6, atol=1e-6)


def test_feature_models_refuse_groups_that_do_not_divide_the_channels():
    assert models.linear((28, 28, 1)).get_layer('input_norm').groups == 1
    with pytest.raises(ValueError, match='groups'):
        models.linear(groups=10)
    with pytest.raises(ValueError, match='input_shape'):
        models.feature_cnn((1, 7, 81))
