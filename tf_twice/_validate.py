"""Argument validators: each names the argument and the allowed range.

The one home of the generic checks (numbers, rates, probabilities,
integers). TF-free and import-free, so every layer (config, accounting,
mechanism, keras, the training script) uses the same checks and messages;
``tf_twice.accounting.blocks`` builds its per-block checks on these. A
non-finite value fails the range test (NaN compares false, inf is out of
range), so its message names the allowed range too.
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings
from typing import Any, Optional

__all__ = ['integer', 'non_negative', 'positive', 'probability', 'rate',
           'real', 'warn_if_delta_not_small']


def _number(name: str, value: Any) -> float:
    # bool is an Integral, but True as a clip or a rate is a caller's bug.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f'{name} must be a real number; got {value!r}.')
    return float(value)


def real(name: str, value: Any) -> float:
    """``value`` as a finite float; ValueError otherwise (bools refused)."""
    value = _number(name, value)
    if not math.isfinite(value):
        raise ValueError(f'{name} must be finite; got {value!r}.')
    return value


def positive(name: str, value: Any) -> float:
    """A finite float > 0."""
    value = _number(name, value)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f'{name} must be a finite number > 0; got {value}.')
    return value


# The range of an l2 clip bound c2. Below it, a float32 squared norm can be
# 0 for a gradient of norm up to 1.1e-19 sqrt(d) (its squares flush to 0),
# which the clip would then leave unclipped; above it, c2 and the noise
# std overflow float32.
L2_CLIP_RANGE = (1e-12, 1e30)


def l2_clip(name: str, value: Any) -> float:
    """An l2 clip bound: a float in `L2_CLIP_RANGE`."""
    value = positive(name, value)
    low, high = L2_CLIP_RANGE
    if not low <= value <= high:
        raise ValueError(
            f'{name} must be a finite number > 0 in [{low:g}, {high:g}] '
            '(a float32 squared norm below ~1e-38 flushes to 0, so a smaller '
            'bound could leave tiny gradients unclipped; a larger one '
            f'overflows float32); got {value}.')
    return value


def non_negative(name: str, value: Any) -> float:
    """A finite float >= 0."""
    value = _number(name, value)
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f'{name} must be a finite number >= 0; got {value}.')
    return value


def rate(name: str, value: Any) -> float:
    """A sampling rate in (0, 1]."""
    value = _number(name, value)
    if not 0 < value <= 1:
        raise ValueError(f'{name} must be in (0, 1]; got {value}.')
    return value


def probability(name: str, value: Any) -> float:
    """A probability in the open interval (0, 1), e.g. delta."""
    value = _number(name, value)
    if not 0 < value < 1:
        raise ValueError(f'{name} must be in (0, 1); got {value}.')
    return value


def integer(name: str, value: Any, low: int,
            high: Optional[int] = None) -> int:
    """An integer in [low, high] (high None: no upper bound)."""
    allowed = (f'an integer >= {low}' if high is None
               else f'an integer in [{low}, {high}]')
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f'{name} must be {allowed}; got {value!r}.')
    value = int(value)
    if value < low or (high is not None and value > high):
        raise ValueError(f'{name} must be {allowed}; got {value}.')
    return value


def warn_if_delta_not_small(delta: float, num_examples: int) -> None:
    """Warns when delta >= 1 / n (once per process for the same values:
    make_private reaches it through calibrate and the ledger).

    An (epsilon, delta) guarantee with delta >= 1 / n allows releasing a
    random example's record outright; the usual rule is delta well below
    1 / n (Dwork & Roth, 2014, section 2.3).
    """
    if delta * num_examples >= 1:
        _warn_delta(delta, num_examples)


@functools.lru_cache(maxsize=None)
def _warn_delta(delta: float, num_examples: int) -> None:
    warnings.warn(
        f'delta = {delta:g} is at least 1 / num_examples = 1 / '
        f'{num_examples}: such a guarantee allows one record in the clear; '
        f'choose delta well below 1 / num_examples (e.g. '
        f'{10 ** math.floor(math.log10(0.1 / num_examples)):g}).',
        UserWarning, stacklevel=2)
