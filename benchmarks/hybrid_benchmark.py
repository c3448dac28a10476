"""Cost of hybrid clipping in a DP training step, measured in one run.

Prints, on CPU with random data:

  * the reference CNN (``tf_twice.models.small_cnn``: 79,530 parameters,
    32x32x3 inputs), logical = physical batch 256, q2 = 0.5: the step time of
    twice sampling without a basis and of hybrid clipping with k = 256
    principal dimensions (ranks in the paper's proportions
    250 : 500 : 1000 : 1500, so 4 principal blocks and the residual) in 1
    parameter group, one group per layer and one group per variable, and the
    ratio hybrid / no basis (target <= 2x). Projecting costs 4 B sum_g d_g k_g
    flops per microbatch, so the split of k over the groups matters: the
    default 'sqrt' split gives the 73,792-parameter dense layer most of k,
    the 'equal' split k / g per group. The configurations are timed in
    interleaved rounds; the median is reported;
  * the cost of one basis refresh (public per-example gradients of 512
    public examples + ``learn_basis``, what ``BasisRefresh`` runs every K
    steps), reported separately from the step;
  * the paper's ResNet22 (``tf_twice.models.resnet22``, d = 291,898) with
    ranks 250/500/1000/1500 (k = 3,250) in 8 and 16 parameter groups
    (random orthonormal blocks, equal rank split: only the shapes matter for
    the cost): basis memory, step time at a physical = logical batch of 32,
    and the same step without a basis (interleaved rounds, median); plus
    the process's peak memory.

Usage:

  python benchmarks/hybrid_benchmark.py                # a few minutes
  python benchmarks/hybrid_benchmark.py --skip-resnet  # the CNN only
"""

import argparse
import os
import resource
import statistics
import sys
import time
from typing import Dict, List, Optional, Tuple

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))

from tf_twice.config import Block, TwiceSamplingConfig  # noqa: E402
from tf_twice.hybrid import budgets  # noqa: E402
from tf_twice.hybrid import learning  # noqa: E402
from tf_twice.keras import DPModel  # noqa: E402
from tf_twice.keras import basis_refresh  # noqa: E402
from tf_twice.mechanism import basis as basis_lib  # noqa: E402

import reference_inputs  # noqa: E402  Beside this script.
from reference_inputs import PAPER_RANKS  # noqa: E402

L2_CLIP, LINF_CLIP, NOISE, Q2 = 1.0, 0.1, 1.0, 0.5


def _loss():
    return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _dataset(batch: int) -> tf.data.Dataset:
    x, y = reference_inputs.random_examples(batch)
    return tf.data.Dataset.from_tensors((x, y)).repeat()


def private_model(model: tf.keras.Model, batch: int,
                  basis: Optional[basis_lib.HybridBasis]) -> tf.keras.Model:
    """DPModel with q2 = 0.5 and l-infinity clipping; per-block with a
    basis (the values do not change the cost)."""
    if basis is None:
        blocks = (Block(l2_norm_clip=L2_CLIP, linf_norm_clip=LINF_CLIP,
                        noise_multiplier=NOISE),)
    else:
        m = basis.num_blocks
        clips = [L2_CLIP / np.sqrt(m)] * m
        blocks = tuple(
            Block(l2_norm_clip=c2, linf_norm_clip=c_inf,
                  noise_multiplier=NOISE)
            for c2, c_inf in zip(
                clips, budgets.linf_clips_from_d0(clips, 16.0)))
    # n only sets q1: nothing is accounted here.
    config = TwiceSamplingConfig(num_examples=max(60_000, batch),
                                 expected_batch_size=batch,
                                 coordinate_sampling_rate=Q2, blocks=blocks)
    private = DPModel(model, config, basis=basis, physical_batch_size=batch,
                      seed=0)
    private.compile(optimizer=tf.keras.optimizers.SGD(0.01), loss=_loss())
    return private


def seconds_per_step(model: tf.keras.Model, dataset: tf.data.Dataset,
                     steps: int) -> Tuple[float, float]:
    """(wall seconds, CPU seconds of all threads) per step.

    On a shared machine the wall time also counts other processes' turns;
    the CPU time counts only this process's work.
    """
    wall, cpu = time.perf_counter(), time.process_time()
    model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0)
    return ((time.perf_counter() - wall) / steps,
            (time.process_time() - cpu) / steps)


def _medians(values: List[Tuple[float, float]]) -> Tuple[float, float]:
    return (statistics.median(w for w, _ in values),
            statistics.median(c for _, c in values))


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def cnn(args) -> None:
    batch, k = args.batch_size, args.k
    ranks = reference_inputs.scaled_ranks(k)
    tf.keras.utils.set_random_seed(0)
    probe = reference_inputs.build_model()
    d = probe.count_params()
    num_variables = len(probe.trainable_variables)
    print(f'Reference CNN: d = {d:,}; batch {batch} (one physical chunk); '
          f'q2 = {Q2}; k = {k}, ranks {ranks}; {os.cpu_count()} CPU cores')
    public = reference_inputs.random_examples(args.public, seed=1)
    layers = learning.groups_by_layer(probe)
    groupings = [('1 group', None, 'sqrt'),
                 ('per layer, sqrt split', layers, 'sqrt'),
                 ('per layer, equal split', layers, 'equal'),
                 ('per variable, equal split', num_variables, 'equal')]
    dataset = _dataset(batch)
    configs: Dict[str, tf.keras.Model] = {}
    tf.keras.utils.set_random_seed(0)
    configs['no basis (twice sampling)'] = private_model(
        reference_inputs.build_model(), batch, None)
    refresh_costs = {}
    for name, groups, split in groupings:
        tf.keras.utils.set_random_seed(0)
        inner = reference_inputs.build_model()
        refresh = basis_refresh.BasisRefresh(
            inner, public, _loss(), every_steps=100, ranks=ranks,
            groups=groups, rank_split=split,
            power_iterations=args.power_iterations)
        refresh.refresh()  # traces the public-gradient function
        basis, t_refresh = timed(refresh.refresh)
        private = private_model(inner, batch, basis)
        _, t_set = timed(private.set_basis, basis)
        label = f'hybrid, {name} ({basis.num_groups} groups)'
        configs[label] = private
        refresh_costs[label] = (t_refresh, t_set, basis)
    for private in configs.values():  # trace, compile, warm up
        private.fit(dataset, steps_per_epoch=2, epochs=1, verbose=0)
    times: Dict[str, List[Tuple[float, float]]] = {n: [] for n in configs}
    for r in range(args.rounds):
        for name, private in configs.items():
            times[name].append(seconds_per_step(private, dataset,
                                                args.steps))
        print(f'  round {r + 1} (wall/CPU ms): ' + ', '.join(
            f'{1e3 * times[n][-1][0]:.0f}/{1e3 * times[n][-1][1]:.0f}'
            for n in configs), flush=True)
    base_wall, base_cpu = _medians(times['no basis (twice sampling)'])
    print(f'\n  {"configuration":46s} {"wall ms":>7s} {"ex/s":>5s} '
          f'{"ratio":>5s} {"CPU ms":>7s} {"ratio":>5s} {"GFLOP":>5s}')
    for name, values in times.items():
        wall, cpu = _medians(values)
        basis = refresh_costs.get(name, (0, 0, None))[2]
        flops = 0.0 if basis is None else 4 * batch * basis.memory_floats
        print(f'  {name:46s} {1e3 * wall:7.1f} {batch / wall:5.0f} '
              f'{wall / base_wall:4.2f}x {1e3 * cpu:7.1f} '
              f'{cpu / base_cpu:4.2f}x {flops / 1e9:5.1f}')
    print('  (ratio: hybrid / no basis; CPU: seconds of all threads of this '
          'process; GFLOP: 4 B sum_g d_g k_g of the projection)')
    print(f'\n  basis refresh ({args.public} public examples: per-example '
          f'gradients + learn_basis with {args.power_iterations} power '
          'iterations), separate from the step:')
    for name, (t_refresh, t_set, basis) in refresh_costs.items():
        print(f'    {name:46s} {t_refresh:6.2f} s  (+ set_basis '
              f'{1e3 * t_set:5.1f} ms; basis {basis.memory_bytes / 2**20:6.1f}'
              ' MiB)')


def random_basis(model: tf.keras.Model, num_groups: int,
                 ranks=PAPER_RANKS) -> basis_lib.HybridBasis:
    """Random orthonormal blocks with the shapes of a learned basis."""
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    sizes = [int(np.prod(s)) for s in shapes]
    groups = learning.partition_variables(sizes, num_groups)
    dims = [sum(sizes[v] for v in g) for g in groups]
    table = learning.split_group_ranks(ranks, dims, 'equal')
    rng = np.random.default_rng(0)
    matrices = [np.linalg.qr(rng.standard_normal((dg, sum(row)),
                                                 dtype=np.float32))[0]
                for dg, row in zip(dims, table)]
    return basis_lib.HybridBasis(matrices, table, groups=groups,
                                 variable_shapes=shapes,
                                 metadata={'method': 'random'})


def resnet(args) -> None:
    batch = args.resnet_batch
    dataset = _dataset(batch)
    tf.keras.utils.set_random_seed(0)
    probe = reference_inputs.build_model('resnet22')
    d = probe.count_params()
    print(f'\nResNet22: d = {d:,}, {len(probe.trainable_variables)} '
          f'variables; ranks {PAPER_RANKS} (k = {sum(PAPER_RANKS):,}); '
          f'physical = logical batch {batch}; {args.resnet_steps} timed '
          'steps each')
    configs = {}
    for groups in [None] + list(args.resnet_groups):
        tf.keras.utils.set_random_seed(0)
        inner = reference_inputs.build_model('resnet22')
        basis = None
        if groups is not None:
            basis, t_basis = timed(random_basis, inner, groups)
        private = private_model(inner, batch, basis)
        _, t_first = timed(private.fit, dataset, steps_per_epoch=1,
                           epochs=1, verbose=0)
        name = ('no basis (twice sampling)' if basis is None else
                f'hybrid, {groups} groups')
        memory = ('-' if basis is None else
                  f'{basis.memory_bytes / 2**20:.0f} MiB, built in '
                  f'{t_basis:.1f} s')
        configs[name] = private
        print(f'  {name:28s} first step (trace + compile) {t_first:5.1f} s;'
              f' basis {memory}', flush=True)
    times: Dict[str, List[Tuple[float, float]]] = {n: [] for n in configs}
    for _ in range(args.resnet_rounds):
        for name, private in configs.items():
            times[name].append(seconds_per_step(private, dataset,
                                                args.resnet_steps))
    base_wall, base_cpu = _medians(times['no basis (twice sampling)'])
    for name, values in times.items():
        wall, cpu = _medians(values)
        print(f'  {name:28s} {wall:6.2f} s/step wall ({batch / wall:5.1f} '
              f'ex/s, {wall / base_wall:.2f}x), {cpu:6.2f} CPU s/step '
              f'({cpu / base_cpu:.2f}x the step without a basis)')
    print(f'  peak memory of this process: {peak_rss_gib():.2f} GiB')


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--batch-size', type=int, default=256)
    parser.add_argument('--k', type=int, default=256)
    parser.add_argument('--public', type=int, default=512)
    parser.add_argument('--power-iterations', type=int,
                        default=learning.DEFAULT_POWER_ITERATIONS)
    parser.add_argument('--steps', type=int, default=5,
                        help='timed steps per round (CNN)')
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--resnet-groups', type=int, nargs='*',
                        default=[8, 16])
    parser.add_argument('--resnet-batch', type=int, default=32)
    parser.add_argument('--resnet-steps', type=int, default=2,
                        help='timed steps per round (ResNet22)')
    parser.add_argument('--resnet-rounds', type=int, default=3)
    parser.add_argument('--skip-resnet', action='store_true')
    parser.add_argument('--skip-cnn', action='store_true')
    args = parser.parse_args(argv)
    if not args.skip_cnn:
        cnn(args)
    if not args.skip_resnet:
        resnet(args)


if __name__ == '__main__':
    main()
