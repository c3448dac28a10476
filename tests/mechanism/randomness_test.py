"""Tests of the mask bits: which random bits each coordinate reads, whatever
the shape the masks are laid out in."""

import math

import numpy as np
import pytest
import tensorflow as tf

from tf_twice import config as config_lib
from tf_twice.mechanism import randomness


def _reference_masks(words, d, q2):
    """Coordinate c of a row reads bits c * b .. (c + 1) * b - 1 of the
    row's words (as little-endian bytes), low bits first."""
    bits = config_lib.mask_bits_per_coordinate(q2)
    threshold = int(config_lib.effective_coordinate_sampling_rate(q2)
                    * 2**bits)
    rows = []
    for row in words:
        stream = np.unpackbits(row.astype('<u4').view(np.uint8),
                               bitorder='little')
        values = [int(sum(int(stream[c * bits + k]) << k
                          for k in range(bits))) for c in range(d)]
        rows.append(np.array(values) < threshold)
    return np.array(rows)


# Bits per coordinate: 0.5 -> 1, 0.25 -> 2, 0.0625 -> 4, 3/256 -> 8,
# 1/3 -> 16.
@pytest.mark.parametrize('q2', [0.5, 0.25, 0.0625, 3 / 256, 1 / 3])
# Last axes of 8, 16 and 24 hold whole bytes at every rate, and 32 and 64
# whole 32-bit words at rates of 1 bit (8 and 16 at rates of 4 and 2 bits);
# 5, 7 and 1 do not (the masks are split flat); () is one coordinate;
# (0,), (3, 0) and (0, 32) none.
@pytest.mark.parametrize('shape', [(3, 8), (2, 3, 24), (16,), (2, 64),
                                   (32,), (3, 5), (7,), (4, 1), (),
                                   (0,), (3, 0), (0, 32)])
@pytest.mark.parametrize('jit_compile', [False, True])
def test_each_coordinate_reads_its_own_bits(q2, shape, jit_compile):
    d = math.prod(shape)
    key = randomness.draw_step_key(tf.random.Generator.from_seed(1))
    words = randomness.row_mask_words(key, 3, 4, 5, d, q2)
    masks = tf.function(
        lambda w: randomness.masks_from_words(w, shape, q2),
        jit_compile=jit_compile)(words)
    assert masks.shape == (4,) + shape
    want = _reference_masks(words.numpy(), d, q2)
    np.testing.assert_array_equal(np.reshape(masks, (4, d)), want)
