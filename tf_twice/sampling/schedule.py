"""Epoch arithmetic of Poisson sampling, and the argument checks it shares.

``poisson_schedule`` turns n and one of (q1, expected batch size n * q1) into
a ``PoissonSchedule``: q1, n * q1 and the steps of one epoch, round(1 / q1).
``resolve_rate`` is the argument check of q1 that the index drawing
(``indices``) and the tf.data pipelines (``pipelines``) share. No TensorFlow
here.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from tf_twice import _validate
from tf_twice import config as config_lib

__all__ = ['PoissonSchedule', 'poisson_schedule']


@dataclasses.dataclass(frozen=True)
class PoissonSchedule:
    """Epoch bookkeeping of Poisson sampling.

    Attributes:
      num_examples: n, the size of the private dataset.
      example_sampling_rate: q1 in (0, 1].
      expected_batch_size: n * q1, the mean logical batch size.
      steps_per_epoch: round(1 / q1) (halves up), the number of steps after
        which each example has been used once in expectation.
    """
    num_examples: int
    example_sampling_rate: float
    expected_batch_size: float
    steps_per_epoch: int


def resolve_rate(num_examples: int, example_sampling_rate: Optional[float],
                 expected_batch_size: Optional[float]) -> float:
    """q1 from exactly one of (q1, expected batch size n * q1)."""
    if (example_sampling_rate is None) == (expected_batch_size is None):
        raise ValueError('Give exactly one of example_sampling_rate (q1 in '
                         '(0, 1]) and expected_batch_size (in (0, '
                         f'num_examples={num_examples}]).')
    if example_sampling_rate is not None:
        q1 = float(example_sampling_rate)
        if not 0.0 < q1 <= 1.0:  # Also rejects NaN.
            raise ValueError('example_sampling_rate must be in (0, 1]; got '
                             f'{example_sampling_rate!r}.')
        return q1
    b = float(expected_batch_size)
    if not 0.0 < b <= num_examples:
        raise ValueError(f'expected_batch_size must be in (0, num_examples='
                         f'{num_examples}]; got {expected_batch_size!r}.')
    return b / num_examples


def poisson_schedule(num_examples: int, *,
                     example_sampling_rate: Optional[float] = None,
                     expected_batch_size: Optional[float] = None
                     ) -> PoissonSchedule:
    """Steps per epoch and expected batch size of Poisson sampling.

    Args:
      num_examples: n >= 1.
      example_sampling_rate: q1 in (0, 1]; or
      expected_batch_size: n * q1 in (0, n] (exactly one of the two).

    Returns:
      A `PoissonSchedule` with q1, n * q1 and round(1 / q1).

    Raises:
      ValueError: for an argument outside its range.
    """
    n = _validate.integer('num_examples', num_examples, 1)
    q1 = resolve_rate(n, example_sampling_rate, expected_batch_size)
    return PoissonSchedule(num_examples=n, example_sampling_rate=q1,
                           expected_batch_size=n * q1,
                           steps_per_epoch=config_lib.steps_per_epoch(q1))

