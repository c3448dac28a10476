"""The training script's plan: the mechanism and the schedule of a run.

`resolve_plan` turns a checked `TrainConfig` into the run's mechanism, the
`TwiceSamplingConfig` the library derives everything from (sampling
rates, clips, calibrated or given noise), and its schedule (the planned
steps); `hybrid_setup` learns the basis from the PUBLIC split and gives the
mechanism hybrid clipping's per-block clips and noise. `privacy_statement`
is the statement for a number of the mechanism's steps.
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
import tf_twice.keras as private_keras
from tf_twice.keras import basis_refresh
from tf_twice.keras import plan_progress
from tf_twice.mechanism import basis as basis_lib

from examples.training import data as data_lib
from examples.training import modeling
from examples.training import recipes
from examples.training import settings
from examples.training.settings import DEFAULT_COORDINATE_SAMPLING_RATE
from examples.training.settings import DEFAULT_D0
from examples.training.settings import PRIVATE_MODES
from examples.training.settings import TrainConfig


@dataclasses.dataclass(frozen=True)
class Plan:
    """The resolved mechanism and schedule of a run.

    `mechanism` is the one `TwiceSamplingConfig` that the sampling, the
    model, the ledger and the statement derive from. In nonprivate mode it
    is `non_private` (the batch size and the l2 clip of the flags, no
    noise). In hybrid mode it is the flags' one-block mechanism (the global
    l2 budget; the residual's l-infinity clip when --linf_norm_clip is
    given, else `d0` sets it) until `hybrid_setup` returns the plan with
    one Block per basis block. `d0` is the flag's (or default) d0 where it
    sets an l-infinity clip, else None.
    """

    mode: str
    mechanism: tf_twice.TwiceSamplingConfig
    delta: Optional[float]
    d0: Optional[float]
    target_epsilon: Optional[float]
    steps_per_epoch: int
    planned_steps: int
    ranks: Tuple[int, ...] = ()
    # --plan_by_progress: the chosen candidate and every candidate's mean
    # public one-step loss decrease.
    progress: Optional[Dict[str, Any]] = None


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
    recipe = recipes.recipe_for(config.dataset, config.features)
    if config.batch_size is not None:
        if float(config.batch_size) > n:
            raise settings.flag_error(
                'batch_size', f'in (0, {n}] (the private training examples)',
                config.batch_size)
        batch = float(config.batch_size)
    elif config.example_sampling_rate is not None:
        batch = float(config.example_sampling_rate) * n
    else:
        batch = float(min(recipe.batch_size, n))
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
            if config.mode == 'twice':
                # Hybrid: plan_blocks sets the residual's clip from d0.
                c_inf = c2 / math.sqrt(d0)
    mechanism = tf_twice.TwiceSamplingConfig.single(
        num_examples=n, expected_batch_size=batch,
        coordinate_sampling_rate=q2, l2_norm_clip=c2, linf_norm_clip=c_inf,
        noise_multiplier=config.noise_multiplier, non_private=not private)
    if private:
        steps_per_epoch = mechanism.steps_per_epoch
    else:
        steps_per_epoch = int(math.ceil(n / batch))
    if config.steps is not None:
        planned = int(config.steps)
    else:
        epochs = recipe.epochs if config.epochs is None else config.epochs
        planned = max(1, int(math.ceil(float(epochs) * steps_per_epoch)))
    delta = None
    target = None
    if private:
        delta = (settings.default_delta(n) if config.delta is None
                 else float(config.delta))
        if config.noise_multiplier is None:
            target = (recipe.target_epsilon if config.target_epsilon is None
                      else float(config.target_epsilon))
            if config.mode != 'hybrid':
                mechanism = _calibrate(mechanism, target, delta, planned)
    return Plan(mode=config.mode, mechanism=mechanism, delta=delta, d0=d0,
                target_epsilon=target, steps_per_epoch=steps_per_epoch,
                planned_steps=planned,
                ranks=(tuple(config.ranks) if config.mode == 'hybrid'
                       else ()))


def _calibrate(mechanism: tf_twice.TwiceSamplingConfig, target: float,
               delta: float, steps: int) -> tf_twice.TwiceSamplingConfig:
    try:
        return mechanism.calibrate(target_epsilon=target, delta=delta,
                                   steps=steps)
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
        example_sampling_rate=plan.mechanism.example_sampling_rate,
        coordinate_sampling_rate=plan.mechanism.coordinate_sampling_rate,
        public_examples=int(config.public_examples))
    record.update(settings.budget_split_settings(config))
    if config.noise_multiplier is None:
        record.update(target_epsilon=plan.target_epsilon, delta=plan.delta,
                      planned_steps=plan.planned_steps)
    return record


def hybrid_blocks_record(config: TrainConfig, plan: Plan) -> Dict[str, Any]:
    """run.json's record of a hybrid run's blocks, with what determined them
    (`hybrid_setup` reuses the blocks when a resumed run has the same)."""
    mechanism = plan.mechanism
    extra = {} if plan.progress is None else dict(progress=plan.progress)
    return dict(settings=hybrid_record(config, plan), **extra,
                l2_norm_clip=list(mechanism.l2_norm_clips),
                linf_norm_clip=list(mechanism.linf_norm_clips),
                noise_multiplier=list(mechanism.noise_multipliers),
                coordinate_sampling_rate=list(
                    mechanism.coordinate_sampling_rates))


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
                 recorded: Optional[Mapping[str, Any]]
                 ) -> Tuple[Plan, basis_lib.HybridBasis]:
    """Learns the basis from the PUBLIC split; plans per-block clips/noise.

    Returns the plan whose mechanism has one Block per basis block, and the
    basis: `tf_twice.keras.plan_hybrid_clipping` of the plan's one-block
    mechanism (l2 budgets split by `--budget_split` and `--budget_quantile`
    from public statistics; the residual's l-infinity clip is
    `--linf_norm_clip` (capped at its c2) or c2 / sqrt(`--d0`), principal
    block j's is c2_j / sqrt(min(`--principal_d0`, r_j)); the noise is
    `--noise_multiplier` on every block or optimised per block
    (`--noise_objective`) for the target epsilon after the planned steps).
    All of it comes from public data and the flags, never from the private
    set. With `--plan_by_progress` the principal keep rate (the residual's
    or 1) and the noise objective, the noise calibrated, are chosen by
    `tf_twice.keras.plan_progress.choose_plan` (the public one-step loss
    decrease of each plan's update at `--learning_rate`). A resumed run
    with the same settings reuses the recorded blocks (clips, noise, keep
    rates) with a basis learned at the restored weights.
    """
    seed = 0 if config.seed is None else config.seed
    one_block = plan.mechanism
    record = hybrid_record(config, plan)
    if recorded is not None and recorded.get('settings') == json.loads(
            json.dumps(record)):
        basis, _ = learn_public_basis(config, plan, data, inner, seed)
        # Records before per-block rates were kept hold none: every block
        # then had the config's rate.
        rates = recorded.get('coordinate_sampling_rate',
                             [None] * len(recorded['l2_norm_clip']))
        blocks = tuple(
            tf_twice.Block(l2_norm_clip=c2, linf_norm_clip=c_inf,
                           noise_multiplier=z, coordinate_sampling_rate=q2)
            for c2, c_inf, z, q2 in zip(recorded['l2_norm_clip'],
                                        recorded['linf_norm_clip'],
                                        recorded['noise_multiplier'], rates))
        mechanism = tf_twice.TwiceSamplingConfig(
            num_examples=one_block.num_examples,
            expected_batch_size=one_block.expected_batch_size,
            coordinate_sampling_rate=one_block.coordinate_sampling_rate,
            blocks=blocks).with_dimensions(basis.block_dimensions)
        return dataclasses.replace(
            plan, mechanism=mechanism, ranks=tuple(basis.ranks),
            progress=recorded.get('progress')), basis
    budget = {} if one_block.is_calibrated else dict(
        target_epsilon=plan.target_epsilon, delta=plan.delta,
        steps=plan.planned_steps)
    public_x = data_lib.to_unit_float(data.x_public)

    def planned(rate, objective) -> private_keras.HybridPlan:
        # No rate: plan_blocks's default (unmasked principal blocks).
        rate_kwargs = {} if rate is None else dict(
            principal_coordinate_sampling_rate=rate)
        try:
            return private_keras.plan_hybrid_clipping(
                inner, modeling.per_example_loss(), public_x, data.y_public,
                one_block, seed=seed, batch_size=config.physical_batch_size,
                residual_d0=plan.d0, principal_d0=float(config.principal_d0),
                budget_split=config.budget_split,
                budget_quantile=config.budget_quantile,
                noise_objective=objective,
                **rate_kwargs,
                **basis_kwargs(config, plan), **budget)
        except ValueError as e:
            if not budget:
                raise
            raise ValueError(f'--target_epsilon={plan.target_epsilon:g} '
                             f'cannot be met: {e}') from e

    progress = None
    if not config.plan_by_progress:
        mechanism, basis = planned(config.principal_coordinate_sampling_rate,
                                   config.noise_objective)
    else:
        # Candidates from public data only, each calibrated for the run's
        # target (check_plan_by_progress); the choice reads public data and
        # a fixed seed.
        objectives = settings.NOISE_OBJECTIVES
        candidates = {
            f'principal rate {rate:g}, {objective}': planned(rate, objective)
            for rate in sorted({one_block.coordinate_sampling_rate, 1.0})
            for objective in objectives}
        best, scores = plan_progress.choose_plan(
            inner, modeling.per_example_loss(), public_x, data.y_public,
            candidates, learning_rate=float(config.learning_rate), seed=0,
            batch_size=config.physical_batch_size)
        mechanism, basis = candidates[best]
        progress = dict(chosen=best, decreases={
            name: score.mean for name, score in scores.items()})
    return dataclasses.replace(plan, mechanism=mechanism,
                               ranks=tuple(basis.ranks),
                               progress=progress), basis


def privacy_statement(plan: Plan, steps: int) -> Tuple[str, float]:
    """The statement and its epsilon for `steps` steps of `plan`.

    The statement's numbers are those of the step the ledger charges
    (`mechanism.dp_event()`: one value for one block, one per block for
    hybrid clipping).
    """
    mechanism = plan.mechanism
    n, batch = mechanism.num_examples, mechanism.expected_batch_size
    event = mechanism.dp_event()
    text = accounting.compute_twice_sampling_privacy_statement(
        number_of_examples=n, batch_size=batch,
        num_epochs=num_epochs_for_steps(n, batch, steps),
        noise_multiplier=event.noise_multiplier, delta=plan.delta,
        coordinate_sampling_rate=event.coordinate_sampling_rate,
        l2_norm_clip=event.l2_norm_clip, linf_norm_clip=event.linf_norm_clip,
        block_dimensions=event.block_dimensions)
    return text, mechanism.epsilon(steps, plan.delta)
