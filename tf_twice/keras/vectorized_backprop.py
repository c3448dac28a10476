"""Faster `tf.vectorized_map` conversions of a few ops of a training step.

`per_example.gradients` runs each example's forward and backward pass under
`tf.vectorized_map`, which converts every op of one example's pass into an
op over all examples. Some of TensorFlow's conversions are slow on the
reference CNN (`benchmarks/conv_per_example_benchmark.py`, per-op traces):

* ``Conv2DBackpropFilter`` (a conv kernel's gradient) with a per-example
  input becomes a ``while_loop`` of batch-1 ops over the examples
  (TensorFlow logs "Conv2DBackpropFilter uses a while_loop. Fix that!").
  Each example's kernel gradient sums, over output positions (and over the
  rows of the example's own batch, e.g. the time steps of a
  ``TimeDistributed`` conv), what each kernel tap (i, j) read there times
  the output gradient:

        dW[e, i, j] = sum_{h, w} x_e[h*s + i*d, w*s + j*d, :]^T dy_e[h, w, :]

  (strides s, dilations d, x_e padded as the conv pads it). Here it
  becomes, on a CPU (measured in CPU time against the batch's summed
  gradient, 64 examples, `benchmarks/conv_per_example_benchmark.py`),

  - the columns: each example's input gathered into one row per output
    position holding what every tap reads there (im2col), times its output
    gradient in one batched matrix product; for convs of at most
    `COLUMNS_MAX_POSITIONS` output positions, or of at least
    `COLUMNS_MIN_CHANNELS` input channels and at most
    `COLUMNS_WIDE_MAX_POSITIONS` positions (the columns hold kh * kw copies
    of the input: a bound on memory), where it took 0.53-0.98x the
    taps' CPU time (ResNet22's 8x8 convs of 64 channels, and 3x3 convs of
    64-256 channels at sides 16-4, ``--model wide``); on ResNet22's and the
    reference CNN's other convs (more positions, fewer channels)
    1.05-2.21x the CPU time of the construction below that runs there,
    except ResNet22's stride-2 conv of 16 channels (0.88-0.90x the grouped
    convolution's; left to it by this simple rule);
  - else, one grouped ``Conv2DBackpropFilter`` with the examples as its
    groups (input [b, h, w, examples * channels]), on a CPU whose kernel
    takes groups (oneDNN's), for float32 convs of at most
    `GROUPED_MAX_CHANNELS` input channels padded SAME or VALID (oneDNN's
    kernel takes no explicit padding), where it took 0.71-0.85x the CPU
    time of the taps on the reference CNN's and ResNet22's shapes of at
    most 16 channels; at 32 channels (ResNet22's 16x16 convs) 1.04-1.09x
    on an AMD EPYC and 0.74x on an Intel Xeon with AVX-512, where a
    64-example DP chunk of ResNet22 took 0.92x and 0.95x (TensorFlow 2.15,
    2.21) the CPU time it took with the taps at 32 channels; at 64
    channels 1.23-1.42x on both;
  - else (and wherever a GPU could run the op, where neither was
    measured), kh * kw batched matrix products, one per tap, of the
    example's padded input shifted by the tap and its output gradient.

  The columns and the taps accumulate in float32 for 16-bit inputs.
* ``MaxPoolGrad``: TensorFlow's conversion reshapes its inputs, which hides
  the forward ``MaxPool`` from oneDNN's graph rewrite, so the slow
  reference kernel runs (10x the batched pass's on the reference CNN). Here
  the flattened input is pooled again and the gradient taken of that pool,
  which the rewrite recognises.
* ``BiasAdd`` and ``Relu`` after a ``Conv2D``: TensorFlow's conversion of
  the conv reshapes its output to [examples, rows, ...], which hides the
  conv-bias-ReLU pattern from the rewrite that fuses it into one oneDNN
  kernel (as in non-private training). Here they act on the conv's own
  output, reshaped after them. The reference CNN's twice-sampling step
  then trained 1.080x (TensorFlow 2.15) and 1.039x (2.21) the examples per
  CPU-second, about the same per wall second (1.013x, 1.011x)
  (`benchmarks/training_benchmark.py --compare-without=fusion` (then
  ``--compare-unfused``), fixed batches of 256, 12 paired rounds of 30
  steps; round ratios 0.79-1.26).

Each example's result reads that example's tensors alone, as TensorFlow's
conversions do: per-example gradients stay isolated (SPEC section 11), a NaN
in one example cannot reach another's gradient.

The converters are attached to the ops of one per-example pass
(`faster_conversions`), not registered globally, so code outside tf_twice
keeps TensorFlow's conversions. Where one does not apply (a conv input
shared by all examples, NCHW, a shape or kernel size known only at run
time, explicit padding of a pool), it hands the op to TensorFlow's
converter. A grouped conv's kernel gradient is taken group by group, each
as an ungrouped conv's: TensorFlow's conversion of it fails where the CPU
kernel is Eigen's. Keras runs a ``Conv(groups > 1)`` layer's conv in a
function it compiles with XLA (CPU kernels without oneDNN take no groups);
pfor converts that function's ops one example at a time, outside XLA, where
they fail (``TF_ENABLE_ONEDNN_OPTS=0``, and on some AMD CPUs with it). So
inside a per-example pass such a layer runs one ungrouped conv per group
(`ungrouped_convolutions`), the same sum, which the converters above take.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, List, Optional, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.ops.parallel_for import pfor as pfor_lib

__all__ = ['faster_conversions', 'ungrouped_convolutions']


@contextlib.contextmanager
def faster_conversions() -> Iterator[None]:
    """Gives the ops of `CONVERTERS`' types created inside the block this
    module's conversion (read by `tf.vectorized_map` when it converts them).
    Outside a graph (eager) it does nothing."""
    if tf.executing_eagerly():
        yield
        return
    graph = tf.compat.v1.get_default_graph()
    before = len(graph.get_operations())
    yield
    for op in graph.get_operations()[before:]:
        if op.type in CONVERTERS:
            # pfor reads this attribute before its registry.
            op.pfor_converter = CONVERTERS[op.type]


@contextlib.contextmanager
def ungrouped_convolutions(model: tf.keras.Model) -> Iterator[None]:
    """Inside the block, each Keras conv layer of ``model`` with groups > 1
    computes its conv as one ungrouped conv per group, concatenated (group
    k: input channels [k c, (k + 1) c), filters [k f, (k + 1) f))."""
    patched = []
    for layer in model._flatten_layers():  # pylint: disable=protected-access
        groups = getattr(layer, 'groups', 1)
        conv = getattr(type(layer), 'convolution_op', None)
        if not isinstance(groups, int) or groups <= 1 or conv is None:
            continue
        # Keras 2 calls the XLA-compiled method for groups > 1; Keras 3
        # calls convolution_op, whose backend compiles a grouped conv.
        name = ('_jit_compiled_convolution_op' if hasattr(
            type(layer), '_jit_compiled_convolution_op') else 'convolution_op')
        object.__setattr__(layer, name, functools.partial(
            _conv_per_group, layer, conv, groups))
        patched.append((layer, name))
    try:
        yield
    finally:
        for layer, name in patched:
            object.__delattr__(layer, name)


def _conv_per_group(layer, conv, groups: int, inputs, kernel):
    axis = 1 if getattr(layer, 'data_format', '') == 'channels_first' else -1
    return tf.concat([conv(layer, x, k) for x, k in zip(
        tf.split(inputs, groups, axis=axis), tf.split(kernel, groups, -1))],
                     axis=axis)


def _stock(pfor_input):
    """TensorFlow's own conversion of the op."""
    registry = pfor_lib._pfor_converter_registry  # pylint: disable=protected-access
    return registry[pfor_input.op_type](pfor_input)


def _static_ints(values: Sequence) -> Optional[List[int]]:
    return None if any(v is None for v in values) else [int(v) for v in values]


# Input channels up to which the grouped construction is used (at 64 the
# taps were faster on both CPUs measured; module docstring).
GROUPED_MAX_CHANNELS = 32
# The columns are used for convs of at most this many output positions
# (before the grouped construction) and of at least this many input channels
# (instead of the taps); elsewhere the grouped convolution or the taps were
# faster (module docstring).
COLUMNS_MAX_POSITIONS = 64
COLUMNS_MIN_CHANNELS = 64
# ... the latter only up to this many output positions: measured up to 256,
# and the columns hold kh * kw copies of the input at once.
COLUMNS_WIDE_MAX_POSITIONS = 256
# Values of the limits above under which the columns never run, to compare
# the step without them (benchmarks, tests): ``mock.patch.multiple(
# vectorized_backprop, **WITHOUT_COLUMNS)`` around the trace.
WITHOUT_COLUMNS = {'COLUMNS_MAX_POSITIONS': 0, 'COLUMNS_MIN_CHANNELS': 10**9}


@functools.lru_cache(maxsize=None)
def _cpu_takes_grouped_filter_gradients() -> bool:
    """Whether this build's CPU kernel computes a grouped
    ``Conv2DBackpropFilter``: oneDNN's does, TensorFlow's own (e.g. with
    TF_ENABLE_ONEDNN_OPTS=0) raises when the op runs, so it is tried once,
    eagerly."""
    with tf.init_scope(), tf.device('/CPU:0'):
        try:
            tf.raw_ops.Conv2DBackpropFilter(
                input=tf.ones([1, 2, 2, 2]), filter_sizes=[1, 1, 1, 2],
                out_backprop=tf.ones([1, 2, 2, 2]), strides=[1, 1, 1, 1],
                padding='VALID')
        except tf.errors.OpError:
            return False
    return True


def gpu_visible() -> bool:
    """Whether TensorFlow sees a GPU, which could run the ops traced here.

    The grouped convolution and the columns were measured on CPUs only, so
    where a GPU is visible the taps stay; `per_example` sizes its default
    chunks by it too.
    """
    return bool(tf.config.list_logical_devices('GPU'))


def _grouped_applies(channels: int, dtype: tf.DType, padding: bytes) -> bool:
    # oneDNN's kernel does not take explicit padding; TensorFlow's, which
    # then runs, takes no groups.
    return (dtype == tf.float32 and channels <= GROUPED_MAX_CHANNELS
            and padding != b'EXPLICIT' and not gpu_visible()
            and _cpu_takes_grouped_filter_gradients())


def _grouped_filter_gradients(pfor_input, inputs, grads, kernel_size):
    """[examples, kh, kw, channels, filters]: one grouped convolution whose
    group e is example e, with the op's own strides, padding (SAME or
    VALID) and dilations. Group e reads example e's channels alone."""
    kh, kw, channels, filters = kernel_size
    examples = tf.shape(inputs)[0]

    def examples_as_channels(t):  # [e, b, h, w, c] -> [b, h, w, e * c]
        shape = t.shape.as_list()
        return tf.reshape(tf.transpose(t, [1, 2, 3, 0, 4]),
                          [-1, shape[2], shape[3], examples * shape[4]])

    kernel = tf.raw_ops.Conv2DBackpropFilter(
        input=examples_as_channels(inputs),
        filter_sizes=tf.stack([kh, kw, channels, examples * filters]),
        out_backprop=examples_as_channels(grads),
        strides=pfor_input.get_attr('strides'),
        padding=pfor_input.get_attr('padding'),
        dilations=pfor_input.get_attr('dilations'),
        data_format='NHWC')
    kernel = tf.reshape(kernel, [kh, kw, channels, examples, filters])
    return tf.transpose(kernel, [3, 0, 1, 2, 4])


def _convert_conv2d_backprop_filter(pfor_input):
    pfor_input.stack_inputs(stack_indices=[2])
    inputs, inputs_stacked, _ = pfor_input.input(0)
    grads = pfor_input.stacked_input(2)
    kernel_size = tf.get_static_value(pfor_input.unstacked_input(1))
    # Stacked shapes: [examples, batch, height, width, channels].
    in_shape = _static_ints(inputs.shape.as_list()[2:4])
    out_shape = _static_ints(grads.shape.as_list()[2:4])
    if (not inputs_stacked or pfor_input.get_attr('data_format') != b'NHWC'
            or kernel_size is None or in_shape is None or out_shape is None
            or inputs.shape[-1] is None):
        return _stock(pfor_input)
    kh, kw, channels, filters = (int(k) for k in kernel_size)
    # A grouped conv: group k reads input channels [k c, (k + 1) c) and
    # writes filters [k f, (k + 1) f). Each group's kernel gradient is an
    # ungrouped conv's; TensorFlow's own conversion fails where the CPU
    # kernel is Eigen's, which takes no groups (oneDNN's does).
    groups = int(inputs.shape[-1]) // channels
    if groups * channels != inputs.shape[-1] or filters % groups:
        return _stock(pfor_input)
    f = filters // groups
    if groups == 1:
        return pfor_lib.wrap(_filter_gradients(
            pfor_input, inputs, grads, (kh, kw, channels, f), in_shape,
            out_shape), True)
    return pfor_lib.wrap(tf.concat([_filter_gradients(
        pfor_input, inputs[..., k * channels:(k + 1) * channels],
        grads[..., k * f:(k + 1) * f], (kh, kw, channels, f), in_shape,
        out_shape) for k in range(groups)], axis=-1), True)


def _filter_gradients(pfor_input, inputs, grads, kernel_size, in_shape,
                      out_shape):
    """[examples, kh, kw, channels, filters]: the kernel gradient of each
    example of an ungrouped conv (the op's strides, padding, dilations)."""
    kh, kw, channels, filters = kernel_size
    (out_h, out_w) = out_shape
    _, sh, sw, _ = pfor_input.get_attr('strides')
    _, dh, dw, _ = pfor_input.get_attr('dilations')
    pads = _conv_paddings(pfor_input, in_shape, out_shape, (kh, kw),
                          (sh, sw), (dh, dw))
    positions = out_h * out_w
    if not gpu_visible() and (positions <= COLUMNS_MAX_POSITIONS or (
            channels >= COLUMNS_MIN_CHANNELS
            and positions <= COLUMNS_WIDE_MAX_POSITIONS)):
        return _column_filter_gradients(inputs, grads, in_shape, out_shape,
                                        (kh, kw, channels, filters), pads,
                                        (sh, sw), (dh, dw))
    if _grouped_applies(channels, grads.dtype,
                        pfor_input.get_attr('padding')):
        return _grouped_filter_gradients(pfor_input, inputs, grads,
                                         (kh, kw, channels, filters))
    # Row h * s + i * d of the padded input is row h + (i * d) // s of
    # phase (i * d) % s once rows are grouped s at a time, so every tap reads
    # a unit-stride slice (a strided one copies ~10x slower on a CPU). The
    # input is zero-padded as the conv pads it, then cut or zero-extended
    # further to s * (out + (k - 1) * d // s) rows; rows past the conv's own
    # padding are never read.
    lengths = [s * (out + (k - 1) * d // s) for out, k, s, d in
               ((out_h, kh, sh, dh), (out_w, kw, sw, dw))]
    x = tf.pad(inputs, [[0, 0], [0, 0]] + [
        [low, max(length - low - size, 0)]
        for (low, _), length, size in zip(pads, lengths, in_shape)] + [[0, 0]])
    x = x[:, :, :lengths[0], :lengths[1], :]
    examples, rows = tf.shape(x)[0], tf.shape(x)[1]  # Not -1: see columns.
    x = tf.reshape(x, [examples, rows, lengths[0] // sh, sh, lengths[1] // sw,
                       sw, channels])
    dy = tf.reshape(grads, [examples, rows * out_h * out_w, filters])
    x, dy = _float32_if_16_bit(x, dy)
    taps = []
    for i in range(kh):
        for j in range(kw):
            (qi, ri), (qj, rj) = divmod(i * dh, sh), divmod(j * dw, sw)
            window = x[:, :, qi:qi + out_h, ri, qj:qj + out_w, rj, :]
            taps.append(tf.matmul(tf.reshape(window, [examples, -1, channels]),
                                  dy, transpose_a=True))
    kernel = tf.reshape(tf.stack(taps, axis=1),
                        [examples, kh, kw, channels, filters])
    return tf.cast(kernel, grads.dtype)


def _column_filter_gradients(inputs, grads, in_shape, out_shape,
                             kernel_size, pads, strides, dilations):
    """[examples, kh, kw, channels, filters]: each example's input gathered
    into its columns, one row per output position holding what every tap
    reads there (im2col), times its output gradient in one matrix product.

        dW[e] = sum_p columns_e[p]^T dy_e[p],
        columns_e[p = (h, w)] = x_e[h*s + i*d, w*s + j*d, :] over taps (i, j)
    """
    kh, kw, channels, filters = kernel_size
    (top, bottom), (left, right) = pads
    padded_w = in_shape[1] + left + right
    # Flat index of the padded row and column that tap (i, j) reads at
    # position (h, w); tap-major within a row, as the kernel is laid out.
    read_row = (np.arange(out_shape[0])[:, None, None, None] * strides[0]
                + np.arange(kh)[None, None, :, None] * dilations[0])
    read_col = (np.arange(out_shape[1])[None, :, None, None] * strides[1]
                + np.arange(kw)[None, None, None, :] * dilations[1])
    index = (read_row * padded_w + read_col).reshape(
        out_shape[0] * out_shape[1], kh * kw)
    x = tf.pad(inputs, [[0, 0], [0, 0], [top, bottom], [left, right],
                        [0, 0]])
    # Sizes spelt out, not -1: with no examples TensorFlow's conversions
    # upstream can hand over an output gradient of another (empty) shape.
    # rows: of each example's own batch (time steps of a TimeDistributed).
    examples, rows = tf.shape(x)[0], tf.shape(x)[1]
    positions = rows * out_shape[0] * out_shape[1]
    x = tf.reshape(x, [examples, rows,
                       (in_shape[0] + top + bottom) * padded_w, channels])
    dy = tf.reshape(grads, [examples, positions, filters])
    x, dy = _float32_if_16_bit(x, dy)
    columns = tf.reshape(tf.gather(x, index.astype(np.int32), axis=2),
                         [examples, positions, kh * kw * channels])
    kernel = tf.reshape(tf.matmul(columns, dy, transpose_a=True),
                        [examples, kh, kw, channels, filters])
    return tf.cast(kernel, grads.dtype)


def _float32_if_16_bit(x, dy):
    # A kernel gradient sums many products of the two: in float32.
    if dy.dtype in (tf.float16, tf.bfloat16):
        return tf.cast(x, tf.float32), tf.cast(dy, tf.float32)
    return x, dy


def _conv_paddings(pfor_input, size, out_size, kernel, strides, dilations):
    """[[top, bottom], [left, right]] as the convolution padded its input."""
    padding = pfor_input.get_attr('padding')
    if padding == b'EXPLICIT':
        explicit = list(pfor_input.get_attr('explicit_paddings'))
        return [explicit[2:4], explicit[4:6]]
    if padding == b'VALID':
        return [[0, 0], [0, 0]]
    pads = []
    for n, out, k, s, d in zip(size, out_size, kernel, strides, dilations):
        total = max((out - 1) * s + (k - 1) * d + 1 - n, 0)
        pads.append([total // 2, total - total // 2])
    return pads


def _convert_max_pool_grad(pfor_input):
    padding = pfor_input.get_attr('padding')
    if padding == b'EXPLICIT':
        return _stock(pfor_input)
    pfor_input.stack_inputs()
    inputs = pfor_input.stacked_input(0)
    grads = pfor_input.stacked_input(2)

    def flat(t):  # [examples, batch, ...] -> [examples * batch, ...]
        return tf.reshape(t, tf.concat([[-1], tf.shape(t)[2:]], axis=0))

    options = dict(ksize=pfor_input.get_attr('ksize'),
                   strides=pfor_input.get_attr('strides'),
                   padding=padding.decode(),
                   data_format=pfor_input.get_attr('data_format').decode())
    x = flat(inputs)
    pooled = tf.raw_ops.MaxPool(input=x, **options)
    out = tf.raw_ops.MaxPoolGrad(orig_input=x, orig_output=pooled,
                                 grad=flat(grads), **options)
    return pfor_lib.wrap(tf.reshape(out, tf.shape(inputs)), True)


def _restacked(pfor_input, x):
    """[examples * rows, ...] -> [examples, rows, ...], reading the shape of
    ``x`` itself: another reader of the op that made ``x`` would keep
    oneDNN's rewrite from fusing it with its consumer."""
    shape = tf.shape(x)
    loop_len = tf.cast(pfor_input.pfor.loop_len_vector, shape.dtype)
    return pfor_lib.wrap(
        tf.reshape(x, tf.concat([loop_len, [-1], shape[1:]], axis=0)), True)


def _reshaped_from(t, op_type):
    """The [examples * rows, ...] output of an ``op_type`` op that a
    conversion (TensorFlow's of Conv2D, or `_restacked`) reshaped into the
    stacked ``t``, or None."""
    if t.op.type == 'Reshape' and t.op.inputs[0].op.type == op_type:
        return t.op.inputs[0]
    return None


def _convert_bias_add(pfor_input):
    t, t_stacked, _ = pfor_input.input(0)
    bias, bias_stacked, _ = pfor_input.input(1)
    conv = _reshaped_from(t, 'Conv2D') if t_stacked else None
    if (conv is None or bias_stacked
            or pfor_input.get_attr('data_format') != b'NHWC'):
        return _stock(pfor_input)
    return _restacked(pfor_input, tf.nn.bias_add(conv, bias))


def _convert_relu(pfor_input):
    t, t_stacked, _ = pfor_input.input(0)
    biased = _reshaped_from(t, 'BiasAdd') if t_stacked else None
    if biased is None or biased.op.inputs[0].op.type != 'Conv2D':
        return _stock(pfor_input)
    return _restacked(pfor_input, tf.nn.relu(biased))


CONVERTERS = {
    'BiasAdd': _convert_bias_add,
    'Relu': _convert_relu,
    'Conv2DBackpropFilter': _convert_conv2d_backprop_filter,
    'MaxPoolGrad': _convert_max_pool_grad,
}
