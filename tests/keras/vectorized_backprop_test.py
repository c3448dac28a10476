"""The conversions of conv kernel and max-pool gradients for vectorized_map.

Each example's gradients from `per_example.gradients` (which attaches
`vectorized_backprop`'s converters under `tf.vectorized_map`) must equal the
ones computed for that example alone, eagerly, by TensorFlow's own
gradients, for every padding, stride, dilation and kernel or pool shape a
Keras Conv2D, Conv1D or MaxPool2D takes, by each construction of a conv
kernel's gradients (one grouped convolution, one matrix product of the
gathered columns, or one matrix product per kernel tap); the converter must
really be the one that ran; and a NaN in one example must not reach
another's gradient.
"""

import numpy as np
import pytest
import tensorflow as tf

from tensorflow.python.ops.parallel_for import pfor as pfor_lib

from tests import markers
from tf_twice.keras import vectorized_backprop
from tf_twice.keras import per_example

LOSS = per_example.loss_fn(
    tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
EXAMPLES = 5


def _model(conv, input_shape):
    inputs = tf.keras.Input(shape=input_shape)
    x = conv(inputs)
    x = tf.keras.layers.Flatten()(tf.keras.layers.Activation('tanh')(x))
    return tf.keras.Model(inputs, tf.keras.layers.Dense(3)(x))


def _data(input_shape, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(EXAMPLES,) + input_shape).astype(np.float32)
    return x, rng.integers(0, 3, EXAMPLES).astype(np.int32)


def _one_at_a_time(model, x, y):
    """Each example's gradients from its own backward pass (no pfor), in a
    graph: there the input gradient of a first-layer conv is pruned, which
    Eigen's CPU kernel cannot compute for a grouped conv."""

    @tf.function
    def one(xi, yi):
        with tf.GradientTape() as tape:
            loss = LOSS(yi, model(xi, training=True))[0]
        return tape.gradient(loss, model.trainable_variables)

    rows = [[g.numpy() for g in one(x[i:i + 1], y[i:i + 1])]
            for i in range(len(x))]
    return [np.stack(column) for column in zip(*rows)]


@pytest.fixture(params=['grouped', 'columns', 'taps'])
def construction(request, monkeypatch):
    """Runs a test with each construction of conv kernel gradients, and
    lists the convs that the grouped one or the columns converted."""
    converted = []

    def count(function_name):
        convert = getattr(vectorized_backprop, function_name)

        def counted(*args, **kwargs):
            converted.append(args)
            return convert(*args, **kwargs)

        monkeypatch.setattr(vectorized_backprop, function_name, counted)

    everywhere = {'COLUMNS_MAX_POSITIONS': 10**9}
    nowhere = vectorized_backprop.WITHOUT_COLUMNS
    if request.param == 'grouped':
        if not vectorized_backprop._grouped_applies(1, tf.float32, b'SAME'):
            pytest.skip('this CPU kernel takes no grouped convolution (or a '
                        'GPU is visible)')
        count('_grouped_filter_gradients')
        limits = nowhere
    else:
        limits = dict(nowhere, GROUPED_MAX_CHANNELS=0)
        if request.param == 'columns':
            if vectorized_backprop.gpu_visible():
                pytest.skip('a GPU is visible: the taps run')
            count('_column_filter_gradients')
            limits.update(everywhere)
    for name, value in limits.items():
        monkeypatch.setattr(vectorized_backprop, name, value)
    return request.param, converted


def _check_construction(construction, convs=1, grouped=True):
    """That the construction under test converted all ``convs`` convs (the
    taps: none of them went elsewhere); ``grouped=False`` where the grouped
    one does not apply, so the taps run instead."""
    name, converted = construction
    runs = name == 'columns' or (name == 'grouped' and grouped)
    assert len(converted) == (convs if runs else 0)


def _count_conversions(monkeypatch, op_type='Conv2DBackpropFilter'):
    """Lists 'ours' / 'stock' for each conversion of ``op_type`` by this
    module's converter and by the one TensorFlow registers (which ours hands
    some ops to)."""
    calls = []

    def counted(name, convert):
        def wrapped(pfor_input):
            calls.append(name)
            return convert(pfor_input)
        return wrapped

    for name, registry in (('ours', vectorized_backprop.CONVERTERS),
                           ('stock', pfor_lib._pfor_converter_registry)):
        monkeypatch.setitem(registry, op_type,
                            counted(name, registry[op_type]))
    return calls


def _check_each_example_alone(monkeypatch, construction, conv, shape, *,
                              traced=False, grouped=True, rtol=2e-5,
                              atol=2e-6):
    """That ``per_example.gradients`` of a model around ``conv`` (in a
    ``tf.function`` if ``traced``) gives each example's gradients alone,
    with this module's converter and ``construction`` converting the conv
    (``grouped`` as in `_check_construction`)."""
    model = _model(conv, shape)
    x, y = _data(shape)
    calls = _count_conversions(monkeypatch)

    def gradients(x, y):
        return per_example.gradients(model, LOSS, x, y).gradients

    got = (tf.function(gradients) if traced else gradients)(x, y)
    assert calls == ['ours']
    _check_construction(construction, grouped=grouped)
    for g, want in zip(got, _one_at_a_time(model, x, y)):
        np.testing.assert_allclose(g.numpy(), want, rtol=rtol, atol=atol)


CONV2D = [
    dict(kernel_size=3, padding='valid'),
    dict(kernel_size=3, padding='same'),
    dict(kernel_size=(2, 3), padding='same', strides=2),
    dict(kernel_size=3, padding='valid', strides=(2, 1)),
    dict(kernel_size=3, padding='same', dilation_rate=2),
    dict(kernel_size=(3, 2), padding='valid', dilation_rate=(1, 2)),
    dict(kernel_size=1, padding='valid'),
    dict(kernel_size=4, padding='same', strides=3),
]


@pytest.mark.parametrize('options', CONV2D, ids=str)
def test_conv2d_kernel_gradients_equal_each_example_alone(monkeypatch,
                                                          options,
                                                          construction):
    _check_each_example_alone(monkeypatch, construction,
                              tf.keras.layers.Conv2D(4, **options), (9, 8, 3),
                              traced=True)


@pytest.mark.parametrize('options', [dict(kernel_size=3, padding='causal'),
                                     dict(kernel_size=2, strides=2)], ids=str)
def test_conv1d_kernel_gradients_equal_each_example_alone(monkeypatch,
                                                          options,
                                                          construction):
    _check_each_example_alone(monkeypatch, construction,
                              tf.keras.layers.Conv1D(3, **options), (11, 2))


def test_a_conv_over_time_steps_sums_each_examples_steps(monkeypatch,
                                                         construction):
    # TimeDistributed: each example's conv sees a batch of 3 time steps,
    # whose kernel gradients add up within the example.
    shape = (3, 6, 5, 2)
    model = _model(tf.keras.layers.TimeDistributed(
        tf.keras.layers.Conv2D(3, 3, padding='same', strides=(2, 1))), shape)
    x, y = _data(shape)
    calls = _count_conversions(monkeypatch)
    got = per_example.gradients(model, LOSS, x, y).gradients
    # Keras 2 runs the conv once on the steps, Keras 3 once per step.
    assert calls in (['ours'], ['ours'] * 3)
    _check_construction(construction, convs=len(calls))
    for g, want in zip(got, _one_at_a_time(model, x, y)):
        np.testing.assert_allclose(g.numpy(), want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize('channels', [
    vectorized_backprop.GROUPED_MAX_CHANNELS,
    vectorized_backprop.GROUPED_MAX_CHANNELS + 1])
def test_the_grouped_construction_takes_convs_up_to_its_channel_limit(
        monkeypatch, channels, construction):
    # Past the limit the taps run instead (faster there on the CPUs
    # measured); either way each example's gradients are its own.
    _check_each_example_alone(
        monkeypatch, construction,
        tf.keras.layers.Conv2D(4, 3, padding='same'), (6, 5, channels),
        grouped=channels <= vectorized_backprop.GROUPED_MAX_CHANNELS)


class _ExplicitlyPaddedConv(tf.keras.layers.Layer):
    """A conv whose padding is given row by row (padding='EXPLICIT')."""

    def __init__(self, strides):
        super().__init__()
        self.strides = strides

    def build(self, input_shape):
        self.kernel = self.add_weight(name='kernel', shape=(3, 2, 3, 4))

    def call(self, x):
        return tf.nn.conv2d(x, self.kernel, self.strides,
                            [[0, 0], [1, 2], [0, 1], [0, 0]])


@pytest.mark.parametrize('strides', [1, 2])
def test_explicit_padding_runs_the_taps_or_the_columns(monkeypatch, strides,
                                                      construction):
    # The grouped construction does not take explicit padding on a CPU.
    _check_each_example_alone(monkeypatch, construction,
                              _ExplicitlyPaddedConv(strides), (9, 8, 3),
                              grouped=False)


def test_a_16_bit_convs_kernel_gradients_equal_each_example_alone(
        monkeypatch, construction):
    # A mixed_float16 conv: float16 inputs and output gradients (the taps
    # and the columns sum their products in float32, TensorFlow's kernel
    # for the example alone in float16: float16's precision apart).
    # The grouped convolution takes float32 only.
    _check_each_example_alone(
        monkeypatch, construction,
        tf.keras.layers.Conv2D(
            4, 3, padding='same',
            dtype=tf.keras.mixed_precision.Policy('mixed_float16')),
        (9, 8, 3), grouped=False, rtol=1e-2, atol=1e-2)


MAX_POOL = [
    dict(pool_size=2),
    dict(pool_size=3, strides=2, padding='same'),
    dict(pool_size=(2, 3), strides=1, padding='valid'),
]


@pytest.mark.parametrize('options', [
    dict(activation='relu'), dict(), dict(activation='relu', use_bias=False)],
                         ids=str)
def test_a_convs_bias_and_relu_run_on_its_output(monkeypatch, options):
    # Applied to the conv's own [examples, h, w, c] output, where oneDNN
    # fuses them into it; TensorFlow's conversions put reshapes between.
    shape = (9, 8, 3)
    model = _model(tf.keras.layers.Conv2D(4, 3, padding='same', **options),
                   shape)
    x, y = _data(shape)
    calls = {op: _count_conversions(monkeypatch, op)
             for op in ('BiasAdd', 'Relu')}
    got = tf.function(lambda x, y: per_example.gradients(
        model, LOSS, x, y).gradients)(x, y)
    # The Dense layer's BiasAdd (after a MatMul) goes to TensorFlow's.
    bias = options.get('use_bias', True)
    assert sorted(calls['BiasAdd']) == ['ours'] * (2 if bias else 1) + [
        'stock']
    relu = options.get('activation') == 'relu'
    assert calls['Relu'] == (['ours'] if relu and bias else
                             ['ours', 'stock'] if relu else [])
    for g, want in zip(got, _one_at_a_time(model, x, y)):
        np.testing.assert_allclose(g.numpy(), want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize('options', MAX_POOL, ids=str)
def test_max_pool_gradients_equal_each_example_alone(monkeypatch, options):
    shape = (9, 8, 2)
    model = _model(tf.keras.Sequential([
        tf.keras.layers.Conv2D(3, 3, padding='same'),
        tf.keras.layers.MaxPool2D(**options)]), shape)
    x, y = _data(shape)
    calls = _count_conversions(monkeypatch, 'MaxPoolGrad')
    got = per_example.gradients(model, LOSS, x, y).gradients
    assert calls == ['ours']
    for g, want in zip(got, _one_at_a_time(model, x, y)):
        np.testing.assert_allclose(g.numpy(), want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize('value', [np.nan, np.inf])
def test_a_non_finite_example_leaves_the_others_exact(value, construction):
    shape = (8, 8, 2)
    model = tf.keras.Sequential([
        tf.keras.Input(shape=shape),
        tf.keras.layers.Conv2D(3, 3, padding='same'),
        tf.keras.layers.MaxPool2D(2),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(3)])
    x, y = _data(shape, seed=1)
    want = _one_at_a_time(model, x, y)
    x[2, 3, 3, 1] = value
    got = per_example.gradients(model, LOSS, x, y).gradients
    _check_construction(construction)
    # The bad value reaches its own example's gradients, so a conversion
    # that mixed examples would spread it (inf: through the pool's output,
    # whose weighted sum in the Dense layer is NaN).
    assert np.isnan(got[0][2].numpy()).any()
    others = [0, 1, 3, 4]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy()[others], w[others],
                                   rtol=2e-5, atol=2e-6)


# Keras 2 (TensorFlow 2.15, or tf-keras): TensorFlow's own conversion of
# its Dense layer's product fails on such a batch before any conv.
@markers.needs_keras_3
def test_an_empty_batch_of_run_time_size_gives_empty_gradients(construction):
    # With no examples, TensorFlow's conversions upstream hand the conv an
    # output gradient of another empty shape, which a reshape with -1
    # turned into sizes the matrix products refused.
    shape = (6, 6, 2)
    model = _model(tf.keras.layers.Conv2D(4, 3, padding='same'), shape)
    run = tf.function(lambda x, y: per_example.gradients(
        model, LOSS, x, y).gradients, input_signature=[
            tf.TensorSpec((None,) + shape), tf.TensorSpec([None], tf.int32)])
    got = run(np.zeros((0,) + shape, np.float32), np.zeros([0], np.int32))
    _check_construction(construction)
    assert [g.shape for g in got] == [
        [0] + v.shape.as_list() for v in model.trainable_variables]


@pytest.mark.parametrize('side, channels, columns', [
    ((8, 8), 2, True), ((9, 8), 2, False),  # 64 and 72 output positions.
    ((16, 16), 64, True), ((17, 16), 64, False),  # 256 and 272, wide.
    ((9, 8), 63, False)])
def test_the_columns_run_for_few_positions_or_many_channels(
        monkeypatch, side, channels, columns):
    # The rule of the default limits (measured, module docstring); above
    # 256 positions the columns' kh * kw copies of the input would be
    # unmeasured memory.
    if vectorized_backprop.gpu_visible():
        pytest.skip('a GPU is visible: the taps run')
    converted = []
    convert = vectorized_backprop._column_filter_gradients
    monkeypatch.setattr(vectorized_backprop, '_column_filter_gradients',
                        lambda *args: converted.append(1) or convert(*args))
    shape = side + (channels,)
    model = _model(tf.keras.layers.Conv2D(2, 3, padding='same'), shape)
    x, y = _data(shape)
    got = per_example.gradients(model, LOSS, x, y).gradients
    assert len(converted) == int(columns)
    for g, want in zip(got, _one_at_a_time(model, x, y)):
        np.testing.assert_allclose(g.numpy(), want, rtol=2e-5, atol=2e-6)


def test_spatial_size_known_only_at_run_time_falls_back(monkeypatch):
    model = tf.keras.Sequential([
        tf.keras.Input(shape=(None, None, 1)),
        tf.keras.layers.Conv2D(2, 3),
        tf.keras.layers.GlobalAveragePooling2D(),
        tf.keras.layers.Dense(3)])
    x, y = _data((6, 6, 1))
    calls = _count_conversions(monkeypatch)
    run = tf.function(lambda x, y: per_example.gradients(
        model, LOSS, x, y).gradients, input_signature=[
            tf.TensorSpec([None, None, None, 1]), tf.TensorSpec([None],
                                                               tf.int32)])
    got = run(x, y)
    assert calls == ['ours', 'stock']  # Asked, handed to TensorFlow.
    for g, want in zip(got, _one_at_a_time(model, x, y)):
        np.testing.assert_allclose(g.numpy(), want, rtol=2e-5, atol=2e-6)


class _GroupedConv(tf.keras.layers.Layer):
    """Two groups of two channels: the kernel sees half the input's.
    ``split``: the same function as two ungrouped convs, whose gradients
    every CPU kernel computes (Eigen's takes no groups)."""

    split = False

    def build(self, input_shape):
        self.kernel = self.add_weight(name='kernel', shape=(3, 3, 2, 4))

    def call(self, x):
        if not self.split:
            return tf.nn.conv2d(x, self.kernel, 1, 'SAME')
        return tf.concat([tf.nn.conv2d(x[..., 2 * k:2 * k + 2],
                                       self.kernel[..., 2 * k:2 * k + 2], 1,
                                       'SAME') for k in range(2)], axis=-1)


def test_a_grouped_conv_is_converted_group_by_group(monkeypatch):
    # TensorFlow's own conversion runs one grouped Conv2DBackpropFilter
    # over examples and groups, which failed on an AMD EPYC ("filter_size
    # does not have enough elements, requested 144, got 72") and which
    # Eigen's kernel (TF_ENABLE_ONEDNN_OPTS=0) refuses. Ours never hands
    # it over: each group's kernel gradient is an ungrouped conv's.
    shape = (6, 6, 4)
    conv = _GroupedConv()
    model = _model(conv, shape)
    x, y = _data(shape)
    calls = _count_conversions(monkeypatch)
    got = per_example.gradients(model, LOSS, x, y).gradients
    assert calls == ['ours']
    conv.split = True
    for g, want in zip(got, _one_at_a_time(model, x, y)):
        np.testing.assert_allclose(g.numpy(), want, rtol=2e-5, atol=2e-6)


def test_a_keras_grouped_conv_runs_one_conv_per_group_per_example(
        monkeypatch):
    # Keras runs Conv2D(groups=2) in an XLA-compiled function, whose ops
    # pfor converts outside XLA: on Eigen's CPU kernels (and on an AMD EPYC
    # with oneDNN) a DPModel's first step failed there. Inside the pass each
    # group is an ungrouped conv, whose gradients our converters take (two
    # for the grouped layer after one for the first), the same function.
    shape = (6, 6, 2)
    grouped = tf.keras.layers.Conv2D(4, 3, padding='same', groups=2)
    model = _model(lambda x: grouped(tf.keras.layers.Conv2D(
        4, 3, padding='same')(x)), shape)
    x, y = _data(shape)
    calls = _count_conversions(monkeypatch)
    got = per_example.gradients(model, LOSS, x, y).gradients
    assert calls == ['ours'] * 3
    assert 'convolution_op' not in vars(grouped)  # Restored after the pass.
    assert '_jit_compiled_convolution_op' not in vars(grouped)
    for g, want in zip(got, _one_at_a_time(model, x, y)):
        np.testing.assert_allclose(g.numpy(), want, rtol=2e-5, atol=2e-6)


def test_vectorized_map_outside_tf_twice_keeps_tensorflows_converter(
        monkeypatch):
    calls = _count_conversions(monkeypatch)
    x = tf.random.normal([3, 6, 6, 2])
    kernel = tf.Variable(tf.random.normal([3, 3, 2, 4]))

    def one(xi):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.nn.conv2d(xi[None], kernel, 1, 'SAME') ** 2)
        return tape.gradient(loss, kernel)

    assert tf.vectorized_map(one, x).shape == [3, 3, 3, 2, 4]
    assert calls == ['stock']
