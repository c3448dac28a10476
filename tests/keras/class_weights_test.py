"""`fit(class_weight=...)` applied by tf_twice as per-example weights."""

import numpy as np
import pytest
import tensorflow as tf

from tests import tiny_models
from tf_twice.keras import class_weights
from tf_twice.keras import DPModel

CLASS_WEIGHT = {0: 1.0, 2: 0.25}  # Class 1 (and 7) has no weight: 0.


def test_table_is_dense_with_zero_for_missing_classes():
    np.testing.assert_array_equal(
        class_weights.class_weight_table(CLASS_WEIGHT), [1.0, 0.0, 0.25])


@pytest.mark.parametrize('class_weight, message', [
    ({0: 1.5}, r'class_weight\[0\] must be finite and in \[0, 1\]'),
    ({0: float('nan')}, r'class_weight\[0\] must be finite'),
    ({-1: 1.0}, r'keys must be class indices'),
    ({'cat': 1.0}, r'keys must be class indices'),
    ({True: 1.0}, r'keys must be class indices'),
    ({}, r'non-empty dict'),
    ([1.0, 0.5], r'non-empty dict'),
])
def test_invalid_class_weight_is_refused(class_weight, message):
    with pytest.raises(ValueError, match=message):
        class_weights.class_weight_table(class_weight)


@pytest.mark.parametrize('labels', [
    np.array([0, 1, 2, 7, -3]),
    np.array([[0], [1], [2], [7], [-3]]),
])
def test_dataset_weights_are_the_class_weights_and_0_outside(labels):
    data = tf.data.Dataset.from_tensors((tf.zeros([5, 2]), labels))
    x, args, kwargs = class_weights.apply_class_weight(
        data, None, (), {'class_weight': CLASS_WEIGHT})
    assert 'class_weight' not in kwargs and args == ()
    _, _, weights = next(iter(x))
    np.testing.assert_array_equal(weights.numpy(), [1.0, 0.0, 0.25, 0.0, 0.0])


def test_one_hot_labels_and_given_weights_multiply():
    one_hot = np.eye(3, dtype=np.float32)[[2, 0, 1]]
    given = np.array([0.5, 0.5, 1.0], np.float32)
    data = tf.data.Dataset.from_tensors((tf.zeros([3, 2]), one_hot, given))
    x, _, _ = class_weights.apply_class_weight(
        data, None, (), {'class_weight': CLASS_WEIGHT})
    _, _, weights = next(iter(x))
    np.testing.assert_allclose(weights.numpy(), [0.125, 0.5, 0.0])


def test_arrays_get_sample_weight_positional_or_keyword():
    x = np.zeros([4, 2], np.float32)
    y = np.array([0, 1, 2, 2])
    _, _, kwargs = class_weights.apply_class_weight(
        x, y, (), {'class_weight': CLASS_WEIGHT,
                   'sample_weight': np.array([1, 1, 1, 0.5], np.float32)})
    np.testing.assert_allclose(kwargs['sample_weight'],
                               [1.0, 0.0, 0.25, 0.125])
    # fit(x, y, batch, epochs, verbose, callbacks, validation_split,
    # validation_data, shuffle, class_weight, sample_weight).
    _, args, _ = class_weights.apply_class_weight(
        x, y, (0.0, None, False, CLASS_WEIGHT, None), {})
    assert args[3] is None
    np.testing.assert_allclose(args[4], [1.0, 0.0, 0.25, 0.25])


def test_input_without_reachable_labels_is_refused():
    with pytest.raises(ValueError, match=r'class_weight works with'):
        class_weights.apply_class_weight(
            iter([]), None, (), {'class_weight': CLASS_WEIGHT})


@pytest.mark.parametrize('labels', [
    {'a': np.array([0, 1]), 'b': np.array([1, 0])},
    (np.array([0, 1]), np.array([1, 0])),
])
def test_labels_of_several_outputs_are_refused_by_name(labels):
    # Dataset and arrays alike: a ValueError naming class_weight, not a
    # TypeError from inside TensorFlow (dict) or a silent argmax over the
    # outputs (tuple of equal-length label arrays).
    data = tf.data.Dataset.from_tensors((tf.zeros([2, 2]), labels))
    for x, y in ((data, None), (np.zeros([2, 2], np.float32), labels)):
        with pytest.raises(ValueError, match=r'class_weight applies to a '
                           r'model with one output'):
            class_weights.apply_class_weight(
                x, y, (), {'class_weight': CLASS_WEIGHT})


def test_labels_as_a_python_list_are_one_output():
    _, _, kwargs = class_weights.apply_class_weight(
        np.zeros([3, 2], np.float32), [0, 1, 2], (),
        {'class_weight': CLASS_WEIGHT})
    np.testing.assert_array_equal(kwargs['sample_weight'], [1.0, 0.0, 0.25])


def test_no_class_weight_leaves_fit_arguments_alone():
    data = tf.data.Dataset.from_tensors((tf.zeros([1, 2]), [0]))
    x, args, kwargs = class_weights.apply_class_weight(
        data, None, (0.0,), {'sample_weight': None})
    assert x is data and args == (0.0,) and kwargs == {'sample_weight': None}


def _seeded_model():
    dp = DPModel(tiny_models.linear(), tiny_models.dp_config(
        expected_batch_size=8.0, num_examples=64, coordinate_sampling_rate=0.5,
        linf_norm_clip=0.5), physical_batch_size=8, seed=5)
    dp.compile(optimizer=tf.keras.optimizers.SGD(1.0),
               loss=tf.keras.losses.SparseCategoricalCrossentropy(
                   from_logits=True))
    return dp


def test_dp_model_step_with_class_weight_is_the_step_with_those_weights():
    x, y = tiny_models.data(8, seed=4)
    y[0] = 7  # No class weight: Keras 2's own lookup would abort the step.
    weighted = _seeded_model()
    weighted.fit(tf.data.Dataset.from_tensors((x, y)), verbose=0,
                 class_weight=CLASS_WEIGHT)
    explicit = _seeded_model()
    weights = class_weights.class_weight_table(CLASS_WEIGHT)
    per_example = np.array([weights[c] if 0 <= c < 3 else 0.0 for c in y],
                           np.float32)
    tiny_models.one_step(explicit, x, y, per_example)
    for a, b in zip(weighted.get_weights(), explicit.get_weights()):
        np.testing.assert_array_equal(a, b)
    unweighted = _seeded_model()
    tiny_models.one_step(unweighted, x, y)
    assert not all(np.array_equal(a, b) for a, b in zip(
        weighted.get_weights(), unweighted.get_weights()))
