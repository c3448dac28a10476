r"""Does hybrid clipping turn the mean clipped update? A noise-free measurement.

For one model state, the per-example gradients of `--private_examples`
training images are clipped two ways, without noise or masks:

* global: twice sampling's clipping, l2 clip c2 and l-infinity c2 / sqrt(d0);
* hybrid: the per-block clips that `tf_twice.hybrid.plan_blocks` sets from the
  PUBLIC split (basis of `--ranks`, budget split by public projection norms,
  l-infinity c2_j / sqrt(d0) on the residual),

and the script prints the cosines between the two mean clipped updates and
with the mean raw gradient, their norm ratio and the clipped fraction, at the
initial weights and after `--train_epochs` epochs of NON-PRIVATE training (a
measurement of geometry, with no privacy claim). Results in docs/results.md.

Run: python examples/hybrid_clipping_cosines.py --dataset=fashion_mnist
"""

from __future__ import annotations

import os
import sys
from typing import Dict, Sequence

if __package__ in (None, ''):
    sys.path.insert(0, os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags
import numpy as np
import tensorflow as tf

import tf_twice
from examples.training import console
from examples.training import data as data_lib
from examples.training import modeling
from examples.training import settings
from tf_twice import models
from tf_twice.hybrid import budgets
from tf_twice.hybrid import learning
from tf_twice.keras import basis_refresh
from tf_twice.mechanism import aggregation
from tf_twice.mechanism import basis as basis_lib
from tf_twice.mechanism import hybrid
# pylint: enable=g-import-not-at-top,wrong-import-position


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def clipping_cosines(gradients: np.ndarray, basis: basis_lib.HybridBasis,
                     planned: tf_twice.TwiceSamplingConfig, *,
                     l2_norm_clip: float, d0: float) -> Dict[str, float]:
    """Mean clipped updates of `gradients` [n, d] under global and hybrid
    clipping (the clips of `planned`, one Block per block of `basis`)."""
    n = len(gradients)
    silent = tf_twice.TwiceSamplingConfig(
        num_examples=n, expected_batch_size=float(n),
        coordinate_sampling_rate=1.0, non_private=True,
        blocks=tuple(tf_twice.Block(
            l2_norm_clip=b.l2_norm_clip, linf_norm_clip=b.linf_norm_clip,
            noise_multiplier=0.0, dimension=b.dimension)
            for b in planned.blocks))
    per_block = hybrid.noisy_update(
        hybrid.block_sums([gradients], silent, basis=basis), silent,
        basis=basis)[0].numpy()
    global_clip = aggregation.clipped_masked_sum(
        [gradients], l2_norm_clip=l2_norm_clip,
        linf_norm_clip=l2_norm_clip / np.sqrt(d0))[0].numpy() / n
    raw = gradients.mean(axis=0)
    return dict(
        cos_global_raw=_cosine(global_clip, raw),
        cos_hybrid_raw=_cosine(per_block, raw),
        cos_hybrid_global=_cosine(per_block, global_clip),
        norm_ratio=float(np.linalg.norm(per_block)
                         / np.linalg.norm(global_clip)),
        clipped_fraction=float(np.mean(
            np.linalg.norm(gradients, axis=1) > l2_norm_clip)),
        median_norm=float(np.median(np.linalg.norm(gradients, axis=1))))


def _flat(gradients) -> np.ndarray:
    return np.concatenate([g.reshape(len(g), -1) for g in gradients], axis=1)


def measure(model, data, f) -> None:
    loss = modeling.per_example_loss()
    public = _flat(basis_refresh.public_per_example_gradients(
        model, loss, data_lib.to_unit_float(data.x_public), data.y_public))
    private = _flat(basis_refresh.public_per_example_gradients(
        model, loss, data_lib.to_unit_float(
            data.x_train[:f.private_examples]),
        data.y_train[:f.private_examples]))
    one_block = tf_twice.TwiceSamplingConfig.single(
        num_examples=len(data.x_train), expected_batch_size=f.batch_size,
        coordinate_sampling_rate=0.5, l2_norm_clip=f.l2_norm_clip)
    for ranks in f.ranks:
        ranks = [int(r) for r in ranks.split('+')]
        basis = learning.learn_basis(public, ranks, seed=0)
        planned = budgets.plan_blocks(
            one_block, basis, public, residual_d0=f.d0, target_epsilon=3.0,
            delta=1e-5, steps=400)
        values = clipping_cosines(private, basis, planned,
                                  l2_norm_clip=f.l2_norm_clip, d0=f.d0)
        clips = ' / '.join(f'{c:.4f}' for c in planned.l2_norm_clips)
        print(f'  ranks {"+".join(map(str, ranks))} (l2 clips {clips}): '
              + ', '.join(f'{k} {v:.3f}' for k, v in values.items()))


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    console.quiet_known_noise()
    f = flags.FLAGS
    data = data_lib.load_data(f.dataset, public_examples=f.public_examples)
    tf.keras.utils.set_random_seed(f.seed)
    model = modeling.build_inner_model(
        settings.TrainConfig(model=f.model), data)
    print('At the initial weights:')
    measure(model, data, f)
    if f.train_epochs:
        model.compile(optimizer=tf.keras.optimizers.SGD(0.05, momentum=0.9),
                      loss=modeling.loss(), metrics=['accuracy'])
        model.fit(data_lib.to_unit_float(data.x_train), data.y_train,
                  batch_size=256, epochs=f.train_epochs, verbose=0)
        accuracy = model.evaluate(data_lib.to_unit_float(data.x_test),
                                  data.y_test, verbose=0)[1]
        print(f'After {f.train_epochs} non-private epochs (test accuracy '
              f'{accuracy:.4f}):')
        measure(model, data, f)


if __name__ == '__main__':
    flags.DEFINE_enum('dataset', 'digits', ['digits', 'fashion_mnist'],
                      'Dataset.')
    flags.DEFINE_enum('model', 'tanh_cnn', sorted(models.MODELS),
                      'Model (tf_twice.models).')
    flags.DEFINE_integer('public_examples', 2000, 'Public split size.')
    flags.DEFINE_integer('private_examples', 4000, 'Training images whose '
                         'gradients are clipped.')
    flags.DEFINE_list('ranks', ['32+96', '8'], 'Rank lists to try, '
                      'comma-separated, the ranks of one joined by "+".')
    flags.DEFINE_float('l2_norm_clip', 0.1, 'Global l2 budget c2.')
    flags.DEFINE_float('d0', 100.0, 'l-infinity clips c2 / sqrt(d0).')
    flags.DEFINE_float('batch_size', 2048, 'Expected batch (only sets the '
                       'planned noise, which is not used).')
    flags.DEFINE_integer('train_epochs', 2, 'Non-private epochs before the '
                         'second measurement (0: none).')
    flags.DEFINE_integer('seed', 0, 'Initial weights.')
    app.run(main)
