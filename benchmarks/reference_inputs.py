"""What the benchmarks train on: 32x32x3 inputs of ten classes, the
benchmarked models, random examples and the paper's basis ranks.

Shared by the scripts beside it (which put the repository on ``sys.path``
before importing this), so that every benchmark measures the same model on
the same data.
"""

from typing import List, Tuple

import numpy as np
import tensorflow as tf

from tf_twice import models
from tf_twice.hybrid import learning

IMAGE_SHAPE = (32, 32, 3)
NUM_CLASSES = 10
# The paper's ranks of the four principal blocks of ResNet22's basis.
PAPER_RANKS = (250, 500, 1000, 1500)


def build_model(name: str = 'small_cnn') -> tf.keras.Model:
    """The reference CNN (79,530 parameters) or ResNet22 (291,898)."""
    return models.build_model(name, input_shape=IMAGE_SHAPE,
                              num_classes=NUM_CLASSES)


def random_examples(count: int, seed: int = 0
                    ) -> Tuple[np.ndarray, np.ndarray]:
    """``count`` images uniform in [0, 1) and labels, from ``seed``."""
    rng = np.random.default_rng(seed)
    x = rng.random((count,) + IMAGE_SHAPE, dtype=np.float32)
    y = rng.integers(0, NUM_CLASSES, count)
    return x, y


def scaled_ranks(k: int) -> List[int]:
    """Ranks summing to k in the proportions of PAPER_RANKS."""
    table = learning.split_group_ranks([k], list(PAPER_RANKS),
                                       'proportional')
    return [row[0] for row in table]
