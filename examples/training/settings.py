"""The training script's settings: `TrainConfig` and its checks.

`TrainConfig` has one field per command-line flag of examples/train.py;
`check_config` checks what can be checked before the data is loaded and
names the flag in every error. The other modules trust a checked config.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from tf_twice import _validate
from tf_twice import config as config_lib
from tf_twice import models
from tf_twice.hybrid import budget_splits
from tf_twice.hybrid import budgets as hybrid_budgets

from examples.training import recipes

MODES = ('nonprivate', 'dpsgd', 'twice', 'hybrid')
PRIVATE_MODES = ('dpsgd', 'twice', 'hybrid')
DATASETS = ('digits', 'fashion_mnist', 'npz', 'cifar10', 'svhn_cropped',
            'mnist')
OPTIMIZERS = ('sgd', 'adam')
# Learning-rate schedules (tf.keras.optimizers.schedules), evaluated at the
# optimizer's iteration count, which checkpoints restore.
LR_SCHEDULES = ('constant', 'cosine', 'step')
DEFAULT_LR_DECAY_RATE = 0.1
# The batch size, epochs, target epsilon, mode, model, learning rate,
# momentum, l2 clip and physical batch size default to the recipe of the
# dataset and features (examples.training.recipes).
FEATURES = recipes.FEATURES
DEFAULT_COORDINATE_SAMPLING_RATE = 0.5
DEFAULT_D0 = 100.0
DEFAULT_PUBLIC_EXAMPLES = 200
DEFAULT_RANKS = (16,)
BUDGET_SPLITS = budget_splits.BUDGET_SPLITS
DEFAULT_BUDGET_QUANTILE = budget_splits.DEFAULT_BUDGET_QUANTILE
NOISE_OBJECTIVES = hybrid_budgets.NOISE_OBJECTIVES


@dataclasses.dataclass
class TrainConfig:
    """The settings of one run; one field per command-line flag.

    `None` means "the documented default": the recipe's
    (`examples.training.recipes`, filled in by `check_config` or read by
    `resolve_plan`), else the constant above.
    """

    mode: Optional[str] = None
    dataset: str = 'digits'
    features: str = 'none'
    data_dir: Optional[str] = None
    data_path: Optional[str] = None
    validation_examples: int = 0
    model: Optional[str] = None
    target_epsilon: Optional[float] = None
    noise_multiplier: Optional[float] = None
    delta: Optional[float] = None
    example_sampling_rate: Optional[float] = None
    batch_size: Optional[float] = None
    coordinate_sampling_rate: Optional[float] = None
    l2_norm_clip: Optional[float] = None
    linf_norm_clip: Optional[float] = None
    d0: Optional[float] = None
    principal_d0: float = 1.0
    principal_coordinate_sampling_rate: Optional[float] = None  # None: 1.
    budget_split: str = budget_splits.DEFAULT_BUDGET_SPLIT
    budget_quantile: Optional[float] = None
    replan_budgets: bool = False
    plan_by_progress: bool = False
    noise_objective: str = hybrid_budgets.NOISE_OBJECTIVES[0]
    epochs: Optional[float] = None
    steps: Optional[int] = None
    physical_batch_size: Optional[int] = None
    learning_rate: Optional[float] = None
    lr_schedule: str = 'constant'
    lr_decay_steps: Optional[int] = None
    lr_decay_rate: Optional[float] = None
    lr_min_fraction: Optional[float] = None
    momentum: Optional[float] = None
    ema_momentum: Optional[float] = None
    optimizer: str = 'sgd'
    public_examples: Optional[int] = None
    ranks: Optional[Sequence[int]] = None
    parameter_groups: int = 1
    basis_refresh_steps: int = 20
    checkpoint_dir: Optional[str] = None
    tensorboard_dir: Optional[str] = None
    seed: Optional[int] = None
    verbose: int = 1

    @classmethod
    def from_object(cls, config: Any) -> 'TrainConfig':
        """A TrainConfig from a TrainConfig, a mapping or flags-like object.

        Missing fields take their defaults; unknown mapping keys are refused.
        """
        if isinstance(config, cls):
            return dataclasses.replace(config)
        names = [f.name for f in dataclasses.fields(cls)]
        if isinstance(config, Mapping):
            unknown = sorted(set(config) - set(names))
            if unknown:
                raise ValueError(f'unknown settings {unknown}; allowed: '
                                 f'{names}.')
            return cls(**dict(config))
        values = {}
        for name in names:
            if hasattr(config, name):
                values[name] = getattr(config, name)
        return cls(**values)



def check_switches(config: TrainConfig) -> None:
    """Every bool setting is a bool: the string 'false' (a mapping or a
    search's value) would otherwise switch it on."""
    for field in dataclasses.fields(TrainConfig):
        value = getattr(config, field.name)
        if field.type in (bool, 'bool') and not isinstance(value, bool):
            raise flag_error(field.name, 'true or false', value)


def flag_error(flag: str, allowed: str, value: Any) -> ValueError:
    return ValueError(f'--{flag} must be {allowed}; got {value!r}.')


def check_number(flag: str, value: Any) -> float:
    return _validate.real(f'--{flag}', value)


def check_positive(flag: str, value: Any) -> float:
    return _validate.positive(f'--{flag}', value)


def check_integer(flag: str, value: Any, low: int) -> int:
    return _validate.integer(f'--{flag}', value, low)


def check_at_least_one(flag: str, value: Any) -> float:
    """A finite number >= 1 (d0 = (c2 / c_inf)^2: c_inf <= c2)."""
    number = _validate.positive(f'--{flag}', value)
    if number < 1.0:
        raise flag_error(flag, 'a finite number >= 1', value)
    return number


def check_choice(flag: str, value: Any, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise flag_error(flag, f'one of {", ".join(allowed)}', value)
    return value


def parse_ranks(ranks: Any) -> Tuple[int, ...]:
    if ranks is None:
        return DEFAULT_RANKS
    if isinstance(ranks, str):
        ranks = [r for r in ranks.split(',') if r.strip()]
    elif isinstance(ranks, int) and not isinstance(ranks, bool):
        ranks = [ranks]  # One block, e.g. a search's --set=ranks=16.
    try:
        parsed = tuple(int(str(r).strip()) for r in ranks)
    except (TypeError, ValueError):
        raise flag_error('ranks', 'a comma-separated list of integers >= 1',
                         ranks) from None
    if not parsed or min(parsed) < 1:
        raise flag_error('ranks', 'a comma-separated list of integers >= 1',
                         ranks)
    return parsed


def check_config(config: Any) -> TrainConfig:
    """Checks what can be checked before the data is loaded.

    Returns:
      The config as a `TrainConfig`, with its recipe's settings filled in
      where the flags left them unset.

    Raises:
      ValueError: naming the flag and its allowed range.
    """
    config = TrainConfig.from_object(config)
    check_switches(config)
    check_choice('dataset', config.dataset, DATASETS)
    check_choice('features', config.features, FEATURES)
    recipes.apply(config)
    check_choice('mode', config.mode, MODES)
    if (config.dataset == 'npz') != (config.data_path is not None):
        raise flag_error('data_path', 'the .npz file to read for '
                         '--dataset=npz, and unset for other datasets',
                         config.data_path)
    check_choice('model', config.model, tuple(sorted(models.MODELS)))
    check_choice('optimizer', config.optimizer, OPTIMIZERS)
    private = config.mode in PRIVATE_MODES
    if config.target_epsilon is not None and (
            config.noise_multiplier is not None):
        raise ValueError('give exactly one of --target_epsilon and '
                         '--noise_multiplier (the noise is calibrated to the '
                         'target, or set directly); got both.')
    if not private and (config.target_epsilon is not None
                        or config.noise_multiplier is not None
                        or config.delta is not None):
        raise ValueError(
            '--mode=nonprivate makes no privacy claim; --target_epsilon, '
            '--noise_multiplier and --delta apply only to the modes '
            f'{", ".join(PRIVATE_MODES)}.')
    if config.target_epsilon is not None:
        check_positive('target_epsilon', config.target_epsilon)
    if config.noise_multiplier is not None:
        check_positive('noise_multiplier', config.noise_multiplier)
    if config.delta is not None:
        _validate.probability('--delta', config.delta)
    if config.example_sampling_rate is not None and (
            config.batch_size is not None):
        raise ValueError('give at most one of --example_sampling_rate (q1) '
                         'and --batch_size (the expected batch size n * q1); '
                         'got both.')
    if config.example_sampling_rate is not None:
        _validate.rate('--example_sampling_rate', config.example_sampling_rate)
    if config.batch_size is not None:
        check_positive('batch_size', config.batch_size)
    q2 = config.coordinate_sampling_rate
    if q2 is not None:
        q2 = _validate.rate('--coordinate_sampling_rate', q2)
        if config.mode in ('dpsgd', 'nonprivate') and q2 != 1.0:
            raise flag_error(
                'coordinate_sampling_rate',
                f'1 (or unset) for --mode={config.mode}; use --mode=twice '
                'for coordinate sampling', config.coordinate_sampling_rate)
    check_positive('l2_norm_clip', config.l2_norm_clip)
    if config.linf_norm_clip is not None and config.d0 is not None:
        raise ValueError('give at most one of --linf_norm_clip and --d0 '
                         '(c_inf = l2_norm_clip / sqrt(d0)); got both.')
    if config.mode in ('dpsgd', 'nonprivate') and (
            config.linf_norm_clip is not None or config.d0 is not None):
        raise ValueError(f'--mode={config.mode} has no l-infinity clip; '
                         '--linf_norm_clip and --d0 apply to --mode=twice '
                         'and --mode=hybrid.')
    if config.linf_norm_clip is not None:
        check_positive('linf_norm_clip', config.linf_norm_clip)
    if config.d0 is not None:
        check_at_least_one('d0', config.d0)
    check_at_least_one('principal_d0', config.principal_d0)
    check_budget_split(config)
    check_noise_objective(config)
    check_principal_coordinate_sampling_rate(config)
    check_replan_budgets(config)
    check_plan_by_progress(config)
    if config.epochs is not None and config.steps is not None:
        raise ValueError('give at most one of --epochs and --steps; got '
                         'both.')
    if config.epochs is not None:
        check_positive('epochs', config.epochs)
    if config.steps is not None:
        check_integer('steps', config.steps, 1)
    check_integer('physical_batch_size', config.physical_batch_size, 1)
    check_integer('validation_examples', config.validation_examples, 0)
    check_positive('learning_rate', config.learning_rate)
    momentum = check_number('momentum', config.momentum)
    if not 0.0 <= momentum < 1.0:
        raise flag_error('momentum', 'in [0, 1)', config.momentum)
    if config.ema_momentum is not None:
        ema = check_number('ema_momentum', config.ema_momentum)
        if not 0.0 < ema < 1.0:
            raise flag_error('ema_momentum', 'in (0, 1), or unset for no '
                             'averaging', config.ema_momentum)
    check_lr_schedule(config)
    if config.public_examples is not None:
        check_integer('public_examples', config.public_examples, 0)
    if config.mode == 'hybrid':
        if config.public_examples is not None and (
                config.public_examples < 1):
            raise flag_error('public_examples',
                             'an integer >= 1 for --mode=hybrid',
                             config.public_examples)
        config.ranks = parse_ranks(config.ranks)
    elif config.ranks is not None:
        config.ranks = parse_ranks(config.ranks)
    check_integer('parameter_groups', config.parameter_groups, 1)
    check_integer('basis_refresh_steps', config.basis_refresh_steps, 0)
    if config.seed is not None:
        check_integer('seed', config.seed, 0)
    check_integer('verbose', config.verbose, 0)
    return config


def check_budget_split(config: TrainConfig) -> None:
    """--budget_split (hybrid only) and --budget_quantile (its 'quantile'
    split only): how plan_blocks splits the global l2 budget."""
    check_choice('budget_split', config.budget_split,
                 BUDGET_SPLITS)
    if (config.mode != 'hybrid' and
            config.budget_split != budget_splits.DEFAULT_BUDGET_SPLIT):
        raise flag_error('budget_split',
                         f'{budget_splits.DEFAULT_BUDGET_SPLIT} (or unset) '
                         f'for --mode={config.mode}; it splits hybrid '
                         'clipping\'s l2 budget', config.budget_split)
    if config.budget_quantile is None:
        return
    if config.budget_split != 'quantile':
        raise flag_error('budget_quantile', 'unset unless '
                         '--budget_split=quantile', config.budget_quantile)
    _validate.rate('--budget_quantile', config.budget_quantile)


def check_principal_coordinate_sampling_rate(config: TrainConfig) -> None:
    """--principal_coordinate_sampling_rate: hybrid only, a rate in (0, 1]
    (at least the mask resolution, 2**-16)."""
    rate = config.principal_coordinate_sampling_rate
    if rate is None:
        return
    if config.mode != 'hybrid':
        raise flag_error('principal_coordinate_sampling_rate',
                         'unset unless --mode=hybrid', rate)
    try:
        config_lib.check_coordinate_sampling_rate(rate)
    except ValueError as e:
        raise flag_error('principal_coordinate_sampling_rate',
                         'in [2**-16, 1]', rate) from e


def check_replan_budgets(config: TrainConfig) -> None:
    """--replan_budgets: hybrid only, with a basis refresh to re-plan at."""
    if not config.replan_budgets:
        return
    if config.mode != 'hybrid' or not config.basis_refresh_steps:
        raise flag_error('replan_budgets', 'false unless --mode=hybrid with '
                         '--basis_refresh_steps >= 1', config.replan_budgets)


def check_plan_by_progress(config: TrainConfig) -> None:
    """--plan_by_progress: hybrid only; it chooses the principal keep rate
    and the noise objective, so neither may be given."""
    if not config.plan_by_progress:
        return
    if config.mode != 'hybrid' or config.noise_multiplier is not None:
        # With a fixed noise multiplier another keep rate is another
        # epsilon: the choice would set the run's epsilon.
        raise flag_error('plan_by_progress', 'false unless --mode=hybrid '
                         'calibrates its noise (no --noise_multiplier)',
                         config.plan_by_progress)
    if config.principal_coordinate_sampling_rate is not None:
        raise flag_error('principal_coordinate_sampling_rate',
                         'unset with --plan_by_progress (which chooses it)',
                         config.principal_coordinate_sampling_rate)
    if config.noise_objective != NOISE_OBJECTIVES[0]:
        raise flag_error('noise_objective', f'{NOISE_OBJECTIVES[0]} (or '
                         'unset) with --plan_by_progress (which chooses it)',
                         config.noise_objective)


def check_noise_objective(config: TrainConfig) -> None:
    """--noise_objective: hybrid only, with the per-block noise optimised."""
    check_choice('noise_objective', config.noise_objective, NOISE_OBJECTIVES)
    if config.noise_objective == NOISE_OBJECTIVES[0]:
        return
    if config.mode != 'hybrid' or config.noise_multiplier is not None:
        raise flag_error('noise_objective',
                         f'{NOISE_OBJECTIVES[0]} (or unset) unless '
                         '--mode=hybrid optimises the per-block noise (no '
                         '--noise_multiplier)', config.noise_objective)


def budget_split_settings(config: TrainConfig) -> Dict[str, Any]:
    """--budget_split, --budget_quantile, --noise_objective,
    --principal_coordinate_sampling_rate, --replan_budgets and
    --plan_by_progress (how the blocks' clips, noise and masks are planned),
    only when not the defaults:
    records written before these flags existed stay equal to the default
    run's (resumes and stored results stay valid)."""
    settings: Dict[str, Any] = {}
    if config.budget_split != budget_splits.DEFAULT_BUDGET_SPLIT:
        settings['budget_split'] = config.budget_split
    if config.budget_quantile is not None:
        settings['budget_quantile'] = float(config.budget_quantile)
    if config.noise_objective != NOISE_OBJECTIVES[0]:
        settings['noise_objective'] = config.noise_objective
    if config.principal_coordinate_sampling_rate is not None:
        settings['principal_coordinate_sampling_rate'] = float(
            config.principal_coordinate_sampling_rate)
    if config.replan_budgets:
        settings['replan_budgets'] = True
    if config.plan_by_progress:
        settings['plan_by_progress'] = True
    return settings


def check_lr_schedule(config: TrainConfig) -> None:
    """Checks --lr_schedule and the flags that only some schedules take.

    constant: none of them. cosine: --lr_decay_steps (default: the planned
    steps) and --lr_min_fraction (the final rate over the initial, default
    0). step: --lr_decay_steps (required: the rate is multiplied by
    --lr_decay_rate, default 0.1, every that many steps).
    """
    schedule = check_choice('lr_schedule', config.lr_schedule, LR_SCHEDULES)
    takes = {'constant': (), 'cosine': ('lr_decay_steps', 'lr_min_fraction'),
             'step': ('lr_decay_steps', 'lr_decay_rate')}[schedule]
    for flag in ('lr_decay_steps', 'lr_decay_rate', 'lr_min_fraction'):
        if getattr(config, flag) is not None and flag not in takes:
            raise ValueError(f'--{flag} does not apply to --lr_schedule='
                             f'{schedule}; it applies to '
                             + ' and '.join(
                                 f'--lr_schedule={s}' for s, names in (
                                     ('cosine', ('lr_decay_steps',
                                                 'lr_min_fraction')),
                                     ('step', ('lr_decay_steps',
                                               'lr_decay_rate')))
                                 if flag in names) + '.')
    if schedule == 'step' and config.lr_decay_steps is None:
        raise flag_error('lr_decay_steps', 'an integer >= 1 for '
                         '--lr_schedule=step (the steps between decays)',
                         None)
    if config.lr_decay_steps is not None:
        check_integer('lr_decay_steps', config.lr_decay_steps, 1)
    if config.lr_decay_rate is not None:
        _validate.rate('--lr_decay_rate', config.lr_decay_rate)
    if config.lr_min_fraction is not None:
        fraction = check_number('lr_min_fraction', config.lr_min_fraction)
        if not 0.0 <= fraction < 1.0:
            raise flag_error('lr_min_fraction', 'in [0, 1)',
                             config.lr_min_fraction)


def default_delta(num_examples: int) -> float:
    """1 / n rounded down to a power of ten, and at most 1e-5."""
    return min(1e-5, 10.0 ** math.floor(math.log10(1.0 / num_examples)))
