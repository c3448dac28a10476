"""What the hybrid-clipping tests share: the MLP, its public basis, the
hybrid config and random gradients."""

import numpy as np
import tensorflow as tf

from tests import tiny_models
from tf_twice.config import TwiceSamplingConfig
from tf_twice.hybrid import learning
from tf_twice.keras import basis_refresh
from tf_twice.mechanism import basis as basis_lib

NUM_FEATURES, NUM_CLASSES = tiny_models.NUM_FEATURES, tiny_models.NUM_CLASSES


def data(batch, seed=0):
    return tiny_models.data(batch, seed)


mlp = tiny_models.mlp  # d = 43


def loss(**kwargs):
    return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                         **kwargs)


def weights(model):
    return [v.numpy() for v in model.trainable_variables]


def assert_all_close(a_list, b_list, **kwargs):
    kwargs = {'rtol': 1e-5, 'atol': 1e-6, **kwargs}
    assert len(a_list) == len(b_list)
    for a, b in zip(a_list, b_list):
        np.testing.assert_allclose(a, b, **kwargs)


RANKS = [3, 5]
GROUPS = 2


def basis(seed=0, public_seed=1):
    """A basis of the MLP's gradients learned from public examples."""
    grads = basis_refresh.public_per_example_gradients(
        mlp(), loss(), *data(32, seed=public_seed))
    return learning.learn_basis(grads, RANKS, groups=GROUPS, seed=seed)


NUM_EXAMPLES, DELTA = 24, 1e-5  # q1 = 6 / 24
SEED = 17


def params(**changes):
    """The hybrid config: principal blocks 1, 2, then the residual."""
    fields = dict(l2_norm_clip=(0.5, 0.3, 0.2),
                  linf_norm_clip=(0.2, None, 0.03),
                  noise_multiplier=(1.0, 2.0, 1.5),
                  coordinate_sampling_rate=0.5, expected_batch_size=6.0,
                  num_examples=NUM_EXAMPLES)
    fields.update(changes)
    return tiny_models.dp_config(**fields)


HYBRID = params()
# The same clip budget and noise as one block (no basis).
SINGLE = TwiceSamplingConfig.single(
    num_examples=NUM_EXAMPLES, expected_batch_size=6.0, l2_norm_clip=0.6,
    noise_multiplier=1.0, coordinate_sampling_rate=0.5)


def random_grads(batch, shapes, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return [(scale * rng.standard_normal((batch,) + tuple(s))).astype(
        np.float32) for s in shapes]


def orthonormal_basis(dims, ranks, seed=0):
    """A random block-diagonal basis, one variable per group."""
    rng = np.random.default_rng(seed)
    matrices = [np.linalg.qr(rng.standard_normal((d, sum(r))))[0]
                for d, r in zip(dims, ranks)]
    return basis_lib.HybridBasis(matrices, ranks)
