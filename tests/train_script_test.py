"""Checks of examples/train.py through its importable functions.

Every mode trains for a handful of steps on scikit-learn's digits (shipped
with scikit-learn, nothing is downloaded); the tensorflow-datasets path runs
on `tfds.testing.mock_data`. Private modes must report the ledger's epsilon
and the privacy statement's epsilon for the same steps, and they must agree.
"""

import importlib.util
import json
import math
import os
import pathlib
import sys

from absl import flags
import numpy as np
import pytest

from tf_twice.accounting import TwiceSamplingRdpAccountant

pytest.importorskip('sklearn.datasets')

_SCRIPT = (pathlib.Path(__file__).resolve().parents[1] / 'examples' /
           'train.py')
_MODULE = 'tf_twice_examples_train'


def _load():
    """Imports examples/train.py (a script, not a package) as a module."""
    if _MODULE in sys.modules:
        return sys.modules[_MODULE]
    spec = importlib.util.spec_from_file_location(_MODULE, _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[_MODULE] = module
    spec.loader.exec_module(module)
    return module


train_lib = _load()

# Small and fast: a few steps of expected batch 32 in chunks of 32.
FAST = dict(steps=3, batch_size=32, physical_batch_size=32, seed=0,
            verbose=0)


@pytest.fixture(scope='module')
def digits():
    return train_lib.load_data('digits')


def _check_private(results, steps):
    assert results['steps'] == steps
    assert results['total_steps'] == steps
    assert results['optimizer_steps'] == steps
    assert math.isfinite(results['epsilon']) and results['epsilon'] > 0
    # The ledger (steps that ran) and the statement (the setting) agree.
    assert results['statement_epsilon'] == pytest.approx(
        results['epsilon'], rel=1e-9)
    assert 'Epsilon with twice sampling' in results['statement']


def test_digits_split_is_fixed_and_scaled(digits):
    again = train_lib.load_data('digits', public_examples=100)
    assert digits.x_train.shape[1:] == (8, 8, 1)
    assert len(digits.x_test) == train_lib.DIGITS_TEST_EXAMPLES
    assert len(digits.x_train) + len(digits.x_test) == 1797
    assert 0.0 <= digits.x_train.min() and digits.x_train.max() <= 1.0
    np.testing.assert_array_equal(digits.x_test, again.x_test)
    # The public split comes out of the training data, disjoint from it.
    assert len(again.x_public) == 100
    assert len(again.x_train) == len(digits.x_train) - 100
    train_rows = {row.tobytes() for row in again.x_train}
    assert sum(row.tobytes() in train_rows for row in again.x_public) <= 5


@pytest.mark.parametrize('mode', ['dpsgd', 'twice'])
def test_private_modes_train_and_account(digits, mode):
    results = train_lib.train(dict(FAST, mode=mode, target_epsilon=8.0),
                              data=digits)
    assert 0.0 <= results['test_accuracy'] <= 1.0
    _check_private(results, 3)
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
    results = train_lib.train(dict(FAST, mode='twice', target_epsilon=2.0,
                                   noise_multiplier=None), data=digits)
    assert 0.99 * 2.0 <= results['epsilon'] <= 2.0


def test_nonprivate_mode_makes_no_claim(digits):
    results = train_lib.train(dict(FAST, mode='nonprivate'), data=digits)
    assert results['steps'] == 3
    assert 0.0 <= results['test_accuracy'] <= 1.0
    assert results['epsilon'] is None and results['statement'] is None


def test_tfds_dataset_with_mock_data():
    tfds = pytest.importorskip('tensorflow_datasets')
    with tfds.testing.mock_data(num_examples=48):
        data = train_lib.load_data('mnist', public_examples=8)
        results = train_lib.train(
            dict(FAST, mode='twice', dataset='mnist', steps=2, batch_size=8,
                 physical_batch_size=8, noise_multiplier=1.0),
            data=data)
    assert data.x_train.shape == (40, 28, 28, 1)
    assert data.x_train.dtype == np.uint8  # Scaled to [0, 1] when used.
    assert data.num_classes == 10
    assert len(data.x_public) == 8
    assert results['num_examples'] == 40
    assert 0.0 <= results['test_accuracy'] <= 1.0
    _check_private(results, 2)


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
])
def test_bad_flags_are_refused_by_name(overrides, flag):
    with pytest.raises(ValueError, match=flag):
        train_lib.check_config(dict(FAST, **overrides))


def test_batch_larger_than_the_dataset_is_refused(digits):
    with pytest.raises(ValueError, match='--batch_size'):
        train_lib.build_run(dict(FAST, batch_size=5000), data=digits)


def test_unknown_dataset_is_refused_by_load_data():
    with pytest.raises(ValueError, match='--dataset'):
        train_lib.load_data('imagenet')


def test_command_line_flags_fill_the_config():
    flag_values = flags.FlagValues()
    train_lib.define_flags(flag_values)
    flag_values(['train.py', '--mode=dpsgd', '--steps=7', '--ranks=4,8',
                 '--noise_multiplier=1.5'])
    config = train_lib.check_config(flag_values)
    assert config.mode == 'dpsgd' and config.steps == 7
    assert config.ranks == (4, 8) and config.noise_multiplier == 1.5
    assert config.dataset == 'digits' and config.target_epsilon is None
    names = {f.name for f in
             train_lib.dataclasses.fields(train_lib.TrainConfig)}
    assert names <= set(flag_values)


def test_resuming_continues_the_ledger(digits, tmp_path):
    checkpoint_dir = str(tmp_path / 'run')
    config = dict(FAST, mode='twice', noise_multiplier=1.0,
                  checkpoint_dir=checkpoint_dir)
    first = train_lib.train(dict(config, steps=2), data=digits)
    assert first['total_steps'] == 2
    ledger_file = os.path.join(checkpoint_dir, train_lib.LEDGER_FILENAME)
    with open(ledger_file) as f:
        assert json.load(f)['steps'] == 2

    # Same run, longer plan: restores the checkpoint and runs the rest.
    second = train_lib.train(dict(config, steps=5), data=digits)
    assert second['resumed_steps'] == 2
    assert second['steps'] == 3
    assert second['total_steps'] == 5
    assert second['optimizer_steps'] == 5  # Optimizer state restored.
    with open(ledger_file) as f:
        assert json.load(f)['steps'] == 5
    event = train_lib.build_run(dict(config, steps=5),
                                data=digits).model.dp_event()
    expected = TwiceSamplingRdpAccountant().compose(event, 5).get_epsilon(
        second['delta'])
    assert second['epsilon'] == pytest.approx(expected, rel=1e-9)
    assert second['statement_epsilon'] == pytest.approx(expected, rel=1e-9)

    # Nothing left of the plan: no step runs, nothing is reset.
    third = train_lib.train(dict(config, steps=5), data=digits)
    assert third['steps'] == 0 and third['total_steps'] == 5
    assert third['epsilon'] == pytest.approx(expected, rel=1e-9)


def test_resume_refuses_another_mode(digits, tmp_path):
    checkpoint_dir = str(tmp_path / 'run')
    train_lib.train(dict(FAST, mode='nonprivate', steps=1,
                         checkpoint_dir=checkpoint_dir), data=digits)
    with pytest.raises(ValueError, match='--mode'):
        train_lib.build_run(dict(FAST, mode='dpsgd', noise_multiplier=1.0,
                                 checkpoint_dir=checkpoint_dir), data=digits)


HYBRID = dict(FAST, mode='hybrid', public_examples=50, ranks='4',
              basis_refresh_steps=2, target_epsilon=8.0)


def test_hybrid_mode_learns_a_public_basis_and_accounts_blocks(digits):
    data = train_lib.load_data('digits', public_examples=50)
    results = train_lib.train(HYBRID, data=data)
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
        clips[1] / math.sqrt(train_lib.DEFAULT_D0))
    assert 0.0 <= results['test_accuracy'] <= 1.0
    _check_private(results, 3)
    assert results['epsilon'] <= 8.0


def test_hybrid_resume_keeps_the_blocks(tmp_path):
    data = train_lib.load_data('digits', public_examples=50)
    config = dict(HYBRID, target_epsilon=None, noise_multiplier=1.0,
                  checkpoint_dir=str(tmp_path / 'run'))
    first = train_lib.train(dict(config, steps=2), data=data)
    second = train_lib.train(dict(config, steps=4), data=data)
    assert second['resumed_steps'] == 2 and second['total_steps'] == 4
    assert second['optimizer_steps'] == 4
    assert second['l2_norm_clip'] == first['l2_norm_clip']
    assert second['statement_epsilon'] == pytest.approx(
        second['epsilon'], rel=1e-9)


def test_data_given_must_match_the_public_split(digits):
    with pytest.raises(ValueError, match='--public_examples'):
        train_lib.build_run(dict(FAST, public_examples=10), data=digits)
    with pytest.raises(ValueError, match='--mode=hybrid'):
        train_lib.build_run(dict(HYBRID, public_examples=None), data=digits)


def test_accuracy_study_table():
    path = _SCRIPT.parent / 'accuracy_study.py'
    spec = importlib.util.spec_from_file_location('tf_twice_study', path)
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    configs = study.row_configs(batch_size=128, coordinate_sampling_rate=0.5,
                                d0=100, ranks=[16], basis_refresh_steps=20)
    assert configs['dpsgd q=q1*q2']['batch_size'] == 64
    assert configs['twice']['coordinate_sampling_rate'] == 0.5
    with pytest.raises(ValueError, match='--rows'):
        study.row_configs(batch_size=128, coordinate_sampling_rate=0.5,
                          d0=100, ranks=[16], basis_refresh_steps=20,
                          rows=['sparse'])
    run = dict(expected_batch_size=128.0, coordinate_sampling_rate=0.5,
               noise_multiplier=[4.0, 1.5], epsilon=3.99, total_steps=400)
    table = study.markdown_table({'hybrid': [
        dict(run, test_accuracy=a) for a in (0.8, 0.9, 0.85)]})
    assert '| hybrid | 128 | 0.5 | 4, 1.5 | 3.990 | 400 | 85.0 % ' \
        '| 80.0 - 90.0 % | 3 |' in table


def test_steps_that_end_mid_epoch(digits):
    # 1437 / 200 -> 7 steps per epoch: 9 steps stop two into the second.
    results = train_lib.train(dict(FAST, mode='dpsgd', batch_size=200,
                                   steps=9, noise_multiplier=1.0),
                              data=digits)
    _check_private(results, 9)
