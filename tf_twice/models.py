"""Keras models: the paper's small CNN and ResNet22, the tanh CNN, and the
linear and small CNN heads for handcrafted (ScatterNet) features.

Every builder returns an uncompiled `tf.keras.Model` whose output is logits
of shape [batch, num_classes] (train with `from_logits=True`). No model
contains BatchNormalization: it normalises with statistics of the whole
batch, so one example's gradient would depend on the others and per-example
clipping would no longer bound any single example's influence. ResNet22 uses
GroupNormalization instead, which normalises within one example. `tanh_cnn`
is the standard DP benchmark CNN for MNIST and Fashion-MNIST (Papernot et
al. 2021; Tramer & Boneh 2021). `linear` and `feature_cnn` are Tramer &
Boneh's models on ScatterNet features (`tf_twice.features`): their input is
normalised per example by GroupNormalization without learned parameters.

For training scripts, `build_model(name, ...)` looks a builder up by name in
`MODELS`, e.g. from a `--model resnet22` flag.
"""

from __future__ import annotations

from typing import Callable, Dict, Sequence, Tuple

import tensorflow as tf

from tf_twice import _keras  # noqa: F401  pylint: disable=unused-import

__all__ = [
    'MODELS',
    'RESNET22_BLOCKS',
    'RESNET22_WIDTHS',
    'build_model',
    'feature_cnn',
    'linear',
    'resnet22',
    'small_cnn',
    'tanh_cnn',
]

# ResNet22 layout: basic blocks per stage and channels per stage (see
# `resnet22` for how the paper's 291,898 parameters pin these down).
RESNET22_BLOCKS = (3, 4, 3)
RESNET22_WIDTHS = (16, 32, 64)

_PADDINGS = ('valid', 'same')


def _check_input_shape(input_shape: Sequence[int]) -> Tuple[int, int, int]:
    """Validates a (height, width, channels) shape; returns it as a tuple."""
    try:
        shape = tuple(input_shape)
    except TypeError:
        raise ValueError(
            'input_shape must be a sequence of 3 positive ints (height, '
            f'width, channels); got {input_shape!r}.') from None
    if len(shape) != 3:
        raise ValueError(
            'input_shape must have rank 3 (height, width, channels); got '
            f'{input_shape!r} of rank {len(shape)}.')
    for dim in shape:
        # bool is an int subclass, but True as a dimension is surely a slip.
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(
                'input_shape entries must be ints >= 1 (height, width, '
                f'channels); got {input_shape!r}.')
    return shape


def _check_num_classes(num_classes: int) -> int:
    if (isinstance(num_classes, bool) or not isinstance(num_classes, int)
            or num_classes < 2):
        raise ValueError(
            f'num_classes must be an int >= 2; got {num_classes!r}.')
    return num_classes


def small_cnn(input_shape: Sequence[int] = (32, 32, 3),
              num_classes: int = 10,
              padding: str = 'valid',
              name: str = 'small_cnn') -> tf.keras.Model:
    """Conv(16)-Pool-Conv(32)-Pool-Dense(64)-Dense(num_classes), ReLU.

    Conv2D(16, 3, relu) - MaxPool2D(2) - Conv2D(32, 3, relu) - MaxPool2D(2)
    - Flatten - Dense(64, relu) - Dense(num_classes) (logits).

    With the default padding='valid', a 32x32x3 input with 10 classes gives
    exactly 79,530 parameters: 448 + 4,640 (convs) + 73,792 (6*6*32 -> 64)
    + 650 (64 -> 10). Conv parameters do not depend on padding but the first
    Dense does (padding='same' keeps 8*8*32 features: 136,874 in all), so
    'valid' is the default. 'valid' needs height and width >= 10; small
    inputs such as 8x8x1 digits need padding='same'.

    Args:
      input_shape: (height, width, channels) of one example.
      num_classes: number of logits, >= 2.
      padding: 'valid' or 'same', for both convolutions.
      name: the model's name.

    Raises:
      ValueError: naming the argument that is out of range, including an
        input too small for `padding`.
    """
    height, width, _ = _check_input_shape(input_shape)
    _check_num_classes(num_classes)
    if padding not in _PADDINGS:
        raise ValueError(
            f"padding must be one of {_PADDINGS}; got {padding!r}.")
    # Spatial size after conv(3) - pool(2) - conv(3) - pool(2); checking it
    # here turns Keras' opaque "negative dimension" error into one that
    # names the fix.
    shrink = 2 if padding == 'valid' else 0
    final = [((s - shrink) // 2 - shrink) // 2 for s in (height, width)]
    if min(final) < 1:
        raise ValueError(
            f'input_shape {tuple(input_shape)!r} is too small for '
            f"padding={padding!r}: height and width must be >= "
            f"{10 if padding == 'valid' else 4}. Use padding='same' for "
            'small inputs such as 8x8 digits.')

    inputs = tf.keras.Input(shape=tuple(input_shape), name='image')
    x = tf.keras.layers.Conv2D(16, 3, padding=padding, activation='relu',
                               name='conv1')(inputs)
    x = tf.keras.layers.MaxPool2D(2, name='pool1')(x)
    x = tf.keras.layers.Conv2D(32, 3, padding=padding, activation='relu',
                               name='conv2')(x)
    x = tf.keras.layers.MaxPool2D(2, name='pool2')(x)
    x = tf.keras.layers.Flatten(name='flatten')(x)
    x = tf.keras.layers.Dense(64, activation='relu', name='dense')(x)
    logits = tf.keras.layers.Dense(num_classes, name='logits')(x)
    return tf.keras.Model(inputs, logits, name=name)


def tanh_cnn(input_shape: Sequence[int] = (28, 28, 1),
             num_classes: int = 10,
             name: str = 'tanh_cnn') -> tf.keras.Model:
    """The DP benchmark CNN for (Fashion-)MNIST, with tanh activations.

    Conv2D(16, 8, stride 2, 'same', tanh) - MaxPool2D(2, stride 1)
    - Conv2D(32, 4, stride 2, 'valid', tanh) - MaxPool2D(2, stride 1)
    - Flatten - Dense(32, tanh) - Dense(num_classes) (logits).

    The end-to-end CNN of Tramer & Boneh, "Differentially Private Learning
    Needs Better Features (or Much More Data)", ICLR 2021 (arXiv:2011.11660),
    with the tanh activations of Papernot et al., "Tempered Sigmoid
    Activations for Deep Learning with Differential Privacy", AAAI 2021
    (arXiv:2007.14191): bounded activations keep the gradients small, so
    less of them is lost to clipping. A 28x28x1 input with 10 classes gives
    exactly 26,010 parameters: 1,040 + 8,224 (convs) + 16,416
    (4*4*32 -> 32) + 330 (32 -> 10).

    Args:
      input_shape: (height, width, channels) of one example; height and
        width must be >= 13.
      num_classes: number of logits, >= 2.
      name: the model's name.

    Raises:
      ValueError: naming the argument that is out of range, including an
        input too small for the strided convolutions.
    """
    height, width, _ = _check_input_shape(input_shape)
    _check_num_classes(num_classes)
    # 'same' stride 2 -> ceil(s / 2); pool -> -1; 'valid' 4 stride 2 ->
    # (s - 4) // 2 + 1; pool -> -1. Checked here for a clear message.
    final = [((-(-s // 2) - 1) - 4) // 2 + 1 - 1 for s in (height, width)]
    if min(final) < 1:
        raise ValueError(
            f'input_shape {tuple(input_shape)!r} is too small for tanh_cnn: '
            'height and width must be >= 13.')

    inputs = tf.keras.Input(shape=tuple(input_shape), name='image')
    x = tf.keras.layers.Conv2D(16, 8, strides=2, padding='same',
                               activation='tanh', name='conv1')(inputs)
    x = tf.keras.layers.MaxPool2D(2, strides=1, name='pool1')(x)
    x = tf.keras.layers.Conv2D(32, 4, strides=2, padding='valid',
                               activation='tanh', name='conv2')(x)
    x = tf.keras.layers.MaxPool2D(2, strides=1, name='pool2')(x)
    x = tf.keras.layers.Flatten(name='flatten')(x)
    x = tf.keras.layers.Dense(32, activation='tanh', name='dense')(x)
    logits = tf.keras.layers.Dense(num_classes, name='logits')(x)
    return tf.keras.Model(inputs, logits, name=name)


def _group_norm(groups: int, name: str) -> tf.keras.layers.Layer:
    # Statistics over channel groups of a single example: no batch mixing,
    # so per-example gradients stay well defined (unlike BatchNorm).
    return tf.keras.layers.GroupNormalization(groups=groups, name=name)


def _conv(filters: int, kernel_size: int, strides: int,
          name: str) -> tf.keras.layers.Layer:
    # No bias: every conv feeds a GroupNormalization whose shift (beta)
    # would cancel a conv bias anyway.
    return tf.keras.layers.Conv2D(
        filters, kernel_size, strides=strides, padding='same',
        use_bias=False, kernel_initializer='he_normal', name=name)


def _basic_block(x: tf.Tensor, filters: int, strides: int, groups: int,
                 name: str) -> tf.Tensor:
    """conv-GN-ELU-conv-GN, + shortcut, GN, ELU."""
    y = _conv(filters, 3, strides, f'{name}_conv1')(x)
    y = _group_norm(groups, f'{name}_gn1')(y)
    y = tf.keras.layers.ELU(name=f'{name}_elu1')(y)
    y = _conv(filters, 3, 1, f'{name}_conv2')(y)
    y = _group_norm(groups, f'{name}_gn2')(y)
    shortcut = x
    if strides != 1 or x.shape[-1] != filters:
        # Projection (option B) only where the shape changes.
        shortcut = _conv(filters, 1, strides, f'{name}_proj')(x)
        shortcut = _group_norm(groups, f'{name}_proj_gn')(shortcut)
    y = tf.keras.layers.Add(name=f'{name}_add')([y, shortcut])
    # Normalising after the addition keeps the residual stream's scale in
    # check under DP noise (ScaleNorm, Klause et al. 2022).
    y = _group_norm(groups, f'{name}_gn_out')(y)
    return tf.keras.layers.ELU(name=f'{name}_elu_out')(y)


def resnet22(input_shape: Sequence[int] = (32, 32, 3),
             num_classes: int = 10,
             groups: int = 4,
             name: str = 'resnet22') -> tf.keras.Model:
    """ResNet22 with GroupNorm and ELU, as trained on CIFAR-10 and SVHN.

    The paper gives only the name and the size, d = 291,898 parameters for
    10 classes; GroupNorm, ELU and bias-free convs follow the DP ResNets of
    the literature. The layout below is the CIFAR ResNet of He et al. that
    has exactly that size:

    * stem: 3x3 conv (16) - GN - ELU;
    * three stages of basic blocks, RESNET22_BLOCKS = (3, 4, 3) blocks with
      RESNET22_WIDTHS = (16, 32, 64) channels, the first block of stages 2
      and 3 striding by 2; 22 weighted layers = stem + 2 * 10 block convs
      + the classifier (1x1 projections are not counted, as in He et al.);
    * block: 3x3 conv - GN - ELU - 3x3 conv - GN, plus the shortcut
      (identity, or 1x1 stride-2 conv - GN where the shape changes), then
      GN after the addition and ELU;
    * head: GN - global average pooling - Dense(num_classes) (logits).

    Every conv is bias-free; every GN is affine (scale and shift per
    channel). Parameter count, 10 classes:

      stem             432 conv +  32 GN             =     464
      stage 1 (16)  3 x (4,608 conv + 96 GN)         =  14,112
      stage 2 (32)  13,824 + 512 proj + 64 + 192 GN
                    + 3 x (18,432 + 192)             =  70,464
      stage 3 (64)  55,296 + 2,048 proj + 128 + 384
                    + 2 x (73,728 + 384)             = 206,080
      head GN 128 + Dense 64 * 10 + 10               =     778
      total                                          = 291,898

    Among 3-stage 16/32/64 layouts with 10 basic blocks (pre- or
    post-activation; zero-padding, needed-only or every-stage 1x1
    shortcuts; each of the stem, shortcut, post-addition and head GNs
    present or not), this is the only one with 291,898 parameters.

    Args:
      input_shape: (height, width, channels) of one example.
      num_classes: number of logits, >= 2.
      groups: GroupNorm groups; must divide 16 (the narrowest stage), so
        one of 1, 2, 4, 8, 16. The count does not depend on it.
      name: the model's name.

    Raises:
      ValueError: naming the argument that is out of range.
    """
    _check_input_shape(input_shape)
    _check_num_classes(num_classes)
    narrowest = min(RESNET22_WIDTHS)
    if (isinstance(groups, bool) or not isinstance(groups, int)
            or groups < 1 or narrowest % groups):
        raise ValueError(
            f'groups must be an int dividing {narrowest} (one of 1, 2, 4, '
            f'8, 16); got {groups!r}.')

    inputs = tf.keras.Input(shape=tuple(input_shape), name='image')
    x = _conv(RESNET22_WIDTHS[0], 3, 1, 'stem_conv')(inputs)
    x = _group_norm(groups, 'stem_gn')(x)
    x = tf.keras.layers.ELU(name='stem_elu')(x)
    for stage, (blocks, filters) in enumerate(
            zip(RESNET22_BLOCKS, RESNET22_WIDTHS), start=1):
        for block in range(blocks):
            strides = 2 if stage > 1 and block == 0 else 1
            x = _basic_block(x, filters, strides, groups,
                             f'stage{stage}_block{block + 1}')
    x = _group_norm(groups, 'head_gn')(x)
    x = tf.keras.layers.GlobalAveragePooling2D(name='pool')(x)
    logits = tf.keras.layers.Dense(num_classes, name='logits')(x)
    return tf.keras.Model(inputs, logits, name=name)


def _input_norm_groups(channels: int, groups) -> int:
    """GroupNormalization groups for an input of `channels` channels."""
    if groups is None:
        # Tramer & Boneh: 27 groups of 3 over the 81 scattering channels.
        return channels // 3 if channels % 3 == 0 else 1
    if (isinstance(groups, bool) or not isinstance(groups, int)
            or groups < 1 or channels % groups):
        raise ValueError(f'groups must be an int >= 1 dividing the '
                         f'{channels} input channels; got {groups!r}.')
    return groups


def _input_norm(channels: int, groups) -> tf.keras.layers.Layer:
    # Per example and without learned scale or shift (affine=False in Tramer
    # & Boneh): the features' scale is fixed without any statistic of the
    # private data, and the model stays linear in its weights.
    # epsilon 1e-5 as in PyTorch's GroupNorm (Tramer & Boneh's): the
    # scattering coefficients' variances per group are 1e-6 to 1e-2, and
    # Keras's default 1e-3 would flatten the second-order ones.
    return tf.keras.layers.GroupNormalization(
        groups=_input_norm_groups(channels, groups), center=False,
        scale=False, epsilon=1e-5, name='input_norm')


def linear(input_shape: Sequence[int] = (7, 7, 81),
           num_classes: int = 10,
           groups=None,
           name: str = 'linear') -> tf.keras.Model:
    """GroupNormalization (no parameters) - Flatten - Dense(num_classes).

    Tramer & Boneh's "ScatterNet + linear" model (ICLR 2021,
    arXiv:2011.11660, Table 1: 89.7 % on Fashion-MNIST at epsilon 3): a
    linear classifier on the 81 x 7 x 7 scattering features of a 28x28
    image, each example's features normalised in 27 groups of 3 channels.
    With those features and 10 classes it has 39,700 parameters.

    Args:
      input_shape: (height, width, channels) of one example's features.
      num_classes: number of logits, >= 2.
      groups: groups of the input normalisation; must divide the channels.
        Default: channels / 3 when 3 divides them (27 for 81), else 1.
      name: the model's name.

    Raises:
      ValueError: naming the argument that is out of range.
    """
    _, _, channels = _check_input_shape(input_shape)
    _check_num_classes(num_classes)
    norm = _input_norm(channels, groups)
    inputs = tf.keras.Input(shape=tuple(input_shape), name='features')
    x = tf.keras.layers.Flatten(name='flatten')(norm(inputs))
    logits = tf.keras.layers.Dense(num_classes, name='logits')(x)
    return tf.keras.Model(inputs, logits, name=name)


def feature_cnn(input_shape: Sequence[int] = (7, 7, 81),
                num_classes: int = 10,
                groups=None,
                name: str = 'feature_cnn') -> tf.keras.Model:
    """A small tanh CNN head on handcrafted features.

    GroupNormalization (no parameters) - Conv2D(32, 3, 'same', tanh)
    - MaxPool2D(2) - Conv2D(32, 3, 'same', tanh) - Flatten
    - Dense(num_classes) (logits). After Tramer & Boneh's "ScatterNet + CNN"
    (ICLR 2021, arXiv:2011.11660): a shallow CNN with tanh activations
    (Papernot et al., arXiv:2007.14191) on the scattering features. On 81 x
    7 x 7 features with 10 classes: 23,328 + 32 + 9,216 + 32 + 2,890 =
    35,498 parameters.

    Args:
      input_shape: (height, width, channels) of one example's features;
        height and width must be >= 2.
      num_classes: number of logits, >= 2.
      groups: groups of the input normalisation (as in `linear`).
      name: the model's name.

    Raises:
      ValueError: naming the argument that is out of range.
    """
    height, width, channels = _check_input_shape(input_shape)
    _check_num_classes(num_classes)
    if min(height, width) < 2:
        raise ValueError(f'input_shape {tuple(input_shape)!r} is too small '
                         'for feature_cnn: height and width must be >= 2.')
    norm = _input_norm(channels, groups)
    inputs = tf.keras.Input(shape=tuple(input_shape), name='features')
    x = tf.keras.layers.Conv2D(32, 3, padding='same', activation='tanh',
                               name='conv1')(norm(inputs))
    x = tf.keras.layers.MaxPool2D(2, name='pool1')(x)
    x = tf.keras.layers.Conv2D(32, 3, padding='same', activation='tanh',
                               name='conv2')(x)
    x = tf.keras.layers.Flatten(name='flatten')(x)
    logits = tf.keras.layers.Dense(num_classes, name='logits')(x)
    return tf.keras.Model(inputs, logits, name=name)


MODELS: Dict[str, Callable[..., tf.keras.Model]] = {
    'small_cnn': small_cnn,
    'resnet22': resnet22,
    'tanh_cnn': tanh_cnn,
    'linear': linear,
    'feature_cnn': feature_cnn,
}


def build_model(name: str, **kwargs) -> tf.keras.Model:
    """Builds the model registered under `name` in MODELS.

    Keyword arguments go to the builder (input_shape, num_classes, ...).

    Raises:
      ValueError: if `name` is not one of MODELS.
    """
    if name not in MODELS:
        raise ValueError(
            f'name must be one of {sorted(MODELS)}; got {name!r}.')
    return MODELS[name](**kwargs)
