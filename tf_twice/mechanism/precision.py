"""Which floating-point dtypes the mechanism computes in, and which way its
constants round.

The accountant assumes exact clips, exact noise stds and exact sums; the
step computes in floating point. The rules that keep every rounding on the
private side live here, one place for every module of the mechanism:

* ``accumulation_dtype``: per-example gradients are clipped, masked and
  summed over a chunk in at least float32 (16-bit rounding after the norm
  was measured would exceed the clip);
* ``BATCH_SUM_DTYPE``: a logical batch's chunk sums are added, and its
  noise added to them, in float64;
* ``constant_toward`` and ``clip_constant``: clips rounded down and noise
  stds rounded up into the dtype they are applied in;
* ``unit_roundoff`` and ``summation_error``: the bounds by which an
  example's squared norm, summed in floating point, is rounded up before
  its clip factor is taken (``kernels.squared_norms``);
* ``in_xla_context``: whether XLA compiles the graph being built (it has
  no Euclidean-norm kernel, so norms are summed otherwise there).
"""

from fractions import Fraction
from typing import Any, Union

import numpy as np
import tensorflow as tf
# Public TensorFlow has no test for "inside an XLA-compiled function".
from tensorflow.python.ops import control_flow_util

__all__ = [
    'BATCH_SUM_DTYPE',
    'accumulation_dtype',
    'clip_constant',
    'constant_toward',
    'in_xla_context',
    'summation_error',
    'unit_roundoff',
]


def accumulation_dtype(*dtypes: Any) -> tf.DType:
    """The one dtype in which per-example gradients of ``dtypes`` are
    clipped, masked and summed over a chunk together: the widest of them,
    and at least float32 (chunks' sums are then added in
    ``BATCH_SUM_DTYPE``).

    In float16 or bfloat16, ``scale * g`` rounds after the norm was
    measured (to 2**-11 or 2**-8 of each coordinate): an example's
    contribution reached 1.0012 (float16) and 1.0058 (bfloat16) times the
    clip, and exceeded the l-infinity clip. A sum over a batch could also
    overflow float16's range of 65,504. Norms are float32 too, so a
    float16 gradient whose squared norm overflows float16 but not float32
    is clipped, not dropped. Rounding the noisy update back to the
    variables' dtype afterwards is post-processing. One dtype for all
    tensors: an example's norm adds up squares over every tensor of a block,
    and a block may span variables of float64 and float32.

    Raises:
      ValueError: no dtype, or one that is not floating-point.
    """
    if not dtypes:
        raise ValueError('accumulation_dtype needs at least one dtype.')
    dtypes = [tf.as_dtype(d) for d in dtypes]
    for dtype in dtypes:
        if not dtype.is_floating:
            raise ValueError(
                'gradients, variables and noise must have a floating-point '
                f'dtype (float16, bfloat16, float32 or float64); got '
                f'{dtype.name}.')
    widest = max(dtypes, key=lambda d: d.size)
    return tf.float32 if widest.size <= 4 else widest


# A logical batch's sum over its chunks, and the noise added to it. The
# accumulator of a float32 sum is rounded to float32 at every chunk added:
# one example of 65,536 moved the sum by up to 1.001 times the clip, each
# coordinate by up to 1 % more or less than its own (the rounding grows with
# the sum). In float64 that rounding is 2**-29 of it, and what is left of
# float32's is one chunk's own sum (at most a physical batch of rows). The
# noise is added in float64 too: rounding the noisy sum to the variables'
# dtype afterwards is post-processing, while rounding it before the noise
# (as a float32 sum was) is not. Not yet covered: a chunk's own float32 sum
# rounds with the other rows' magnitudes, so adding one example moved a
# chunk's sum by up to 1.000065 times the clip in a case built for it (256
# rows, each contribution at most 0.9999995 c2), and a dense kernel's
# float64 weighted sum is rounded to float32 before it leaves the chunk
# (up to 2**-24 of the chunk's sum). Both grow with the chunk's rows (512
# by default for a model of Dense layers on a CPU). Returning every chunk's
# sums in float64, summed in float64, would bring that below 1e-11.
BATCH_SUM_DTYPE = tf.float64


def constant_toward(value: Union[float, Fraction], dtype: Any, *,
                    up: bool) -> tf.Tensor:
    """``value`` in ``dtype``, rounded up or down rather than to nearest.

    The accountant assumes the exact clips and noise stds; rounded to
    nearest, float32 moves a value by up to 2**-24 of itself (0.1 becomes
    0.10000000149), float16 by 2**-11, and a subnormal one by far more
    (1e-45 becomes 1.4e-45 in float32). Clips are rounded down and noise
    stds up, so the step is never less private than accounted. ``value``
    may be an exact ``Fraction`` (a product such as z * c2, which a float
    product would first round to nearest).
    """
    return tf.constant(_round_toward(value, dtype, up), dtype)


def _round_toward(value: Union[float, Fraction], dtype: Any,
                  up: bool) -> np.ndarray:
    exact = (value if isinstance(value, (int, Fraction))
             else Fraction(float(value)))
    # Past the dtype's range the nearest value is inf; one step back is max.
    with np.errstate(over='ignore'):
        rounded = np.array(float(exact), tf.as_dtype(dtype).as_numpy_dtype)
        if np.isfinite(rounded):
            got = Fraction(float(rounded))
            wrong_side = got < exact if up else got > exact
        else:
            wrong_side = rounded < 0 if up else rounded > 0
        if wrong_side:
            rounded = np.nextafter(
                rounded, np.array(np.inf if up else -np.inf, rounded.dtype))
    return rounded


# The smallest normal value of each float dtype (2**(1 - bias)). CPUs run
# TensorFlow with subnormals flushed to 0, so a smaller clip is 0 in the
# kernels: an l2 clip of 0 gives a zero gradient the factor 0/0 = NaN.
_SMALLEST_NORMAL = {tf.float16: 2.0**-14, tf.bfloat16: 2.0**-126,
                    tf.float32: 2.0**-126, tf.float64: 2.0**-1022}


def clip_constant(name: str, clip: float, dtype: Any) -> tf.Tensor:
    """A clip in ``dtype``, rounded down (``constant_toward``): the
    l-infinity clip then bounds every coordinate exactly.

    Raises:
      ValueError: the clip rounds below the smallest normal value of
        ``dtype`` (to 0 or to a subnormal value).
    """
    dtype = tf.as_dtype(dtype)
    constant = constant_toward(clip, dtype, up=False)
    smallest = _SMALLEST_NORMAL[dtype]
    if float(tf.get_static_value(constant)) < smallest:
        raise ValueError(
            f'{name}={clip} is below {smallest:g}, the smallest normal '
            f'{dtype.name} value ({dtype.name} is the dtype the gradients '
            'are clipped in): a CPU flushes a smaller clip to 0. Give a '
            f'clip of at least {smallest:g}.')
    return constant


def unit_roundoff(dtype: Any) -> float:
    """u = 2**-p of a float dtype of p-bit significands: rounding to
    nearest moves a normal value by at most u times itself."""
    return float(np.finfo(tf.as_dtype(dtype).as_numpy_dtype).eps) / 2


def summation_error(terms: int, dtype: Any) -> float:
    """gamma_n = n u / (1 - n u) for n = ``terms`` roundings in ``dtype``.

    A sum of n - 1 additions of non-negative numbers, each rounded, in any
    order, is within gamma_(n-1) of the exact sum relative to it (Higham,
    Accuracy and Stability of Numerical Algorithms, 2nd ed., 2002, Lemma
    3.1 and eq. 4.4); a product of n factors (1 + delta_i), |delta_i| <= u,
    is within gamma_n of 1. That order is the one thing a reduction kernel
    does not promise, so only this bound holds for every kernel.

    Raises:
      ValueError: n u >= 1/2, where the bound is useless.
    """
    u = unit_roundoff(dtype)
    if terms * u >= 0.5:
        raise ValueError(
            f'{terms} roundings in {tf.as_dtype(dtype).name} have no useful '
            'error bound: compute in a wider dtype.')
    return terms * u / (1 - terms * u)


def in_xla_context() -> bool:
    """Whether the graph being built is compiled by XLA."""
    return control_flow_util.GraphOrParentsInXlaContext(
        tf.compat.v1.get_default_graph())
