"""A layer that writes statistics of its inputs into its state is refused."""

import numpy as np
import pytest
import tensorflow as tf

from tests import tiny_models

from tf_twice.keras import layer_state


class RunningMean(tf.keras.layers.Layer):
    """Keeps a running mean of its inputs: BatchNormalization's leak under
    another name."""

    def build(self, input_shape):
        self.mean = self.add_weight(name='running_mean',
                                    shape=(input_shape[-1],),
                                    initializer='zeros', trainable=False)

    def call(self, inputs, training=None):
        if training:
            self.mean.assign(0.9 * self.mean
                             + 0.1 * tf.reduce_mean(inputs, axis=0))
        return inputs


class InferenceMean(RunningMean):
    """Writes the running mean in inference mode only, which evaluate,
    predict and calling a DPModel run, on private data too."""

    def call(self, inputs, training=None):
        return super().call(inputs, training=not training)


class TrainableStatistic(tf.keras.layers.Layer):
    """Writes its inputs' mean into a trainable weight, in a model that has
    no non-trainable variable."""

    def build(self, input_shape):
        self.stat = self.add_weight(name='stat', shape=(input_shape[-1],),
                                    initializer='zeros', trainable=True)

    def call(self, inputs, training=None):
        if training:
            self.stat.assign(tf.reduce_mean(inputs, axis=0))
        return inputs + 0.0 * self.stat


class Counter(tf.keras.layers.Layer):
    """Counts its training calls: state that does not depend on the data."""

    def build(self, input_shape):
        self.calls = self.add_weight(name='calls', shape=(),
                                     initializer='zeros', trainable=False)

    def call(self, inputs, training=None):
        if training:
            self.calls.assign_add(1.0)
        return inputs


def _model(extra):
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential(
        [extra, tf.keras.layers.Dense(tiny_models.NUM_CLASSES)])
    model.build((None, tiny_models.NUM_FEATURES))
    return model


def _dp(inner):
    dp = tiny_models.dp_model(inner, expected_batch_size=4.0,
                              num_examples=16, seed=1)
    dp.compile(optimizer=tf.keras.optimizers.SGD(0.1),
               loss=tf.keras.losses.SparseCategoricalCrossentropy(
                   from_logits=True))
    return dp


def test_a_running_mean_under_another_name_is_refused_before_any_step():
    inner = _model(RunningMean(name='my_stats'))
    dp = _dp(inner)
    kernel = inner.trainable_variables[0].numpy()
    x, y = tiny_models.data(8, seed=2)
    with pytest.raises(ValueError, match=r"my_stats.*running_mean.*PUBLIC"):
        dp.fit(tf.data.Dataset.from_tensors((x, y)), verbose=0)
    # Nothing ran and the probe left no trace in the state.
    assert int(dp.optimizer.iterations.numpy()) == 0
    np.testing.assert_array_equal(inner.trainable_variables[0].numpy(),
                                  kernel)
    np.testing.assert_array_equal(inner.non_trainable_variables[0].numpy(),
                                  np.zeros(tiny_models.NUM_FEATURES))


def test_a_statistic_written_in_inference_mode_only_is_refused():
    # A probe of training mode alone let it train; predict on private data
    # then wrote their mean into the state.
    inner = _model(InferenceMean(name='at_inference'))
    dp = _dp(inner)
    x, y = tiny_models.data(8, seed=2)
    with pytest.raises(ValueError,
                       match=r"at_inference.*running_mean.*inference mode"):
        dp.fit(tf.data.Dataset.from_tensors((x, y)), verbose=0)
    assert int(dp.optimizer.iterations.numpy()) == 0
    np.testing.assert_array_equal(inner.non_trainable_variables[0].numpy(),
                                  np.zeros(tiny_models.NUM_FEATURES))


def test_state_that_does_not_depend_on_the_inputs_is_accepted():
    inner = _model(Counter())
    dp = _dp(inner)
    dp.fit(tf.data.Dataset.from_tensors(tiny_models.data(8, seed=2)),
           verbose=0)
    assert int(dp.optimizer.iterations.numpy()) == 1


def test_dropout_is_accepted_and_the_probe_restores_every_variable():
    inner = _model(tf.keras.layers.Dropout(0.5))
    before = [v.numpy() for v in inner.variables]
    layer_state.check_no_input_dependent_state(
        inner, layer_state.input_spec_of(tiny_models.data(8)[0]))
    for v, b in zip(inner.variables, before):
        np.testing.assert_array_equal(v.numpy(), b)


def test_the_probe_builds_a_model_that_is_not_built_yet():
    inner = tf.keras.Sequential([RunningMean(name='late'),
                                 tf.keras.layers.Dense(2)])
    spec = layer_state.input_spec_of(tf.data.Dataset.from_tensors(
        tiny_models.data(8)))
    with pytest.raises(ValueError, match='late'):
        layer_state.check_no_input_dependent_state(inner, spec)
    assert inner.built


def test_inputs_it_cannot_make_up_are_not_probed():
    inner = _model(RunningMean())
    assert layer_state.input_spec_of(object()) is None
    layer_state.check_no_input_dependent_state(inner, None)
    layer_state.check_no_input_dependent_state(
        inner, tf.TensorSpec([None, None], tf.float32))


def test_a_statistic_written_into_a_trainable_weight_is_refused_and_undone():
    inner = _model(TrainableStatistic(name='sneaky'))
    assert not inner.non_trainable_variables
    before = [v.numpy() for v in inner.variables]
    with pytest.raises(ValueError, match=r"sneaky.*stat"):
        layer_state.check_no_input_dependent_state(
            inner, layer_state.input_spec_of(tiny_models.data(8)[0]))
    for v, b in zip(inner.variables, before):
        np.testing.assert_array_equal(v.numpy(), b)


# --- losses (tf_twice.keras.loss_state) -------------------------------------


class RunningMaxLoss(tf.keras.losses.Loss):
    """Keeps the largest loss it has seen and scales later losses by it: one
    record then changed another step's sum by 38.6x the clip."""

    def __init__(self):
        super().__init__(reduction='none', name='running_max')
        self.running = tf.Variable(0.0, trainable=False)

    def call(self, y_true, y_pred):
        losses = tf.keras.losses.sparse_categorical_crossentropy(
            y_true, y_pred / (1.0 + self.running), from_logits=True)
        self.running.assign(tf.maximum(self.running,
                                       tf.reduce_max(losses)))
        return losses


SEEN = tf.Variable(0.0, trainable=False)


def _counts_class_zero(y_true, y_pred):
    """Writes a global variable, for some labels only (inside a cond)."""
    tf.cond(tf.reduce_any(tf.equal(y_true, 0)),
            lambda: SEEN.assign_add(1.0), lambda: SEEN.read_value())
    return tf.keras.losses.sparse_categorical_crossentropy(
        y_true, y_pred, from_logits=True)


class FixedTemperatureLoss(tf.keras.losses.Loss):
    """Reads a variable that nothing writes from the data."""

    def __init__(self):
        super().__init__(reduction='none', name='fixed_t')
        self.temperature = tf.Variable(2.0, trainable=False)

    def call(self, y_true, y_pred):
        return tf.keras.losses.sparse_categorical_crossentropy(
            y_true, y_pred / self.temperature, from_logits=True)


def _dp_with_loss(loss):
    inner = _model(tf.keras.layers.Dense(tiny_models.NUM_FEATURES))
    dp = tiny_models.dp_model(inner, expected_batch_size=4.0,
                              num_examples=16, seed=1)
    dp.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss=loss)
    return dp, inner


@pytest.mark.parametrize('loss, match', [
    (RunningMaxLoss(), r"RunningMaxLoss 'running_max'.*AssignVariableOp.*"
                       r"Variable.*PUBLIC"),
    (_counts_class_zero, r'_counts_class_zero.*AssignAddVariableOp')])
def test_a_loss_that_writes_a_variable_is_refused_before_any_step(
        loss, match):
    dp, inner = _dp_with_loss(loss)
    before = [v.numpy() for v in inner.variables]
    x, y = tiny_models.data(8, seed=2)
    with pytest.raises(ValueError, match=match):
        dp.fit(tf.data.Dataset.from_tensors((x, y)), verbose=0)
    assert int(dp.optimizer.iterations.numpy()) == 0
    for v, b in zip(inner.variables, before):
        np.testing.assert_array_equal(v.numpy(), b)


def test_a_loss_that_only_reads_a_variable_is_accepted():
    dp, _ = _dp_with_loss(FixedTemperatureLoss())
    dp.fit(tf.data.Dataset.from_tensors(tiny_models.data(8, seed=2)),
           verbose=0)
    assert int(dp.optimizer.iterations.numpy()) == 1
