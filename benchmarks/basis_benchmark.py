"""Cost of learning and using a hybrid-clipping basis.

Reference CNN: Conv2D(16,3,relu)-MaxPool-Conv2D(32,3,relu)-MaxPool-Flatten-
Dense(64,relu)-Dense(10) on 32x32x3 inputs (79,530 parameters), random data,
CPU. Prints

  * the time to compute the per-example gradients of the public examples and
    to learn a basis of k = 256 principal dimensions (ranks in the paper's
    proportions 250 : 500 : 1000 : 1500) with the default power iterations,
    in one group and in one group per layer;
  * the memory of those bases, and the time to project and reconstruct one
    256-example microbatch (what a hybrid-clipping step adds);
  * the public block norms and the split of a global l2 budget c = 1;
  * for the paper's ResNet22 scale (d = 291,898, ranks 250/500/1000/1500,
    k = 3,250) the basis memory for g = 1 and more parameter groups, by
    arithmetic from shapes (nothing that large is allocated).

Usage:

  python benchmarks/basis_benchmark.py                 # 512 public examples
  python benchmarks/basis_benchmark.py --public 256    # quicker
"""

import argparse
import os
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))

from tf_twice.hybrid import block_statistics  # noqa: E402
from tf_twice.hybrid import budget_splits  # noqa: E402
from tf_twice.hybrid import learning  # noqa: E402
from tf_twice.keras import basis_refresh  # noqa: E402
from tf_twice.mechanism import basis as basis_lib  # noqa: E402

import reference_inputs  # noqa: E402  Beside this script.
from reference_inputs import PAPER_RANKS  # noqa: E402

RESNET22_DIM = 291898


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def gib(num_bytes: float) -> str:
    return f'{num_bytes / 2**30:7.3f} GiB ({num_bytes / 1e9:6.3f} GB)'


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--public', type=int, default=512,
                        help='number of public examples (default 512)')
    parser.add_argument('--k', type=int, default=256,
                        help='principal dimensions (default 256)')
    parser.add_argument('--power-iterations', type=int,
                        default=learning.DEFAULT_POWER_ITERATIONS)
    args = parser.parse_args()

    tf.keras.utils.set_random_seed(0)
    model = reference_inputs.build_model()
    x, y = reference_inputs.random_examples(args.public)
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    d = model.count_params()
    ranks = reference_inputs.scaled_ranks(args.k)
    print(f'Reference CNN: d = {d:,} parameters, '
          f'{len(model.trainable_variables)} variables; '
          f'{args.public} public examples; ranks {ranks} (k = {sum(ranks)}); '
          f'{args.power_iterations} power iterations; '
          f'{os.cpu_count()} CPU cores')

    # Warm-up traces the 256-example chunk the timed call uses.
    basis_refresh.public_per_example_gradients(model, loss, x[:256], y[:256])
    grads, t_grads = timed(basis_refresh.public_per_example_gradients,
                           model, loss, x, y)
    print(f'  public per-example gradients: {t_grads:6.2f} s '
          f'({args.public / t_grads:,.0f} examples/s)')

    layers = learning.groups_by_layer(model)
    configs = [('1 group', None, 'sqrt'),
               (f'{len(layers)} groups (per layer, sqrt split)', layers,
                'sqrt'),
               ('4 groups (balanced, equal split)', 4, 'equal')]
    batch = [g[:256] for g in grads]
    for name, groups, split in configs:
        basis, t_learn = timed(learning.learn_basis, grads, ranks,
                               groups=groups, rank_split=split,
                               power_iterations=args.power_iterations)
        _, t_check = timed(basis_lib.HybridBasis, basis.group_matrices,
                           basis.group_ranks, groups=basis.groups,
                           variable_shapes=basis.variable_shapes)
        tensors = [tf.constant(g) for g in batch]
        basis.compose(*basis.decompose(tensors))  # warm
        _, t_use = timed(lambda: [t.numpy() for t in basis.compose(
            *basis.decompose(tensors))])
        norms = block_statistics.public_block_norms(basis, grads,
                                                    clip_norm=1.0)
        budgets = budget_splits.split_l2_budget(1.0, norms)
        print(f'\n  {name}: dims {list(basis.group_dims)}')
        print(f'    learn basis: {t_learn:6.2f} s (of which the '
              f'orthonormality check {t_check:5.2f} s); memory '
              f'{basis.memory_floats:,} floats = {gib(basis.memory_bytes)}; '
              f'd*k = {d * sum(ranks):,} floats')
        print(f'    decompose + compose a 256-example microbatch: '
              f'{1e3 * t_use:7.1f} ms')
        print('    mean public block norms (clipped to 1), residual last: '
              + ', '.join(f'{n:.3f}' for n in norms))
        print('    l2 budgets for c = 1: '
              + ', '.join(f'{c:.3f}' for c in budgets))

    k = sum(PAPER_RANKS)
    print(f'\nResNet22 scale: d = {RESNET22_DIM:,}, ranks {PAPER_RANKS} '
          f'(k = {k:,}), float32, equal groups and equal rank split '
          '(memory d*k/g; arithmetic only):')
    for g in (1, 2, 4, 8, 16, 32, 64):
        dims = [RESNET22_DIM // g + (i < RESNET22_DIM % g) for i in range(g)]
        table = learning.split_group_ranks(PAPER_RANKS, dims, 'equal')
        mem = basis_lib.basis_memory_bytes(dims, table)
        flops = 4 * sum(dd * sum(r) for dd, r in zip(dims, table))
        print(f'  g = {g:3d}: {gib(mem)}; project + reconstruct '
              f'{flops / 1e9:6.2f} GFLOP per example')


if __name__ == '__main__':
    main()
