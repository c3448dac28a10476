"""One record changes the released sum only through its own contribution.

A record with a NaN, inf or huge (1e38: finite, but it overflows inside the
network, e.g. through GroupNorm) feature, with sample weight 1 or 0, must
leave every other record's clipped masked contribution unchanged, on both
training paths (DPModel with its own mechanism, and DPModel compiled with a
tf_twice DP optimizer), for the reference CNN, ResNet22 and the ScatterNet
linear model (GroupNorm - Dense). With noise 0 the update of a batch holding
the bad record, minus the update of the same batch with that record's weight
set to 0, is the bad record's own contribution: 0 when its gradient is
non-finite or its weight is 0, and of l2 norm at most lr * c2 / (B_exp * q2)
otherwise. Per-example gradients from one batched forward pass fail this:
0 * NaN = NaN spreads the bad row to every row.
"""

import numpy as np
import pytest
import tensorflow as tf

from tests import markers
from tests import tiny_models

from tf_twice import models
from tf_twice import optimizers
from tf_twice.config import TwiceSamplingConfig
from tf_twice.keras import DPModel
from tf_twice.keras import per_example

LR, C2, Q2, B_EXP = 1.0, 0.01, 0.5, 4.0
# An l-infinity clip well below c2 (d0 = 16): where a non-finite row were
# only scaled by 0, XLA's clamp on TensorFlow 2.15 would turn each of its
# NaN coordinates into +-c_inf, a finite update that only the bound on a
# record's own contribution catches (an inf pixel: about 20x the bound);
# 2.21's clamp keeps NaN, which the weight-0 comparison catches.
C_INF = C2 / 4


def _config(linf_norm_clip=None):
    # Noise 0: not private, it isolates the clipped masked sum for the test.
    return TwiceSamplingConfig.single(
        num_examples=100, expected_batch_size=B_EXP, l2_norm_clip=C2,
        linf_norm_clip=linf_norm_clip, noise_multiplier=0.0,
        coordinate_sampling_rate=Q2, non_private=True)


SEED = 5
BAD_ROW = 2
BAD_VALUES = {'nan': np.nan, 'inf': np.inf, 'huge': 1e38}


PATHS = ['model', pytest.param('optimizer',
                               marks=markers.needs_tf_privacy_optimizers)]


def _private(inner, path, linf_norm_clip=None):
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    config = _config(linf_norm_clip)
    if path == 'model':
        dp = DPModel(inner, config, physical_batch_size=3, seed=SEED)
        dp.compile(optimizer=tf.keras.optimizers.SGD(LR), loss=loss)
    else:
        dp = DPModel(inner, physical_batch_size=3)
        dp.compile(optimizer=optimizers.TwiceSamplingDPKerasSGDOptimizer(
            config, learning_rate=LR, seed=SEED), loss=loss)
    return dp


def _update(dp, initial, x, y, w):
    """The weight change of one noiseless step from ``initial``, with the
    same step key (so the same masks) every time."""
    dp.set_weights(initial)
    dp.aggregator.keys.set_state(tiny_models.FIXED_KEY_STATE)
    tiny_models.one_step(dp, x, y, w)
    return np.concatenate([(a - b).ravel() for a, b in
                           zip(dp.get_weights(), initial)])


def _check_isolation(dp, x, y):
    initial = dp.get_weights()
    weights = np.ones(len(x), np.float32)
    without_bad = weights.copy()
    without_bad[BAD_ROW] = 0.0
    reference = _update(dp, initial, x, y, without_bad)
    # The clean rows really move the weights, by more than one record could.
    assert np.linalg.norm(reference) > LR * C2 / (B_EXP * Q2)
    own_bound = LR * C2 / (B_EXP * Q2) * (1 + 1e-4)
    for name, value in BAD_VALUES.items():
        bad_x = x.copy()
        bad_x[BAD_ROW, 0, 0, 0] = value
        # Weight 0: the record is padding, it contributes nothing at all.
        np.testing.assert_allclose(
            _update(dp, initial, bad_x, y, without_bad), reference,
            rtol=1e-5, atol=1e-8, err_msg=f'{name} row with weight 0')
        # Weight 1: only its own clipped contribution (none if non-finite).
        got = _update(dp, initial, bad_x, y, weights)
        assert np.all(np.isfinite(got)), name
        own = got - reference
        assert np.linalg.norm(own) <= own_bound, name
        if name != 'huge':  # A non-finite gradient is dropped.
            np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-8,
                                       err_msg=f'{name} row with weight 1')


def _images(n, shape, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n,) + shape).astype(np.float32)
    return x, rng.integers(0, 10, n)


@pytest.mark.parametrize('linf_norm_clip', [None, C_INF])
@pytest.mark.parametrize('path', PATHS)
def test_small_cnn_rows_are_isolated(path, linf_norm_clip):
    x, y = _images(7, (8, 8, 1))
    inner = models.small_cnn((8, 8, 1), padding='same')
    _check_isolation(_private(inner, path, linf_norm_clip), x, y)


def test_resnet22_rows_are_isolated(monkeypatch):
    # On the model's path only: both paths run DPModel's per-example pass
    # (what the architecture shapes); the optimizer path's aggregation is
    # checked on the small CNN and the linear model. One block per stage:
    # every kind of layer and shortcut of ResNet22 (stem, identity and
    # strided projection shortcuts, GroupNorm, ELU, pooled head), traced
    # in 15 s instead of 41 s.
    monkeypatch.setattr(models, 'RESNET22_BLOCKS', (1, 1, 1))
    x, y = _images(4, (16, 16, 3))
    inner = models.resnet22((16, 16, 3))
    _check_isolation(_private(inner, 'model'), x, y)


@pytest.mark.parametrize('linf_norm_clip', [None, C_INF])
@pytest.mark.parametrize('path', PATHS)
def test_linear_model_rows_are_isolated(path, linf_norm_clip):
    # GroupNorm - Dense: the kernel's gradients are aggregated from their
    # factors (norms, the float64 sum, the grouped clip-mask-sum kernel).
    x, y = _images(7, (4, 4, 6))
    inner = models.linear((4, 4, 6), groups=2)
    _check_isolation(_private(inner, path, linf_norm_clip), x, y)


def _sparse_ce_function(y_true, y_pred):
    return tf.keras.losses.sparse_categorical_crossentropy(
        y_true, y_pred, from_logits=True)


@pytest.mark.parametrize('label', [10, -1])
@pytest.mark.parametrize('loss', ['object', 'function', 'float_labels'])
def test_a_label_out_of_range_contributes_nothing(label, loss):
    # It neither aborts the step (which would reveal that the record was
    # sampled, with every label of the batch in the error) nor touches the
    # other rows, whatever loss reads the labels.
    x, y = _images(7, (8, 8, 1))
    dp = _private(models.small_cnn((8, 8, 1), padding='same'), 'model')
    if loss == 'function':
        dp.compile(optimizer=tf.keras.optimizers.SGD(LR),
                   loss=_sparse_ce_function)
    if loss == 'float_labels':  # Class indices stored as floats.
        y = y.astype(np.float32)
    _assert_bad_label_contributes_nothing(dp, dp.get_weights(), x, y, label)


def _assert_bad_label_contributes_nothing(dp, initial, x, y, label):
    """The update with row BAD_ROW's label set to ``label`` equals the
    update without that row; returns the labels with the bad one."""
    without_bad = np.ones(len(x), np.float32)
    without_bad[BAD_ROW] = 0.0
    reference = _update(dp, initial, x, y, without_bad)
    bad_y = y.copy()
    bad_y[BAD_ROW] = label
    got = _update(dp, initial, x, bad_y, np.ones(len(x), np.float32))
    np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-8)
    return bad_y


@pytest.mark.parametrize('label', [10, -1])
def test_a_label_out_of_range_does_not_abort_a_compiled_metric(label):
    # Keras's sparse cross-entropy metric reads the raw labels: it aborted
    # the step that sampled the record (revealing that it was sampled) on
    # Keras 2 and 3. The metrics skip that row, as the loss does.
    x, y = _images(7, (8, 8, 1))
    dp = _private(models.small_cnn((8, 8, 1), padding='same'), 'model')
    dp.compile(optimizer=tf.keras.optimizers.SGD(LR),
               loss=tf.keras.losses.SparseCategoricalCrossentropy(
                   from_logits=True),
               metrics=[tf.keras.metrics.SparseCategoricalCrossentropy(
                   from_logits=True, name='xent')])
    initial = dp.get_weights()
    bad_y = _assert_bad_label_contributes_nothing(dp, initial, x, y, label)
    # Evaluation too: the metric is that of the other rows.
    dp.set_weights(initial)
    clean = np.arange(len(x)) != BAD_ROW
    expected = dp.evaluate(x[clean], y[clean], verbose=0, return_dict=True)
    result = dp.evaluate(x, bad_y, verbose=0, return_dict=True)
    np.testing.assert_allclose(result['xent'], expected['xent'], rtol=1e-5)


def _ignore_class_loss():
    return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                         ignore_class=-1)


def test_entries_of_the_loss_ignore_class_carry_no_loss():
    # Sequence labels padded with ignore_class: each example's loss is
    # Keras's over its own other entries; one all padding has loss 0; a
    # label outside the classes still makes its example's loss NaN. (The
    # padding made the whole example NaN, i.e. dropped.)
    keras_loss = _ignore_class_loss()
    y = tf.constant([[1, -1, 2], [-1, -1, -1], [0, 3, 3], [1, 10, -1]])
    logits = tf.random.stateless_normal([4, 3, 4], seed=[1, 2])
    got = per_example.loss_fn(keras_loss)(y, logits).numpy()
    for i in (0, 2):
        np.testing.assert_allclose(
            got[i], keras_loss(y[i:i + 1], logits[i:i + 1]).numpy(),
            rtol=1e-6)
    assert got[1] == 0.0 and np.isnan(got[3])


def test_a_padded_sequence_example_trains():
    # With noise 0 the padded example's own contribution moves the
    # weights; one all padding contributes nothing.
    inner = tf.keras.Sequential([tf.keras.layers.Embedding(6, 4),
                                 tf.keras.layers.Dense(4)])
    inner.build((None, 3))
    dp = DPModel(inner, _config(), physical_batch_size=3, seed=SEED)
    dp.compile(optimizer=tf.keras.optimizers.SGD(LR),
               loss=_ignore_class_loss())
    x = np.array([[1, 2, 3], [4, 5, 0], [2, 2, 1], [3, 0, 0]])
    y = np.array([[0, 1, 2], [3, 0, 1], [1, -1, -1], [-1, -1, -1]])
    initial = dp.get_weights()
    weights = np.ones(len(x), np.float32)
    without = {row: _update(dp, initial, x, y, np.where(
        np.arange(len(x)) == row, 0.0, 1.0).astype(np.float32))
        for row in (2, 3)}
    every = _update(dp, initial, x, y, weights)
    assert np.linalg.norm(every - without[2]) > 1e-6  # Padded: trains.
    np.testing.assert_allclose(every, without[3], rtol=1e-5, atol=1e-8)


def test_a_batched_jacobian_is_not_isolated():
    # Why the optimizer path runs per example: tf_privacy's construction
    # (a Jacobian of the per-example losses of ONE batched forward pass)
    # turns every row non-finite when one input is NaN.
    x, y = _images(4, (8, 8, 1))
    x[BAD_ROW, 0, 0, 0] = np.nan
    inner = models.small_cnn((8, 8, 1), padding='same')
    loss = tf.keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction='none')
    with tf.GradientTape() as tape:
        losses = loss(y, inner(x, training=True))
    jacobian = tape.jacobian(losses, inner.trainable_variables[0])
    rows = tf.reshape(jacobian, [len(x), -1]).numpy()
    assert not np.isfinite(rows).all(axis=1).any()


if __name__ == '__main__':
    raise SystemExit(pytest.main([__file__]))
