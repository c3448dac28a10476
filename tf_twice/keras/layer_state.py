"""Refuses layers that write statistics of their inputs into their state.

A layer may keep non-trainable variables that its call updates from the
batch it sees (a running mean, a codebook, a counter). Trained on
private examples, such a variable is a noise-free statistic of them, saved
and released with the model and covered by no accountant.
BatchNormalization is refused by name (`guards.check_no_example_mixing`);
this module catches the same pattern under any other name, by behaviour:
the model's forward pass, in training and in inference mode (evaluate,
predict and calling a DPModel run the latter, on private data too), runs
on two different made-up batches (never on training data), each from the
same state, and a variable (trainable or not) that ends up different after
the two depends on the inputs. State that does not (a step counter, Keras 3's dropout seed
generators) ends up equal and is accepted. Every variable is restored
afterwards.

A probe sees what the layer does on these inputs only (two rows, run
eagerly): a layer that writes its state only for some inputs (a rare class,
a threshold) or batch sizes, only when traced, or into a variable the model
does not track (a global captured by a Lambda), can escape it. Such a layer
must not be trained privately.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np
import tensorflow as tf

from tf_twice.keras import guards
from tf_twice.keras import per_example

__all__ = ['check_no_input_dependent_state', 'input_spec_of']


def input_spec_of(x: Any) -> Optional[Any]:
    """The nest of `tf.TensorSpec` of a model's inputs, from what `fit`
    receives (a dataset of (x, y[, w]) batches, or arrays); None if it
    cannot be read without consuming data."""
    if isinstance(x, tf.data.Dataset):
        spec = x.element_spec
        return spec[0] if isinstance(spec, tuple) else None
    try:
        return tf.nest.map_structure(
            lambda t: tf.TensorSpec.from_tensor(tf.convert_to_tensor(t)), x)
    except (TypeError, ValueError):
        return None


def _probe_batch(spec: tf.TensorSpec, which: int) -> Optional[tf.Tensor]:
    """Two rows of made-up data shaped like ``spec``; ``which`` 0 and 1 give
    different values (integers 0 and 1, so that they stay valid indices)."""
    shape = [2] + spec.shape[1:].as_list()
    if spec.dtype.is_floating:
        values = np.random.default_rng(which).standard_normal(shape)
    elif spec.dtype.is_integer or spec.dtype == tf.bool:
        values = np.full(shape, which)
    else:
        return None
    return tf.constant(values, dtype=spec.dtype)


def _owners(model: tf.keras.layers.Layer) -> Dict[int, str]:
    """id(variable) -> path of the innermost layer holding it."""
    owners = {}
    for path, layer in guards.walk_layers(model, model.name):
        for v in getattr(layer, 'weights', []):
            owners[id(v)] = path  # Inner layers come later and win.
    return owners


def check_no_input_dependent_state(model: tf.keras.Model, input_spec: Any,
                                   strategy: Any = None) -> None:
    """Refuses ``model`` if a forward pass, in training or inference mode,
    writes a statistic of its inputs into one of its variables (see the
    module docstring).

    Args:
      model: the model trained privately (built here if it is not yet).
      input_spec: a nest of `tf.TensorSpec` with a leading batch dimension
        (`input_spec_of`); None, or shapes not fully known: not checked.
      strategy: the `tf.distribute` strategy whose scope holds the model's
        variables (None: the default).

    Raises:
      ValueError: naming the layer and the variable.
    """
    specs = tf.nest.flatten(input_spec) if input_spec is not None else []
    if not specs or any(
            not isinstance(s, tf.TensorSpec) or s.shape.rank is None
            or s.shape.rank == 0 or not s.shape[1:].is_fully_defined()
            for s in specs):
        return
    batches = []
    for which in (0, 1):
        tensors = [_probe_batch(s, which) for s in specs]
        if any(t is None for t in tensors):
            return  # Strings and the like: nothing to make up.
        batches.append(tf.nest.pack_sequence_as(input_spec, tensors))
    scope = (strategy or tf.distribute.get_strategy()).scope()
    with scope:
        if not model.built:
            per_example.build(model, batches[0])
        # Trainable variables too: a forward pass never writes them, so a
        # difference there is an input-dependent write as well.
        variables = list(model.variables)
        if not variables:
            return
        saved = [v.numpy() for v in variables]

        def restore():
            for v, value in zip(variables, saved):
                v.assign(value)

        # Inference mode too: evaluate, predict and calling the DPModel run
        # it, on private data as well.
        after = {True: [], False: []}
        try:
            for training, states in after.items():
                for batch in batches:
                    model(batch, training=training)
                    states.append([v.numpy() for v in variables])
                    restore()  # Every probe starts from the same state.
        finally:
            restore()
    owners = _owners(model)
    for training, (first_states, second_states) in after.items():
        for v, first, second in zip(variables, first_states, second_states):
            if not np.array_equal(first, second, equal_nan=True):
                name = getattr(v, 'path', None) or v.name
                mode = 'training' if training else 'inference'
                raise ValueError(
                    f'Layer {owners.get(id(v), model.name)!r} writes its '
                    f'variable {name!r} from its inputs in {mode} mode (two '
                    'made-up batches left it with different values): on '
                    'private data it would be a noise-free statistic of them, '
                    'released with the model and not accounted. Compute it '
                    'from PUBLIC data and freeze it (e.g. give it as a '
                    'constant), or do not update it in call().')
