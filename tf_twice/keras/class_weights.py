"""``fit(class_weight=...)`` applied by tf_twice, as per-example weights.

Keras 2 applies ``class_weight`` with ``tf.gather``, which aborts the step
that samples a record whose label has no weight: the abort reveals that the
record was sampled, a membership leak that no noise covers. Keras 3 refuses
``class_weight`` beside the weights of the Poisson batches. ``DPModel.fit``
therefore takes ``class_weight`` out of Keras's hands: each example's weight
is multiplied by its class's weight, and a label without one gets weight 0
(the example trains nothing, like padding). An example's weight depends on
its own label only and stays in [0, 1], so each example's contribution
stays within the clipping bound and the accounting is unchanged.

Labels are read as Keras reads them: class indices of shape [B] or [B, 1],
or one-hot rows of shape [B, C] (their argmax).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

import numpy as np
import tensorflow as tf

from tf_twice.keras import per_example

__all__ = ['apply_class_weight', 'class_weight_table']

# fit(x, y, batch_size, epochs, verbose, callbacks, *args): the positions of
# class_weight and sample_weight in args (the same on Keras 2 and 3).
_CLASS_WEIGHT_ARG = 3
_SAMPLE_WEIGHT_ARG = 4


def class_weight_table(class_weight: Mapping[Any, Any]) -> np.ndarray:
    """The weights of classes 0..max as a float32 array (0 where missing).

    Raises:
      ValueError: not a dict, a key that is not a class index >= 0, or a
        weight outside [0, 1] or non-finite.
    """
    if not isinstance(class_weight, Mapping) or not class_weight:
        raise ValueError('class_weight must be a non-empty dict {class index: '
                         f'weight in [0, 1]}}; got {class_weight!r}.')
    for key in class_weight:
        if isinstance(key, (bool, np.bool_)) or not isinstance(
                key, (int, np.integer)) or key < 0:
            raise ValueError('class_weight\'s keys must be class indices, '
                             f'integers >= 0; got {key!r}.')
    table = np.zeros([int(max(class_weight)) + 1], np.float32)
    for key, weight in class_weight.items():
        weight = float(weight)
        if not 0.0 <= weight <= 1.0:  # Also rejects NaN.
            raise ValueError(f'class_weight[{key}] {per_example.WEIGHT_RANGE}; '
                             f'got {weight}.')
        table[int(key)] = weight
    return table


_MULTI_OUTPUT = ('class_weight applies to a model with one output; got labels '
                 'of type {kind} (several outputs). Put the class weights '
                 'into the per-example weights (in [0, 1]) yourself.')


def _classes(y: Any) -> tf.Tensor:
    """Class indices [B] of labels y (indices [B] / [B, 1] or one-hot)."""
    if isinstance(y, Mapping) or (
            isinstance(y, (list, tuple)) and any(np.ndim(part) for part in y)):
        # Keras 2 refuses class_weight for several outputs; so does this.
        raise ValueError(_MULTI_OUTPUT.format(kind=type(y).__name__))
    y = tf.convert_to_tensor(y)
    if y.shape.rank == 2 and y.shape[-1] is not None and y.shape[-1] > 1:
        return tf.argmax(y, axis=-1)
    if y.shape.rank not in (1, 2):
        raise ValueError('class_weight needs labels of shape [B], [B, 1] or '
                         f'one-hot [B, C]; got shape {y.shape}.')
    return tf.cast(tf.reshape(y, [-1]), tf.int64)


def _weights_of(table: np.ndarray, y: tf.Tensor) -> tf.Tensor:
    """Each example's class weight; 0 for a label outside the table.

    No gather is out of range, whatever the label: the step never aborts.
    """
    classes = _classes(y)
    inside = tf.logical_and(classes >= 0, classes < table.shape[0])
    safe = tf.where(inside, classes, tf.zeros_like(classes))
    return tf.where(inside, tf.gather(tf.constant(table), safe),
                    tf.zeros([], tf.float32))


def _weighted_element(table: np.ndarray):
    def weighted(*element):
        if len(element) == 2:
            x, y = element
            return x, y, _weights_of(table, y)
        if len(element) == 3:
            x, y, weight = element
            return x, y, tf.cast(weight, tf.float32) * tf.reshape(
                _weights_of(table, y), tf.shape(weight))
        raise ValueError('class_weight needs dataset elements (x, y) or (x, y, '
                         f'sample_weight); got {len(element)} components.')
    return weighted


def apply_class_weight(x: Any, y: Any, args: Tuple[Any, ...],
                       kwargs: Dict[str, Any]
                       ) -> Tuple[Any, Tuple[Any, ...], Dict[str, Any]]:
    """`fit`'s arguments with ``class_weight`` turned into example weights.

    Returns ``(x, args, kwargs)``: ``class_weight`` removed; a
    ``tf.data.Dataset`` ``x`` mapped to ``(x, y, weight)`` elements; for
    arrays, ``sample_weight`` multiplied by the class weights. Unchanged
    when there is no ``class_weight``. The Poisson marker of ``x`` is not
    kept: check the input first.

    Raises:
      ValueError: an invalid ``class_weight``, or input whose labels it
        cannot reach (a distributed dataset, a generator).
    """
    args = list(args)
    if len(args) > _CLASS_WEIGHT_ARG:
        class_weight = args[_CLASS_WEIGHT_ARG]
        args[_CLASS_WEIGHT_ARG] = None
    else:
        class_weight = kwargs.pop('class_weight', None)
    if class_weight is None:
        return x, tuple(args), kwargs
    table = class_weight_table(class_weight)
    if isinstance(x, tf.data.Dataset):
        if y is not None:
            raise ValueError('y must be None when x is a tf.data.Dataset.')
        return x.map(_weighted_element(table)), tuple(args), kwargs
    if y is None:  # A distributed dataset, a generator, a Sequence...
        raise ValueError(
            'class_weight works with a tf.data.Dataset of (x, y[, weight]) '
            'elements or with x and y arrays; for other input put the class '
            'weights into the per-example weights (in [0, 1]) yourself.')
    weights = _weights_of(table, y).numpy()
    if len(args) > _SAMPLE_WEIGHT_ARG:
        given = args[_SAMPLE_WEIGHT_ARG]
    else:
        given = kwargs.get('sample_weight')
    if given is not None:
        weights = np.asarray(given, np.float32).reshape(-1) * weights
    if len(args) > _SAMPLE_WEIGHT_ARG:
        args[_SAMPLE_WEIGHT_ARG] = weights
    else:
        kwargs['sample_weight'] = weights
    return x, tuple(args), kwargs

