"""The marker that tells a dataset of Poisson-sampled logical batches apart.

``pipelines.poisson_batches`` attaches a ``PoissonSamplingInfo`` to the
dataset it returns; ``get_poisson_sampling_info`` finds it again, also
through the tf.data transformations that keep every element a fresh Poisson
sample, and ``tf_twice.keras.guards.check_poisson_input`` refuses input
without it. The walk reads tf.data's class names and ``_inputs()``: the
one place that depends on tf.data's internals.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import tensorflow as tf

from tf_twice import _keras  # noqa: F401  pylint: disable=unused-import

__all__ = ['PoissonSamplingInfo', 'get_poisson_sampling_info']

MARKER_ATTR = '_tf_twice_poisson_sampling'
# Transformations of a logical-batch dataset that keep it Poisson: they only
# prefetch, truncate, re-iterate (which draws fresh steps) or set options.
_TRANSPARENT_DATASETS = frozenset([
    '_AssertCardinalityDataset',
    '_MaxIntraOpParallelismDataset',
    '_OptionsDataset',
    '_PrefetchDataset',
    '_PrivateThreadPoolDataset',
    '_RepeatDataset',
    '_SkipDataset',
    '_TakeDataset',
])


@dataclasses.dataclass(frozen=True)
class PoissonSamplingInfo:
    """Marker carried by a dataset of Poisson-sampled logical batches.

    Attributes:
      num_examples: n.
      example_sampling_rate: q1.
      expected_batch_size: n * q1.
      physical_batch_size: logical batches are padded to a multiple of it,
        or None (not padded).
      steps: logical batches per iteration, or None for an infinite dataset.
      steps_per_epoch: round(1 / q1).
      seed: the seed of the sampling stream (drawn at random if not given).
      start_step: the step index of the first batch.
    """
    num_examples: int
    example_sampling_rate: float
    expected_batch_size: float
    physical_batch_size: Optional[int]
    steps: Optional[int]
    steps_per_epoch: int
    seed: int
    start_step: int


def get_poisson_sampling_info(dataset: Any) -> Optional[PoissonSamplingInfo]:
    """The `PoissonSamplingInfo` of a logical-batch dataset, else None.

    Recognises datasets returned by `poisson_batches[_from_dataset]`, also
    after transformations that keep every element a fresh Poisson sample:
    `prefetch`, `take`, `skip`, `repeat`, `with_options`,
    `assert_cardinality`. Anything else (`map`, `batch`, `unbatch`, `cache`
    which replays batches, `shuffle`, a plain `shuffle().batch()` pipeline,
    numpy arrays, generators) gives None.
    """
    seen = 0
    while isinstance(dataset, tf.data.Dataset) and seen < 1000:
        info = getattr(dataset, MARKER_ATTR, None)
        if isinstance(info, PoissonSamplingInfo):
            return info
        if type(dataset).__name__ not in _TRANSPARENT_DATASETS:
            return None
        inputs = dataset._inputs()  # pylint: disable=protected-access
        if len(inputs) != 1:
            return None
        dataset = inputs[0]
        seen += 1
    return None
