"""Checks of examples/train.py: the modes, the flags, the console.

Every mode trains for a handful of steps on scikit-learn's digits (shipped
with scikit-learn, nothing is downloaded). Private modes must report the
ledger's epsilon and the privacy statement's epsilon for the same steps, and
they must agree. One test runs the script as a command and checks that its
console is free of TensorFlow's known start-up noise. Data:
train_data_test.py; checkpoints and resuming: train_resume_test.py.
"""

import dataclasses
import logging
import math
import os
import subprocess
import sys

from absl import flags
import pytest

pytest.importorskip('sklearn.datasets')

# pylint: disable=g-import-not-at-top,wrong-import-position
from examples import train as train_script
from examples.training import console
from examples.training import data as data_lib
from examples.training import modeling
from examples.training import runner
from examples.training import settings
from tests.examples.train_helpers import FAST
from tests.examples.train_helpers import HYBRID
from tests.examples.train_helpers import check_private
from tests.examples.train_helpers import tiny_fashion_mnist
from tests.paths import ROOT
# pylint: enable=g-import-not-at-top,wrong-import-position

_SCRIPT = (ROOT / 'examples' /
           'train.py')


@pytest.fixture(scope='module')
def digits():
    return data_lib.load_data('digits')


@pytest.mark.parametrize('mode', ['dpsgd', 'twice'])
def test_private_modes_train_and_account(digits, mode):
    results = runner.train(dict(FAST, mode=mode, target_epsilon=8.0),
                           data=digits)
    assert 0.0 <= results['test_accuracy'] <= 1.0
    check_private(results, 3)
    assert results['epsilon'] <= 8.0
    assert results['delta'] == 1e-5  # n = 1437: 1/n -> 1e-4, capped.
    assert results['expected_batch_size'] == 32
    if mode == 'dpsgd':
        assert results['coordinate_sampling_rate'] == 1.0
        assert results['linf_norm_clip'] is None
    else:
        assert results['coordinate_sampling_rate'] == 0.5
        assert results['linf_norm_clip'] == pytest.approx(0.1)


def test_planned_steps_meet_the_target_epsilon(digits):
    """The noise is calibrated for the planned steps: epsilon ~ target."""
    results = runner.train(dict(FAST, mode='twice', target_epsilon=2.0,
                                noise_multiplier=None), data=digits)
    assert 0.99 * 2.0 <= results['epsilon'] <= 2.0


def test_nonprivate_mode_makes_no_claim(digits):
    results = runner.train(dict(FAST, mode='nonprivate'), data=digits)
    assert results['steps'] == 3
    assert 0.0 <= results['test_accuracy'] <= 1.0
    assert results['epsilon'] is None and results['statement'] is None


@pytest.mark.parametrize('overrides, flag', [
    (dict(target_epsilon=2.0, noise_multiplier=1.0), '--target_epsilon'),
    (dict(target_epsilon=0.0), '--target_epsilon'),
    (dict(noise_multiplier=-1.0), '--noise_multiplier'),
    (dict(coordinate_sampling_rate=1.5), '--coordinate_sampling_rate'),
    (dict(coordinate_sampling_rate=0.0), '--coordinate_sampling_rate'),
    (dict(mode='dpsgd', coordinate_sampling_rate=0.5),
     '--coordinate_sampling_rate'),
    (dict(dataset='imagenet'), '--dataset'),
    (dict(mode='sparse'), '--mode'),
    (dict(batch_size=64, example_sampling_rate=0.1), '--batch_size'),
    (dict(example_sampling_rate=1.5), '--example_sampling_rate'),
    (dict(epochs=2, steps=5), '--epochs'),
    (dict(linf_norm_clip=0.1, d0=100), '--linf_norm_clip'),
    (dict(mode='dpsgd', d0=100), '--d0'),
    (dict(d0=0.5), '--d0'),
    (dict(delta=1.0), '--delta'),
    (dict(mode='nonprivate', target_epsilon=1.0), '--target_epsilon'),
    (dict(mode='hybrid', ranks='4,0'), '--ranks'),
    (dict(physical_batch_size=0), '--physical_batch_size'),
    (dict(dataset='npz'), '--data_path'),
    (dict(dataset='digits', data_path='data.npz'), '--data_path'),
    (dict(model='resnet50'), '--model'),
    (dict(lr_schedule='linear'), '--lr_schedule'),
    (dict(lr_schedule='step'), '--lr_decay_steps'),
    (dict(lr_schedule='step', lr_decay_steps=0), '--lr_decay_steps'),
    (dict(lr_schedule='step', lr_decay_steps=2, lr_decay_rate=1.5),
     '--lr_decay_rate'),
    (dict(lr_schedule='step', lr_decay_steps=2, lr_min_fraction=0.1),
     '--lr_min_fraction'),
    (dict(lr_schedule='cosine', lr_min_fraction=1.0), '--lr_min_fraction'),
    (dict(lr_schedule='cosine', lr_decay_rate=0.5), '--lr_decay_rate'),
    (dict(lr_decay_steps=10), '--lr_decay_steps'),
    (dict(mode='hybrid', budget_split='norms'), '--budget_split'),
    (dict(mode='twice', budget_split='quantile'), '--budget_split'),
    (dict(mode='hybrid', budget_quantile=0.5), '--budget_quantile'),
    (dict(mode='hybrid', budget_split='quantile', budget_quantile=1.5),
     '--budget_quantile'),
    (dict(mode='hybrid', budget_split='quantile', budget_quantile='half'),
     '--budget_quantile'),
    (dict(mode='twice', principal_coordinate_sampling_rate=1.0),
     '--principal_coordinate_sampling_rate'),
    (dict(mode='hybrid', principal_coordinate_sampling_rate=0.0),
     '--principal_coordinate_sampling_rate'),
    (dict(mode='twice', replan_budgets=True), '--replan_budgets'),
    (dict(mode='hybrid', replan_budgets=True, basis_refresh_steps=0),
     '--replan_budgets'),
    (dict(mode='hybrid', noise_objective='curvature'), '--noise_objective'),
    (dict(mode='twice', noise_objective='public_fisher'), '--noise_objective'),
    (dict(mode='hybrid', noise_multiplier=1.0, target_epsilon=None,
          noise_objective='public_fisher'), '--noise_objective'),
])
def test_bad_flags_are_refused_by_name(overrides, flag):
    with pytest.raises(ValueError, match=flag):
        settings.check_config(dict(FAST, **overrides))


def test_batch_larger_than_the_dataset_is_refused(digits):
    with pytest.raises(ValueError, match='--batch_size'):
        runner.build_run(dict(FAST, batch_size=5000), data=digits)


def test_command_line_flags_fill_the_config():
    flag_values = flags.FlagValues()
    train_script.define_flags(flag_values)
    flag_values(['train.py', '--mode=dpsgd', '--steps=7', '--ranks=4,8',
                 '--noise_multiplier=1.5'])
    config = settings.check_config(flag_values)
    assert config.mode == 'dpsgd' and config.steps == 7
    assert config.ranks == (4, 8) and config.noise_multiplier == 1.5
    assert config.dataset == 'digits' and config.target_epsilon is None
    names = {f.name for f in dataclasses.fields(settings.TrainConfig)}
    assert names <= set(flag_values)
    flag_values(['train.py', '--mode=hybrid', '--budget_split=quantile',
                 '--budget_quantile=0.8'])
    config = settings.check_config(flag_values)
    assert (config.budget_split, config.budget_quantile) == ('quantile', 0.8)


def test_hybrid_mode_learns_a_public_basis_and_accounts_blocks(digits):
    data = data_lib.load_data('digits', public_examples=50)
    results = runner.train(HYBRID, data=data)
    assert results['num_public_examples'] == 50
    assert results['num_examples'] == len(digits.x_train) - 50
    assert results['ranks'] == [4]
    # One principal block, then the residual: per-block clips and noise.
    assert len(results['noise_multiplier']) == 2
    clips = results['l2_norm_clip']
    assert len(clips) == 2
    assert sum(c**2 for c in clips) == pytest.approx(1.0)  # The budget.
    # Principal block: no l-infinity clip (principal_d0 = 1); residual:
    # c2 / sqrt(d0) with the default d0.
    assert results['linf_norm_clip'][0] == pytest.approx(clips[0])
    assert results['linf_norm_clip'][1] == pytest.approx(
        clips[1] / math.sqrt(settings.DEFAULT_D0))
    assert 0.0 <= results['test_accuracy'] <= 1.0
    check_private(results, 3)
    assert results['epsilon'] <= 8.0


@pytest.mark.parametrize('mode', ['dpsgd', 'twice', 'hybrid'])
def test_the_model_and_the_ledger_run_the_plans_mechanism(digits, mode):
    """One config: the model's steps and the ledger's event are the plan's
    mechanism (hybrid: one Block per basis block, dimensions included)."""
    data = (data_lib.load_data('digits', public_examples=50)
            if mode == 'hybrid' else digits)
    run = runner.build_run(HYBRID if mode == 'hybrid' else dict(
        FAST, mode=mode, target_epsilon=8.0), data=data)
    mechanism = run.plan.mechanism
    assert run.model.config == mechanism
    assert run.ledger.event == mechanism.dp_event()
    if mode == 'hybrid':
        assert mechanism.dimensions == run.model.basis.block_dimensions
    else:
        assert mechanism.num_blocks == 1


def test_nonprivate_plan_has_a_non_private_mechanism(digits):
    # Its batch size shapes the batches; nothing accounts it.
    run = runner.build_run(dict(FAST, mode='nonprivate'), data=digits)
    assert run.plan.mechanism.non_private
    assert run.plan.mechanism.expected_batch_size == 32
    assert run.ledger is None


@pytest.fixture(scope='module')
def default_hybrid_clips():
    data = data_lib.load_data('digits', public_examples=50)
    return runner.train(HYBRID, data=data)['l2_norm_clip']


@pytest.mark.parametrize('split', [
    dict(budget_split='variance_optimal'),
    dict(budget_split='quantile', budget_quantile=0.9)])
def test_hybrid_mode_with_each_budget_split(split, default_hybrid_clips):
    data = data_lib.load_data('digits', public_examples=50)
    results = runner.train(dict(HYBRID, **split), data=data)
    clips = results['l2_norm_clip']
    assert len(clips) == 2 and min(clips) > 0
    assert sum(c**2 for c in clips) == pytest.approx(1.0)  # The budget.
    assert clips != pytest.approx(default_hybrid_clips)  # The flag acts.
    check_private(results, 3)
    assert results['epsilon'] <= 8.0


def test_hybrid_mode_with_unmasked_principal_blocks():
    data = data_lib.load_data('digits', public_examples=50)
    results = runner.train(dict(HYBRID, principal_coordinate_sampling_rate=1.0,
                                coordinate_sampling_rate=0.5), data=data)
    assert results['coordinate_sampling_rate'] == [1.0, 0.5]
    check_private(results, 3)  # The statement agrees with the ledger.
    assert 'q2 = (1, 0.5)' in results['statement']


def test_hybrid_mode_planned_by_public_progress(capsys):
    data = data_lib.load_data('digits', public_examples=50)
    results = runner.train(dict(HYBRID, plan_by_progress=True, verbose=1),
                           data=data)
    assert 'Planned by public one-step progress' in capsys.readouterr().out
    progress = results['plan_by_progress']
    # Masked or unmasked principal block, each noise objective.
    assert set(progress['decreases']) == {
        f'principal rate {rate}, {objective}' for rate in ('0.5', '1')
        for objective in ('total_variance', 'public_fisher')}
    best = max(progress['decreases'], key=progress['decreases'].get)
    assert progress['chosen'] == best
    rate = 1.0 if best.startswith('principal rate 1,') else 0.5
    assert results['coordinate_sampling_rate'] == (
        0.5 if rate == 0.5 else [1.0, 0.5])
    check_private(results, 3)
    with pytest.raises(ValueError, match='--principal_coordinate_sampling'):
        runner.build_run(dict(HYBRID, plan_by_progress=True,
                              principal_coordinate_sampling_rate=1.0),
                         data=data)
    with pytest.raises(ValueError, match='--plan_by_progress'):
        runner.build_run(dict(FAST, plan_by_progress=True), data=data)
    # A fixed noise multiplier: another keep rate would be another epsilon.
    with pytest.raises(ValueError, match='--plan_by_progress.*calibrates'):
        runner.build_run(dict(HYBRID, plan_by_progress=True,
                              target_epsilon=None, noise_multiplier=1.0),
                         data=data)


def test_hybrid_mode_with_replanned_budgets():
    data = data_lib.load_data('digits', public_examples=50)
    plain = runner.train(HYBRID, data=data)  # A refresh every 2 steps.
    results = runner.train(dict(HYBRID, replan_budgets=True), data=data)
    # The same event (clips as planned, noise, epsilon); the clips the
    # mechanism ran last are re-split from the public gradients.
    for key in ('l2_norm_clip', 'noise_multiplier', 'epsilon'):
        assert results[key] == plain[key]
    clips = results['replanned_l2_norm_clip']
    assert sum(c**2 for c in clips) == pytest.approx(1.0)
    assert clips != pytest.approx(results['l2_norm_clip'])
    check_private(results, 3)


def test_data_given_must_match_the_public_split(digits):
    with pytest.raises(ValueError, match='--public_examples'):
        runner.build_run(dict(FAST, public_examples=10), data=digits)
    with pytest.raises(ValueError, match='--mode=hybrid'):
        runner.build_run(dict(HYBRID, public_examples=None), data=digits)


def test_steps_that_end_mid_epoch(digits):
    # 1437 / 200 -> 7 steps per epoch: 9 steps stop two into the second.
    results = runner.train(dict(FAST, mode='dpsgd', batch_size=200,
                                steps=9, noise_multiplier=1.0), data=digits)
    check_private(results, 9)


def test_learning_rate_schedules():
    """The rate at optimizer iterations 0, 4, 5, 10 and 20."""

    def rates(**overrides):
        config = settings.check_config(dict(FAST, learning_rate=0.8,
                                            **overrides))
        rate = modeling.learning_rate(config, planned_steps=10)
        return [float(rate(step)) if callable(rate) else rate
                for step in (0, 4, 5, 10, 20)]

    assert rates() == [0.8] * 5
    assert rates(lr_schedule='step', lr_decay_steps=5,
                 lr_decay_rate=0.5) == pytest.approx([0.8, 0.8, 0.4, 0.2,
                                                      0.05])
    assert rates(lr_schedule='step', lr_decay_steps=5) == pytest.approx(
        [0.8, 0.8, 0.08, 0.008, 0.00008])  # Default rate 0.1.
    # Cosine over the planned 10 steps, then constant at the floor.
    cosine = 0.4 * (1 + math.cos(math.pi * 0.4))
    assert rates(lr_schedule='cosine') == pytest.approx(
        [0.8, cosine, 0.4, 0.0, 0.0], abs=1e-6)
    assert rates(lr_schedule='cosine', lr_decay_steps=5,
                 lr_min_fraction=0.25) == pytest.approx(
                     [0.8, 0.2 + 0.3 * (1 + math.cos(math.pi * 0.8)), 0.2,
                      0.2, 0.2], abs=1e-6)


def test_a_private_run_follows_the_schedule(digits):
    run = runner.build_run(dict(
        FAST, mode='twice', noise_multiplier=1.0, learning_rate=0.8,
        lr_schedule='step', lr_decay_steps=2, lr_decay_rate=0.5),
        data=digits)
    run.model.fit(run.dataset, epochs=run.epochs, callbacks=run.callbacks,
                  verbose=0)
    assert int(run.model.optimizer.iterations.numpy()) == 3
    # The optimizer's own rate (Keras 2: its last step's, at iteration 2;
    # Keras 3: at iteration 3): one decay either way.
    assert float(run.model.optimizer.learning_rate) == pytest.approx(0.4)
    assert modeling.current_learning_rate(
        run.learning_rate, run.model.optimizer.iterations) == pytest.approx(
            0.4)


def _record(logger_name: str, message: str) -> logging.LogRecord:
    return logging.getLogger(logger_name).makeRecord(
        logger_name, logging.WARNING, __file__, 1, message, None, None)


def test_known_noise_is_dropped_and_other_warnings_are_kept():
    console.quiet_known_noise()
    console.quiet_known_noise()  # Idempotent: one filter.
    tf_logger = logging.getLogger('tensorflow')
    drops = [f for f in tf_logger.filters
             if type(f).__name__ == '_DropKnownNoise']
    assert len(drops) == 1
    noise = _record('tensorflow', 'Conv2DBackpropFilter uses a while_loop. '
                    'Fix that!')
    slow = _record('tensorflow', 'Callback method `on_train_batch_end` is '
                   'slow compared to the batch time (batch time: 0.01s)')
    other = _record('tensorflow', 'Gradients do not exist for variables')
    assert not tf_logger.filter(noise) and not tf_logger.filter(slow)
    assert tf_logger.filter(other)
    # tf_twice's own warnings go through other loggers: never filtered.
    ledger = logging.getLogger('tf_twice.keras.ledger')
    assert ledger.filter(_record('tf_twice.keras.ledger', 'PrivacyLedger: '
                                 'Fix that! uses a while_loop. Fix that!'))


@pytest.mark.every_stack  # The other script tests run on one stack in CI.
def test_command_line_run_on_fashion_mnist_is_quiet(tmp_path):
    """The script end to end: flags, data, training, statement; no noise."""
    data_dir = tiny_fashion_mnist(tmp_path / 'fmnist', num_train=20,
                                  num_test=4)
    # From another directory and without PYTHONPATH: the script finds the
    # `examples` package beside itself.
    env = {k: v for k, v in os.environ.items()
           if k not in ('TF_CPP_MIN_LOG_LEVEL', 'PYTHONPATH')}
    out = subprocess.run(
        [sys.executable, str(_SCRIPT), '--dataset=fashion_mnist',
         f'--data_dir={data_dir}', '--model=tanh_cnn', '--steps=2',
         '--batch_size=4', '--physical_batch_size=4',
         '--noise_multiplier=1.0', '--verbose=0', '--seed=0'],
        capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    printed = out.stdout + out.stderr
    assert out.returncode == 0, printed
    # The recipe is DP-SGD (q2 = 1, no l-infinity clip): named so.
    assert '\nDP-SGD performed over 20 examples' in printed
    assert 'Test accuracy:' in printed and 'Privacy ledger:' in printed
    for noise in ('Fix that!', 'Unable to register', 'cpu_feature_guard',
                  'TensorRT', 'SetPriority'):
        assert noise not in printed
