"""Checks of the training script's checkpoint directory and resuming.

A run with --checkpoint_dir is resumed by running it again: the ledger goes
on (privacy spent is never reset), the optimizer state and its iteration
count (which positions a learning-rate schedule) are restored, and flags that
would change the mechanism of the steps already charged are refused by name
(examples/training/resume.py).
"""

import json
import os

import pytest

pytest.importorskip('sklearn.datasets')

# pylint: disable=g-import-not-at-top,wrong-import-position
from examples.training import data as data_lib
from examples.training import modeling
from examples.training import resume
from examples.training import runner
from tests.examples.train_helpers import FAST
from tests.examples.train_helpers import HYBRID
from tf_twice.accounting import TwiceSamplingRdpAccountant
# pylint: enable=g-import-not-at-top,wrong-import-position


@pytest.fixture(scope='module')
def digits():
    return data_lib.load_data('digits')


def test_resuming_continues_the_ledger_of_its_recorded_mechanism(digits,
                                                                 tmp_path):
    checkpoint_dir = tmp_path / 'run'
    config = dict(FAST, mode='twice', noise_multiplier=1.0,
                  checkpoint_dir=str(checkpoint_dir))
    first = runner.train(dict(config, steps=2), data=digits)
    assert first['total_steps'] == 2
    ledger_file = os.path.join(checkpoint_dir, resume.LEDGER_FILENAME)
    with open(ledger_file) as f:
        assert json.load(f)['steps'] == 2
    # Keras weights, the ledger and the run file, each written through a
    # temporary file in the directory and then replaced: none is left.
    assert sorted(p.name for p in checkpoint_dir.iterdir()) == sorted([
        resume.CHECKPOINT_NAME, resume.LEDGER_FILENAME, resume.RUN_FILENAME])
    assert resume.CHECKPOINT_NAME.endswith('.weights.h5')
    record = json.loads((checkpoint_dir / resume.RUN_FILENAME).read_text())
    assert record['mode'] == 'twice' and record['planned_steps'] == 2
    assert record['mechanism_settings']['noise_multiplier'] == 1.0
    assert record['mechanism_settings']['coordinate_sampling_rate'] == 0.5

    # Another mechanism is refused by its flag, before anything is written.
    with pytest.raises(ValueError, match=r'--noise_multiplier=1\.0 '
                       r'\(now 1\.5\)') as raised:
        runner.build_run(dict(config, noise_multiplier=1.5, steps=4),
                         data=digits)
    assert 'noise_multiplier 1.0 (charged) != 1.5 (now)' in str(raised.value)
    with pytest.raises(ValueError, match='--coordinate_sampling_rate'):
        runner.build_run(dict(config, coordinate_sampling_rate=0.25),
                         data=digits)
    with pytest.raises(ValueError, match='--l2_norm_clip'):
        runner.build_run(dict(config, l2_norm_clip=2.0), data=digits)
    with open(ledger_file) as f:
        assert json.load(f)['steps'] == 2

    # Same run, longer plan: restores the checkpoint and runs the rest.
    second = runner.train(dict(config, steps=5), data=digits)
    assert second['resumed_steps'] == 2
    assert second['steps'] == 3
    assert second['total_steps'] == 5
    assert second['optimizer_steps'] == 5  # Optimizer state restored.
    with open(ledger_file) as f:
        assert json.load(f)['steps'] == 5
    event = runner.build_run(dict(config, steps=5),
                             data=digits).model.dp_event()
    expected = TwiceSamplingRdpAccountant().compose(event, 5).get_epsilon(
        second['delta'])
    assert second['epsilon'] == pytest.approx(expected, rel=1e-9)
    assert second['statement_epsilon'] == pytest.approx(expected, rel=1e-9)

    # Nothing left of the plan: no step runs, nothing is reset.
    third = runner.train(dict(config, steps=5), data=digits)
    assert third['steps'] == 0 and third['total_steps'] == 5
    assert third['epsilon'] == pytest.approx(expected, rel=1e-9)


def test_a_crash_mid_save_keeps_the_last_checkpoint(tmp_path):
    path = str(tmp_path / resume.CHECKPOINT_NAME)
    with open(path, 'wb') as f:
        f.write(b'the last checkpoint')
    checkpoint = resume.EpochCheckpoint(path)
    checkpoint.set_model(_CrashingSave())
    with pytest.raises(OSError, match='killed mid-save'):
        checkpoint.on_epoch_end(0)
    with open(path, 'rb') as f:
        assert f.read() == b'the last checkpoint'


class _CrashingSave:
    """A model whose save_weights writes part of the file, then dies."""

    def save_weights(self, path):
        with open(path, 'wb') as f:
            f.write(b'half a checkpoint')
        raise OSError('killed mid-save')


def test_a_tensorflow_format_checkpoint_is_refused_not_ignored(digits,
                                                               tmp_path):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    checkpoint_dir = tmp_path / 'run'
    tf.train.Checkpoint(v=tf.Variable(1.0)).save(str(checkpoint_dir / 'ckpt'))
    with pytest.raises(ValueError, match='TensorFlow-format checkpoint'):
        runner.build_run(dict(FAST, mode='dpsgd', noise_multiplier=1.0,
                              checkpoint_dir=str(checkpoint_dir)),
                         data=digits)


def test_nonprivate_resume_restores_the_optimizer(digits, tmp_path):
    config = dict(FAST, mode='nonprivate',
                  checkpoint_dir=str(tmp_path / 'run'))
    runner.train(dict(config, steps=2, optimizer='adam'), data=digits)
    second = runner.train(dict(config, steps=3, optimizer='adam'),
                          data=digits)
    assert second['resumed_steps'] == 2 and second['steps'] == 1
    assert second['optimizer_steps'] == 3


def test_resume_refuses_another_mode(digits, tmp_path):
    checkpoint_dir = str(tmp_path / 'run')
    runner.train(dict(FAST, mode='nonprivate', steps=1,
                      checkpoint_dir=checkpoint_dir), data=digits)
    with pytest.raises(ValueError, match='--mode'):
        runner.build_run(dict(FAST, mode='dpsgd', noise_multiplier=1.0,
                              checkpoint_dir=checkpoint_dir), data=digits)


def test_hybrid_resume_keeps_the_blocks(tmp_path):
    data = data_lib.load_data('digits', public_examples=50)
    # Unmasked principal blocks: their rate is part of the blocks too.
    config = dict(HYBRID, target_epsilon=None, noise_multiplier=1.0,
                  principal_coordinate_sampling_rate=1.0,
                  checkpoint_dir=str(tmp_path / 'run'))
    first = runner.train(dict(config, steps=2), data=data)
    second = runner.train(dict(config, steps=4), data=data)
    assert second['resumed_steps'] == 2 and second['total_steps'] == 4
    assert second['optimizer_steps'] == 4
    assert second['l2_norm_clip'] == first['l2_norm_clip']
    assert second['coordinate_sampling_rate'] == [1.0, 0.5]
    # Blocks chosen by public progress (noise calibrated: the same plan)
    # resume with their choice.
    chosen = dict(HYBRID, plan_by_progress=True, steps=2,
                  checkpoint_dir=str(tmp_path / 'chosen'))
    first = runner.train(chosen, data=data)
    second = runner.train(chosen, data=data)
    assert (second['resumed_steps'], second['steps']) == (2, 0)
    assert second['plan_by_progress'] == first['plan_by_progress']
    assert second['coordinate_sampling_rate'] == (
        first['coordinate_sampling_rate'])
    assert second['statement_epsilon'] == pytest.approx(
        second['epsilon'], rel=1e-9)
    # Other blocks (here: l-infinity clips of the principal block) are
    # another mechanism.
    with pytest.raises(ValueError,
                       match=r'--principal_d0=1\.0 \(now 2\.0\)'):
        runner.build_run(dict(config, steps=4, principal_d0=2.0), data=data)


def test_budget_split_is_recorded_only_when_not_the_default(tmp_path):
    """run.json files written before --budget_split existed hold no such
    key: a default run must record none, so that they still resume."""
    data = data_lib.load_data('digits', public_examples=50)
    config = dict(HYBRID, target_epsilon=None, noise_multiplier=1.0,
                  checkpoint_dir=str(tmp_path / 'run'))
    runner.train(dict(config, steps=2), data=data)
    record = resume.read_run_file(config['checkpoint_dir'])
    for written in (record['mechanism_settings'],
                    record['hybrid']['settings']):
        assert 'principal_d0' in written
        assert not {'budget_split', 'budget_quantile'} & set(written)
    # Another split is another mechanism, refused by name.
    with pytest.raises(ValueError, match=r"--budget_split=None \(now "
                       r"'quantile'\)"):
        runner.build_run(dict(config, steps=4, budget_split='quantile'),
                         data=data)
    quantile = dict(config, budget_split='quantile', budget_quantile=0.9,
                    checkpoint_dir=str(tmp_path / 'quantile'))
    runner.train(dict(quantile, steps=2), data=data)
    record = resume.read_run_file(quantile['checkpoint_dir'])
    for written in (record['mechanism_settings'],
                    record['hybrid']['settings']):
        assert (written['budget_split'], written['budget_quantile']) == (
            'quantile', 0.9)
    # Recorded on one side only: still named.
    with pytest.raises(ValueError, match=r"--budget_split='quantile' \(now "
                       r"None\)"):
        runner.build_run(dict(quantile, steps=4, budget_split=
                              'projection_norms', budget_quantile=None),
                         data=data)
    second = runner.train(dict(quantile, steps=4), data=data)
    assert second['resumed_steps'] == 2


def test_calibrated_noise_resumes_only_for_its_plan(digits, tmp_path):
    """--target_epsilon calibrates the noise for --steps: more steps would
    change it, so they are refused; the recorded noise goes on."""
    checkpoint_dir = str(tmp_path / 'run')
    config = dict(FAST, mode='twice', target_epsilon=8.0,
                  checkpoint_dir=checkpoint_dir)
    first = runner.train(dict(config, steps=2), data=digits)
    z = first['noise_multiplier']
    with pytest.raises(ValueError, match=r'--steps=2 \(now 4\)') as raised:
        runner.build_run(dict(config, steps=4), data=digits)
    assert f'--noise_multiplier={z!r} instead of --target_epsilon' in str(
        raised.value)
    second = runner.train(dict(config, steps=4, target_epsilon=None,
                               noise_multiplier=z), data=digits)
    assert second['resumed_steps'] == 2 and second['total_steps'] == 4
    assert second['ledger_segments'] == 1
    # One mechanism throughout: the statement covers every step.
    assert second['statement_epsilon'] == pytest.approx(second['epsilon'],
                                                        rel=1e-9)


def test_a_resumed_run_continues_the_learning_rate_schedule(digits,
                                                             tmp_path):
    config = dict(FAST, mode='twice', noise_multiplier=1.0,
                  learning_rate=0.8, lr_schedule='step', lr_decay_steps=2,
                  lr_decay_rate=0.5, checkpoint_dir=str(tmp_path / 'run'))
    first = runner.train(dict(config, steps=2), data=digits)
    assert first['final_learning_rate'] == pytest.approx(0.4)
    # The restored iteration count positions the schedule: step 2's rate.
    run = runner.build_run(dict(config, steps=5), data=digits)
    assert int(run.model.optimizer.iterations.numpy()) == 2
    assert modeling.current_learning_rate(
        run.learning_rate, run.model.optimizer.iterations) == pytest.approx(
            0.4)
    second = runner.train(dict(config, steps=5), data=digits)
    assert second['optimizer_steps'] == 5
    assert second['final_learning_rate'] == pytest.approx(0.2)
