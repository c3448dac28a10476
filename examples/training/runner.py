"""The training run: `build_run` puts the parts together, `train` runs it.

`build_run` checks the flags, loads the data, resolves the plan, builds the
model (a `tf_twice.keras.DPModel` in the private modes), the privacy ledger,
the Poisson-sampled input and the callbacks, and resumes from
`--checkpoint_dir` (`examples.training.resume`). `train` fits the steps
that remain of the plan and returns the results: the mechanism, the
ledger's epsilon, the privacy statement for the same steps and the test
accuracy. `print_results` is the script's report.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any, Dict, List, Mapping, Optional, Tuple

import tensorflow as tf

from tf_twice import sampling
from tf_twice.keras import DPModel
from tf_twice.keras import BasisRefresh
from tf_twice.keras import PrivacyLedger

from examples.training import modeling
from examples.training import plan as plan_lib
from examples.training import recipes
from examples.training import resume
from examples.training import settings
from examples.training.data import Data
from examples.training.data import load_data
from examples.training.data import preprocess
from examples.training.data import to_unit_float
from examples.training.plan import Plan
from examples.training.settings import PRIVATE_MODES
from examples.training.settings import TrainConfig


@dataclasses.dataclass
class Run:
    """What `build_run` prepares and `train` executes."""

    config: TrainConfig
    plan: Plan
    data: Data
    model: tf.keras.Model
    inner_model: tf.keras.Model
    dataset: tf.data.Dataset
    callbacks: List[tf.keras.callbacks.Callback]
    ledger: Optional[PrivacyLedger]
    done_steps: int
    remaining_steps: int
    steps_per_iteration: int
    epochs: int
    checkpoint_path: Optional[str]
    basis_refresh: Any = None
    # A float or a tf.keras.optimizers.schedules schedule.
    learning_rate: Any = None
    # The recipe in force and the flags that overrode it (one line).
    recipe: str = ''


class _StopAfterSteps(tf.keras.callbacks.Callback):
    """Stops `fit` after a number of steps (mid-epoch if needed)."""

    def __init__(self, steps: int):
        super().__init__()
        self._steps = steps
        self._seen = 0

    def on_train_batch_end(self, batch, logs=None):
        self._seen += 1
        if self._seen >= self._steps:
            self.model.stop_training = True


def _given(config: TrainConfig) -> List[str]:
    """The recipe's flags (and their alternatives) that the user set."""
    names = list(recipes.Recipe.FILLED) + list(recipes.Recipe.ALTERNATIVES)
    names += list(recipes.Recipe.ALTERNATIVES.values())
    return [name for name in names if getattr(config, name) is not None]


def _held_out_splits(config: TrainConfig, data: Optional[Data]) -> None:
    """Sets --public_examples from the data given, or its default, and
    checks --validation_examples against the data given."""
    if data is not None:
        validation = (0 if data.x_validation is None
                      else len(data.x_validation))
        if config.validation_examples != validation:
            raise settings.flag_error(
                'validation_examples', f'{validation}, the size of the '
                'validation split of the data given',
                config.validation_examples)
        held_out = len(data.x_public)
        if config.public_examples is None:
            config.public_examples = held_out
        elif config.public_examples != held_out:
            raise settings.flag_error(
                'public_examples', f'{held_out}, the size of the public '
                'split of the data given', config.public_examples)
        if config.mode == 'hybrid' and not held_out:
            raise ValueError('--mode=hybrid needs public examples; the data '
                             'given has no public split (--public_examples '
                             '>= 1).')
    elif config.public_examples is None:
        config.public_examples = (settings.DEFAULT_PUBLIC_EXAMPLES
                                  if config.mode == 'hybrid' else 0)


def _input(config: TrainConfig, plan: Plan, data: Data, done: int,
           steps_per_iteration: int) -> tf.data.Dataset:
    """Poisson-sampled logical batches (private modes), else shuffled."""
    if config.mode in PRIVATE_MODES:
        # A resumed run starts past every step index an earlier run drew,
        # so no logical batch of the seed's stream is used twice.
        return sampling.poisson_batches(
            data.x_train, data.y_train,
            expected_batch_size=plan.mechanism.expected_batch_size,
            steps=steps_per_iteration, seed=config.seed, start_step=done,
            preprocess_fn=preprocess)
    batch = int(round(plan.mechanism.expected_batch_size))
    dataset = tf.data.Dataset.from_tensor_slices((data.x_train, data.y_train))
    dataset = dataset.shuffle(
        len(data.x_train), seed=config.seed,
        reshuffle_each_iteration=True).repeat().batch(batch)
    return dataset.map(preprocess).prefetch(tf.data.AUTOTUNE)


def build_run(config: Any, data: Optional[Data] = None) -> Run:
    """Builds the model, the input pipeline, the ledger and the callbacks.

    Args:
      config: a `TrainConfig`, mapping or flags-like object.
      data: the loaded data; default: `load_data` with the config's dataset
        and public split.

    Raises:
      ValueError: naming a flag outside its range, or a checkpoint
        directory that cannot be resumed (`examples.training.resume`).
    """
    config = TrainConfig.from_object(config)
    given = _given(config)
    config = settings.check_config(config)
    recipe = recipes.describe(
        recipes.recipe_for(config.dataset, config.features), given,
        config.mode)
    _held_out_splits(config, data)
    if data is None:
        data = load_data(config.dataset,
                         public_examples=config.public_examples,
                         data_dir=config.data_dir,
                         data_path=config.data_path,
                         features=config.features,
                         validation_examples=config.validation_examples)
    plan = plan_lib.resolve_plan(config, len(data.x_train))
    if config.seed is not None:
        tf.keras.utils.set_random_seed(config.seed)
    inner = modeling.build_inner_model(config, data)
    private = config.mode in PRIVATE_MODES
    basis_seed = 0 if config.seed is None else config.seed

    checkpoint_path = ledger_path = previous = None
    has_checkpoint = False
    if config.checkpoint_dir:
        os.makedirs(config.checkpoint_dir, exist_ok=True)
        checkpoint_path = os.path.join(config.checkpoint_dir,
                                       resume.CHECKPOINT_NAME)
        ledger_path = os.path.join(config.checkpoint_dir,
                                   resume.LEDGER_FILENAME)
        has_checkpoint = os.path.exists(checkpoint_path)
        resume.check_resume(config, config.checkpoint_dir, has_checkpoint,
                            os.path.exists(ledger_path))
        previous = resume.read_run_file(config.checkpoint_dir)

    basis = None
    if config.mode == 'hybrid':
        plan, basis = plan_lib.hybrid_setup(
            config, plan, data, inner,
            None if previous is None else previous.get('hybrid'))
    if private:
        model = DPModel(inner, plan.mechanism,
                        physical_batch_size=config.physical_batch_size,
                        seed=config.seed, basis=basis)
    else:
        model = inner
    learning_rate = modeling.learning_rate(config, plan.planned_steps)
    model.compile(optimizer=modeling.optimizer(config, learning_rate),
                  loss=modeling.loss(), metrics=['accuracy'])

    ledger = None
    if private:
        ledger = PrivacyLedger.for_model(
            model, delta=plan.delta, target_epsilon=plan.target_epsilon,
            max_steps=plan.planned_steps, state_path=ledger_path,
            log_dir=config.tensorboard_dir, verbose=config.verbose)
        if ledger.steps:  # Resumed: its steps must be this mechanism's.
            resume.check_mechanism(
                config.checkpoint_dir, ledger,
                None if previous is None
                else previous.get('mechanism_settings'),
                resume.mechanism_settings(config, plan))
    if has_checkpoint:
        # Weights and optimizer state (its iteration count, which positions
        # a learning-rate schedule); the step keys are never saved (a
        # seeded stream depends on the restored weights: no replay).
        # Keras restores an optimizer's state only into existing variables.
        model.optimizer.build(model.trainable_variables)
        model.load_weights(checkpoint_path)
        if basis is not None:
            # The basis is not checkpointed: relearn it from the PUBLIC
            # split at the restored weights (same structure, same event).
            basis, _ = plan_lib.learn_public_basis(config, plan, data, inner,
                                                   basis_seed)
            model.set_basis(basis)
    if config.checkpoint_dir:
        resume.write_run_file(
            config, plan, config.checkpoint_dir,
            hybrid=(plan_lib.hybrid_blocks_record(config, plan)
                    if basis is not None else None))

    if ledger is not None:
        done = ledger.steps
    else:
        done = int(model.optimizer.iterations.numpy()) if has_checkpoint \
            else 0
    remaining = max(0, plan.planned_steps - done)
    per_iteration = max(1, min(plan.steps_per_epoch, remaining))
    epochs = max(1, int(math.ceil(remaining / per_iteration)))
    dataset = _input(config, plan, data, done, per_iteration)

    basis_refresh = None
    if basis is not None and config.basis_refresh_steps:
        basis_refresh = BasisRefresh(
            inner, (to_unit_float(data.x_public), data.y_public),
            modeling.per_example_loss(), config.basis_refresh_steps,
            on_refresh=model.set_basis,
            batch_size=config.physical_batch_size, seed=basis_seed,
            **plan_lib.basis_kwargs(config, plan),
            **(dict(replan_config=model.config,
                    budget_split=config.budget_split,
                    budget_quantile=config.budget_quantile)
               if config.replan_budgets else {}))

    callbacks: List[tf.keras.callbacks.Callback] = []
    if ledger is not None:
        callbacks.append(ledger)  # First, so later callbacks log epsilon.
    if basis_refresh is not None:
        callbacks.append(basis_refresh)
    if ledger is None and remaining % per_iteration:
        # A private run stops at the ledger's max_steps.
        callbacks.append(_StopAfterSteps(remaining))
    if config.tensorboard_dir:
        callbacks.append(tf.keras.callbacks.TensorBoard(
            config.tensorboard_dir, update_freq='epoch'))
    if checkpoint_path is not None:
        callbacks.append(resume.EpochCheckpoint(checkpoint_path))
    return Run(config=config, plan=plan, data=data, model=model,
               inner_model=inner, dataset=dataset, callbacks=callbacks,
               ledger=ledger, done_steps=done, remaining_steps=remaining,
               steps_per_iteration=per_iteration, epochs=epochs,
               checkpoint_path=checkpoint_path, basis_refresh=basis_refresh,
               learning_rate=learning_rate, recipe=recipe)


def evaluate(model: tf.keras.Model, data: Data, batch_size: int = 512,
             split: str = 'test') -> Tuple[float, float]:
    """(loss, accuracy) of `model` on the test (or validation) split."""
    x, y = ((data.x_test, data.y_test) if split == 'test'
            else (data.x_validation, data.y_validation))
    test = tf.data.Dataset.from_tensor_slices((x, y))
    test = test.batch(batch_size).map(preprocess)
    results = model.evaluate(test, verbose=0, return_dict=True)
    return float(results['loss']), float(results['accuracy'])


def _one_or_per_block(values):
    """The value the blocks share, else one per block (a list)."""
    return float(values[0]) if len(set(values)) == 1 else _per_block(values)


def _per_block(values):
    """One value per block as the results give it: the value itself for
    one block, a list for several (hybrid clipping)."""
    values = [None if v is None else float(v) for v in values]
    return values[0] if len(values) == 1 else values


def fit(run: Run, stop_after: Optional[int] = None) -> None:
    """Trains `run` for its remaining steps, or `stop_after` of them."""
    if run.remaining_steps <= 0:
        return
    callbacks = list(run.callbacks)
    if stop_after is not None:
        callbacks.append(_StopAfterSteps(stop_after))
    if run.ledger is not None:
        run.model.fit(run.dataset, epochs=run.epochs, callbacks=callbacks,
                      verbose=run.config.verbose)
    else:
        # The dataset shuffles itself (Keras 3 warns about its own default
        # shuffle=True for a dataset).
        run.model.fit(run.dataset, epochs=run.epochs,
                      steps_per_epoch=run.steps_per_iteration,
                      callbacks=callbacks, verbose=run.config.verbose,
                      shuffle=False)


def train(config: Any, data: Optional[Data] = None, *,
          evaluate_test: bool = True) -> Dict[str, Any]:
    """Builds and runs one training run; returns its results.

    Args:
      config: a `TrainConfig`, a mapping of its fields, or a flags-like
        object (e.g. absl's FLAGS).
      data: optional pre-loaded `Data` (for repeated runs).
      evaluate_test: False leaves the test split unread (`test_accuracy`
        and `test_loss` None): tuning looks at the validation split only.

    Returns:
      A dict with the mode, the data sizes, the mechanism (sampling rates,
      clips, noise multiplier(s), delta), `steps` run now, `total_steps`
      accounted (earlier runs included), `epsilon` (the ledger's),
      `statement_epsilon` and `statement` (from
      `compute_twice_sampling_privacy_statement` for `total_steps` steps),
      `test_accuracy`, `test_loss`, `train_seconds` and
      `final_learning_rate` (the rate a next step would use). Privacy
      fields are None in nonprivate mode.
    """
    run = build_run(config, data)
    config, plan = run.config, run.plan
    mechanism = plan.mechanism
    if config.verbose:
        _print_plan(run)
    iterations_before = int(run.model.optimizer.iterations.numpy())
    start = time.time()
    fit(run)
    seconds = time.time() - start
    steps = int(run.model.optimizer.iterations.numpy()) - iterations_before
    test_loss = test_accuracy = None
    if evaluate_test:
        test_loss, test_accuracy = evaluate(run.model, run.data)
    validation_accuracy = None
    if config.validation_examples:
        _, validation_accuracy = evaluate(run.model, run.data,
                                          split='validation')
    results: Dict[str, Any] = dict(
        mode=config.mode, dataset=config.dataset, model=config.model,
        features=config.features, recipe=run.recipe,
        learning_rate=float(config.learning_rate),
        momentum=float(config.momentum),
        num_validation_examples=int(config.validation_examples),
        validation_accuracy=validation_accuracy,
        num_examples=mechanism.num_examples,
        num_public_examples=int(len(run.data.x_public)),
        num_test_examples=int(len(run.data.x_test)),
        example_sampling_rate=mechanism.example_sampling_rate,
        expected_batch_size=mechanism.expected_batch_size,
        coordinate_sampling_rate=_one_or_per_block(
            mechanism.coordinate_sampling_rates),
        l2_norm_clip=_per_block(mechanism.l2_norm_clips),
        linf_norm_clip=_per_block(mechanism.linf_norm_clips),
        noise_multiplier=_per_block(mechanism.noise_multipliers),
        ranks=list(plan.ranks), delta=plan.delta,
        target_epsilon=plan.target_epsilon,
        planned_steps=plan.planned_steps, resumed_steps=run.done_steps,
        steps=steps, total_steps=run.done_steps + steps,
        optimizer_steps=int(run.model.optimizer.iterations.numpy()),
        final_learning_rate=modeling.current_learning_rate(
            run.learning_rate, run.model.optimizer.iterations),
        epsilon=None, statement_epsilon=None, statement=None,
        stopped_by_budget=False, test_loss=test_loss,
        test_accuracy=test_accuracy, train_seconds=seconds)
    if plan.progress is not None:
        results['plan_by_progress'] = plan.progress
    if config.replan_budgets:
        # The last re-plan's clips: the config's times the block scales.
        results['replanned_l2_norm_clip'] = [
            c * s for c, s in zip(mechanism.l2_norm_clips,
                                  run.model.aggregator.block_scales)]
    if run.ledger is not None:
        results['total_steps'] = run.ledger.steps
        results['epsilon'] = run.ledger.epsilon if run.ledger.steps else 0.0
        results['stopped_by_budget'] = run.ledger.stopped_by_budget
        if run.ledger.steps:
            text, eps = plan_lib.privacy_statement(plan, run.ledger.steps)
            results['statement'] = text
            results['statement_epsilon'] = eps
        # One: a resumed run with another mechanism is refused.
        results['ledger_segments'] = len(run.ledger.get_state()['segments'])
    return results


def _print_plan(run: Run) -> None:
    plan, config = run.plan, run.config
    mechanism = plan.mechanism
    print(run.recipe)
    features = ('' if config.features == 'none'
                else f' on {config.features} features')
    validation = (f'{config.validation_examples} validation, '
                  if config.validation_examples else '')
    print(f'{config.mode} on {config.dataset} ({config.model}{features}): '
          f'{mechanism.num_examples} private training examples, '
          f'{len(run.data.x_public)} public, {validation}'
          f'{len(run.data.x_test)} test.')
    if config.mode in PRIVATE_MODES:
        rates = list(mechanism.coordinate_sampling_rates)
        print(f'  Poisson rate q1 = {mechanism.example_sampling_rate:.6g} '
              f'(expected batch {mechanism.expected_batch_size:g}), '
              'coordinate rate q2 = '
              f'{_fmt(rates if len(set(rates)) > 1 else rates[:1])}, '
              f'l2 clip {_fmt(mechanism.l2_norm_clips)}, l-inf clip '
              f'{_fmt(mechanism.linf_norm_clips)}, noise multiplier '
              f'{_fmt(mechanism.noise_multipliers)}, delta {plan.delta:g}'
              + ('' if plan.target_epsilon is None else
                 f', target epsilon {plan.target_epsilon:g}') + '.')
    if plan.progress is not None:
        print('  Planned by public one-step progress (loss decrease x 1e3): '
              + ', '.join(f'{name} {value * 1e3:.2f}' for name, value in
                          plan.progress['decreases'].items())
              + f"; chosen: {plan.progress['chosen']}.")
    if config.lr_schedule != 'constant':
        rate = modeling.current_learning_rate(
            run.learning_rate, run.model.optimizer.iterations)
        print(f'  Learning rate {config.learning_rate:g}, '
              f'{config.lr_schedule} schedule, now {rate:.4g}.')
    print(f'  {plan.planned_steps} steps planned ({plan.steps_per_epoch} per '
          f'epoch), {run.done_steps} done before, {run.remaining_steps} to '
          'run now.')


def _fmt(values) -> str:
    """One value per block: the value itself for one block, else all of
    them in parentheses."""
    text = ['none' if v is None else f'{v:.4g}' for v in values]
    return text[0] if len(text) == 1 else '(' + ', '.join(text) + ')'


def print_results(results: Mapping[str, Any]) -> None:
    """Prints the privacy statement, both epsilons and the test accuracy."""
    if results['mode'] in PRIVATE_MODES:
        if results['statement']:
            print()
            print(results['statement'])
        print(f"Privacy ledger: epsilon = {results['epsilon']:.4f} at delta "
              f"= {results['delta']:g} after {results['total_steps']} "
              'steps.')
        if results['statement_epsilon'] is not None:
            print('Privacy statement for the same steps: epsilon = '
                  f"{results['statement_epsilon']:.4f}.")
    else:
        print('Nonprivate training: no privacy guarantee.')
    if results.get('validation_accuracy') is not None:
        print(f"Validation accuracy: {results['validation_accuracy']:.4f} "
              f"({results['num_validation_examples']} examples held out of "
              'the training split).')
    if results['test_accuracy'] is None:
        return
    print(f"Test accuracy: {results['test_accuracy']:.4f} "
          f"({results['num_test_examples']} test examples; "
          f"{results['steps']} steps in {results['train_seconds']:.1f} s).")
