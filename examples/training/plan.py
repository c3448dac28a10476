"""The training script's plan: the mechanism and the schedule of a run.

`resolve_plan` turns a checked `TrainConfig` into sampling rates, clips,
the planned steps and (calibrated or given) noise; `hybrid_setup` learns
the basis from the PUBLIC split and sets hybrid clipping's per-block clips
and noise. `mechanism` is the plan as the `TwiceSamplingConfig` the library
derives everything from, and `privacy_statement` the statement for a number
of its steps.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Dict, Mapping, Optional, Tuple

import tensorflow as tf

import tf_twice
from tf_twice import accounting
from tf_twice import hybrid
from tf_twice import sampling
from tf_twice.hybrid import budgets as hybrid_budgets
from tf_twice.keras import basis_refresh

from examples.training import data as data_lib
from examples.training import modeling
from examples.training import settings
from examples.training.settings import DEFAULT_BATCH_SIZE
from examples.training.settings import DEFAULT_COORDINATE_SAMPLING_RATE
from examples.training.settings import DEFAULT_D0
from examples.training.settings import DEFAULT_EPOCHS
from examples.training.settings import DEFAULT_TARGET_EPSILON
from examples.training.settings import PRIVATE_MODES
from examples.training.settings import TrainConfig


@dataclasses.dataclass
class Plan:
    """The resolved mechanism and schedule of a run.

    For hybrid mode the clip and noise fields hold one value per block
    (principal blocks first, the residual last); they are set by
    `build_run` once the basis is learned.
    """

    mode: str
    num_examples: int
    delta: Optional[float]
    example_sampling_rate: float
    expected_batch_size: float
    coordinate_sampling_rate: float
    l2_norm_clip: Any
    linf_norm_clip: Any
    d0: Optional[float]
    noise_multiplier: Any
    target_epsilon: Optional[float]
    steps_per_epoch: int
    planned_steps: int
    ranks: Tuple[int, ...] = ()
    block_dimensions: Optional[Tuple[int, ...]] = None



def num_epochs_for_steps(n: int, batch_size: float, steps: int) -> float:
    """Epochs e with ceil(e * n / batch_size) == steps (the statement's
    step count), despite floating-point rounding."""
    epochs = steps * batch_size / n
    while math.ceil(epochs * n / batch_size) > steps:
        epochs = math.nextafter(epochs, 0.0)
    while math.ceil(epochs * n / batch_size) < steps:
        epochs = math.nextafter(epochs, math.inf)
    return epochs


def resolve_plan(config: TrainConfig, num_examples: int) -> Plan:
    """Sampling rates, clips, schedule and (single-block) noise of a run.

    Hybrid mode gets per-block clips and noise later, from the basis.

    Raises:
      ValueError: naming the flag, e.g. a batch size above n or a target
        epsilon that no noise multiplier reaches.
    """
    n = int(num_examples)
    if config.batch_size is not None:
        if float(config.batch_size) > n:
            raise settings.flag_error(
                'batch_size', f'in (0, {n}] (the private training examples)',
                config.batch_size)
        batch = float(config.batch_size)
    elif config.example_sampling_rate is not None:
        batch = float(config.example_sampling_rate) * n
    else:
        batch = float(min(DEFAULT_BATCH_SIZE, n))
    q1 = batch / n
    if config.mode == 'nonprivate':
        steps_per_epoch = int(math.ceil(n / batch))
    else:
        steps_per_epoch = sampling.poisson_schedule(
            n, expected_batch_size=batch).steps_per_epoch
    if config.steps is not None:
        planned = int(config.steps)
    else:
        epochs = DEFAULT_EPOCHS if config.epochs is None else config.epochs
        planned = max(1, int(math.ceil(float(epochs) * steps_per_epoch)))
    private = config.mode in PRIVATE_MODES
    if config.mode in ('twice', 'hybrid'):
        q2 = (DEFAULT_COORDINATE_SAMPLING_RATE
              if config.coordinate_sampling_rate is None
              else float(config.coordinate_sampling_rate))
    else:
        q2 = 1.0
    c2 = float(config.l2_norm_clip)
    d0 = None
    c_inf = None
    if config.mode in ('twice', 'hybrid'):
        if config.linf_norm_clip is not None:
            c_inf = float(config.linf_norm_clip)
        else:
            d0 = DEFAULT_D0 if config.d0 is None else float(config.d0)
            c_inf = c2 / math.sqrt(d0)
    delta = None
    target = None
    z = None
    if private:
        delta = (settings.default_delta(n) if config.delta is None
                 else float(config.delta))
        if config.noise_multiplier is not None:
            z = float(config.noise_multiplier)
        else:
            target = (DEFAULT_TARGET_EPSILON if config.target_epsilon is None
                      else float(config.target_epsilon))
            if config.mode != 'hybrid':
                z = _calibrate(target, delta, planned, q1, q2, c2, c_inf)
    return Plan(mode=config.mode, num_examples=n, delta=delta,
                example_sampling_rate=q1, expected_batch_size=batch,
                coordinate_sampling_rate=q2, l2_norm_clip=c2,
                linf_norm_clip=c_inf, d0=d0, noise_multiplier=z,
                target_epsilon=target, steps_per_epoch=steps_per_epoch,
                planned_steps=planned,
                ranks=(tuple(config.ranks) if config.mode == 'hybrid'
                       else ()))


def _calibrate(target, delta, steps, q1, q2, c2, c_inf) -> float:
    try:
        return accounting.calibrate_noise_multiplier(
            target_epsilon=target, delta=delta, steps=steps,
            example_sampling_rate=q1, coordinate_sampling_rate=q2,
            l2_norm_clip=c2, linf_norm_clip=c_inf)
    except ValueError as e:
        raise ValueError(f'--target_epsilon={target:g} cannot be met: {e}'
                         ) from e



def basis_kwargs(config: TrainConfig, plan: Plan) -> Dict[str, Any]:
    groups = config.parameter_groups
    return dict(ranks=plan.ranks, groups=None if groups == 1 else groups)


def hybrid_record(config: TrainConfig, plan: Plan) -> Dict[str, Any]:
    """What determines the per-block clips and noise of a hybrid run.

    Never the seed: run.json lies beside the checkpoints, and a seed
    recomputes the initial weights, the sampling, the masks and the noise.
    (Clips and noise come from public data only, so reusing them under
    another seed keeps the guarantee.)

    The budget (target epsilon, delta, planned steps) is part of it only
    when the noise is calibrated: with --noise_multiplier, a resumed run
    may plan more steps and keep its blocks.
    """
    record = dict(
        l2_norm_clip=float(config.l2_norm_clip),
        linf_norm_clip=config.linf_norm_clip, d0=plan.d0,
        principal_d0=float(config.principal_d0),
        ranks=list(plan.ranks), parameter_groups=config.parameter_groups,
        noise_multiplier=config.noise_multiplier,
        example_sampling_rate=plan.example_sampling_rate,
        coordinate_sampling_rate=plan.coordinate_sampling_rate,
        public_examples=int(config.public_examples))
    record.update(settings.budget_split_settings(config))
    if config.noise_multiplier is None:
        record.update(target_epsilon=plan.target_epsilon, delta=plan.delta,
                      planned_steps=plan.planned_steps)
    return record


def hybrid_blocks_record(config: TrainConfig, plan: Plan) -> Dict[str, Any]:
    """run.json's record of a hybrid run's blocks, with what determined them
    (`hybrid_setup` reuses the blocks when a resumed run has the same)."""
    return dict(settings=hybrid_record(config, plan),
                l2_norm_clip=list(plan.l2_norm_clip),
                linf_norm_clip=list(plan.linf_norm_clip),
                noise_multiplier=list(plan.noise_multiplier))


def learn_public_basis(config: TrainConfig, plan: Plan, data: data_lib.Data,
                       inner: tf.keras.Model, seed: int):
    """(basis, public gradients) at the model's current weights."""
    grads = basis_refresh.public_per_example_gradients(
        inner, modeling.per_example_loss(),
        data_lib.to_unit_float(data.x_public), data.y_public,
        batch_size=config.physical_batch_size)
    basis = hybrid.learn_basis(grads, seed=seed,
                               **basis_kwargs(config, plan))
    return basis, grads


def hybrid_setup(config: TrainConfig, plan: Plan, data: data_lib.Data,
                 inner: tf.keras.Model,
                 recorded: Optional[Mapping[str, Any]]):
    """Learns the basis from the PUBLIC split; sets per-block clips/noise.

    The per-block clips and noise are `tf_twice.hybrid.plan_blocks` of the
    flags' one-block mechanism: l2 budgets split by `--budget_split` (and
    `--budget_quantile`) from public statistics;
    the residual's l-infinity clip is `--linf_norm_clip` (capped at its c2)
    or c2 / sqrt(`--d0`), principal block j's is c2_j / sqrt(min(
    `--principal_d0`, r_j)); the noise is `--noise_multiplier` on every
    block or optimised per block for the target epsilon after the planned
    steps. All of it comes from public data and the flags, never from the
    private set. A resumed run with the same settings reuses the recorded
    clips and noise.
    """
    seed = 0 if config.seed is None else config.seed
    basis, grads = learn_public_basis(config, plan, data, inner, seed)
    plan.ranks = tuple(basis.ranks)
    plan.block_dimensions = tuple(basis.block_dimensions)
    record = hybrid_record(config, plan)
    if recorded is not None and recorded.get('settings') == json.loads(
            json.dumps(record)):
        plan.l2_norm_clip = tuple(recorded['l2_norm_clip'])
        plan.linf_norm_clip = tuple(recorded['linf_norm_clip'])
        plan.noise_multiplier = tuple(recorded['noise_multiplier'])
        return basis
    one_block = tf_twice.TwiceSamplingConfig.single(
        num_examples=plan.num_examples,
        expected_batch_size=plan.expected_batch_size,
        coordinate_sampling_rate=plan.coordinate_sampling_rate,
        l2_norm_clip=float(config.l2_norm_clip),
        linf_norm_clip=config.linf_norm_clip,
        noise_multiplier=config.noise_multiplier)
    budget = {} if config.noise_multiplier is not None else dict(
        target_epsilon=plan.target_epsilon, delta=plan.delta,
        steps=plan.planned_steps)
    try:
        planned = hybrid_budgets.plan_blocks(
            one_block, basis, grads,
            residual_d0=None if config.linf_norm_clip is not None else plan.d0,
            principal_d0=float(config.principal_d0),
            budget_split=config.budget_split,
            budget_quantile=config.budget_quantile, **budget)
    except ValueError as e:
        if not budget:
            raise
        raise ValueError(f'--target_epsilon={plan.target_epsilon:g} '
                         f'cannot be met: {e}') from e
    plan.l2_norm_clip = planned.l2_norm_clips
    plan.linf_norm_clip = planned.linf_norm_clips
    plan.noise_multiplier = planned.noise_multipliers
    return basis


def mechanism(plan: Plan) -> tf_twice.TwiceSamplingConfig:
    """The plan's mechanism as the one config the library derives from."""

    def per_block(value):
        return tuple(value) if isinstance(value, (list, tuple)) else (value,)

    return tf_twice.TwiceSamplingConfig(
        num_examples=plan.num_examples,
        expected_batch_size=plan.expected_batch_size,
        coordinate_sampling_rate=plan.coordinate_sampling_rate,
        blocks=tuple(
            tf_twice.Block(l2_norm_clip=c2, linf_norm_clip=c_inf,
                           noise_multiplier=z)
            for c2, c_inf, z in zip(per_block(plan.l2_norm_clip),
                                    per_block(plan.linf_norm_clip),
                                    per_block(plan.noise_multiplier))))


def privacy_statement(plan: Plan, steps: int) -> Tuple[str, float]:
    """The statement and its epsilon for `steps` steps of `plan`."""
    n, batch = plan.num_examples, plan.expected_batch_size
    epochs = num_epochs_for_steps(n, batch, steps)
    common = dict(block_dimensions=plan.block_dimensions)
    eps, _ = accounting.compute_twice_sampling_privacy(
        n, batch, plan.noise_multiplier, epochs, plan.delta,
        plan.coordinate_sampling_rate, plan.l2_norm_clip,
        plan.linf_norm_clip, **common)
    text = accounting.compute_twice_sampling_privacy_statement(
        number_of_examples=n, batch_size=batch, num_epochs=epochs,
        noise_multiplier=plan.noise_multiplier, delta=plan.delta,
        coordinate_sampling_rate=plan.coordinate_sampling_rate,
        l2_norm_clip=plan.l2_norm_clip, linf_norm_clip=plan.linf_norm_clip,
        **common)
    return text, float(eps)
