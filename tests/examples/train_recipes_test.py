"""Checks of the training script's recipes, features and validation split.

A dataset (and `--features`) picks the published recipe for it; every flag
overrides its part; the recipe in force is printed. The validation split is
carved from the private examples. Data: scikit-learn's digits and tiny
Fashion-MNIST-shaped files written by the tests.
"""

import json
import os

import numpy as np
import pytest

pytest.importorskip('sklearn.datasets')

# pylint: disable=g-import-not-at-top,wrong-import-position
from examples.training import data as data_lib
from examples.training import plan as plan_lib
from examples.training import recipes
from examples.training import resume
from examples.training import runner
from examples.training import settings
from tests.examples.train_helpers import FAST
from tests.examples.train_helpers import tiny_fashion_mnist
# pylint: enable=g-import-not-at-top,wrong-import-position


def test_a_dataset_alone_runs_its_published_recipe():
    end_to_end = settings.check_config(dict(dataset='fashion_mnist'))
    assert (end_to_end.mode, end_to_end.model) == ('dpsgd', 'tanh_cnn')
    assert (end_to_end.learning_rate, end_to_end.momentum,
            end_to_end.l2_norm_clip) == (4.0, 0.9, 0.1)
    scatter = settings.check_config(dict(dataset='fashion_mnist',
                                         features='scattering'))
    assert (scatter.mode, scatter.model) == ('dpsgd', 'linear')
    assert (scatter.learning_rate, scatter.physical_batch_size) == (16.0, 512)
    digits = settings.check_config({})
    assert (digits.mode, digits.model, digits.learning_rate,
            digits.momentum, digits.l2_norm_clip) == (
                'twice', 'small_cnn', 0.5, 0.0, 1.0)


@pytest.mark.parametrize('features, batch, steps', [
    ('none', 2048, 1160), ('scattering', 8192, 280)])
def test_the_published_schedule_and_budget(features, batch, steps):
    # 40 epochs of round(60,000 / batch) steps: the published step counts.
    config = settings.check_config(dict(dataset='fashion_mnist',
                                        features=features))
    plan = plan_lib.resolve_plan(config, 60000)
    assert plan.mechanism.expected_batch_size == batch
    assert plan.planned_steps == steps
    assert (plan.target_epsilon, plan.delta) == (3.0, 1e-5)
    assert plan.mechanism.epsilon(steps, 1e-5) == pytest.approx(3.0, rel=0.01)
    assert plan.mechanism.coordinate_sampling_rate == 1.0


def test_every_part_of_a_recipe_is_overridden_by_its_flag():
    config = settings.check_config(dict(
        dataset='fashion_mnist', features='scattering', mode='twice',
        model='feature_cnn', learning_rate=2.0, momentum=0.5,
        l2_norm_clip=1.0, physical_batch_size=64))
    assert (config.mode, config.model, config.learning_rate, config.momentum,
            config.l2_norm_clip, config.physical_batch_size) == (
                'twice', 'feature_cnn', 2.0, 0.5, 1.0, 64)
    plan = plan_lib.resolve_plan(settings.check_config(dict(
        dataset='fashion_mnist', features='scattering', batch_size=1000,
        steps=10, noise_multiplier=2.0)), 60000)
    assert plan.mechanism.expected_batch_size == 1000
    assert plan.planned_steps == 10 and plan.target_epsilon is None
    assert plan.mechanism.noise_multipliers == (2.0,)


def test_the_recipe_in_force_is_described_with_its_overrides():
    text = recipes.describe(recipes.FASHION_MNIST_SCATTERNET,
                            ['learning_rate', 'steps'])
    assert text.startswith('Recipe: Tramer & Boneh')
    assert '--batch_size=8192' in text and '--learning_rate=16' in text
    assert text.endswith('Overridden: --learning_rate, --steps.')
    assert 'Overridden' not in recipes.describe(recipes.DIGITS, [])
    assert '--target_epsilon' not in recipes.describe(
        recipes.DIGITS, ['mode'], mode='nonprivate')


def test_a_run_prints_its_recipe(capsys):
    digits = data_lib.load_data('digits')
    results = runner.train(dict(FAST, verbose=1, learning_rate=0.4),
                           data=digits)
    printed = capsys.readouterr().out
    assert printed.startswith('Recipe: twice sampling on digits')
    assert results['recipe'] in printed
    assert ('Overridden: --batch_size, --learning_rate, --model, '
            '--physical_batch_size, --steps.') in results['recipe']
    assert results['learning_rate'] == 0.4 and results['momentum'] == 0.0


def test_the_validation_split_comes_from_the_private_examples():
    plain = data_lib.load_data('digits', public_examples=50)
    split = data_lib.load_data('digits', public_examples=50,
                               validation_examples=100)
    assert len(split.x_validation) == 100
    assert len(split.x_train) == len(plain.x_train) - 100
    # The public split is the same with or without a validation split.
    np.testing.assert_array_equal(split.x_public, plain.x_public)
    rows = lambda x: {r.tobytes() for r in x.reshape(len(x), -1)}
    assert rows(split.x_validation) | rows(split.x_train) == rows(
        plain.x_train)
    assert not rows(split.x_validation) & rows(split.x_train)
    again = data_lib.load_data('digits', public_examples=50,
                               validation_examples=100)
    np.testing.assert_array_equal(again.x_validation, split.x_validation)
    with pytest.raises(ValueError, match='--public_examples'):
        data_lib.load_data('digits', public_examples=1000,
                           validation_examples=800)


def test_a_run_reports_its_validation_accuracy(capsys):
    data = data_lib.load_data('digits', validation_examples=100)
    results = runner.train(dict(FAST, validation_examples=100), data=data)
    assert 0.0 <= results['validation_accuracy'] <= 1.0
    assert results['num_validation_examples'] == 100
    assert results['num_examples'] == len(data.x_train)
    runner.print_results(results)
    assert 'Validation accuracy:' in capsys.readouterr().out
    with pytest.raises(ValueError, match='--validation_examples'):
        runner.build_run(dict(FAST), data=data)


def test_a_checkpoint_of_other_features_is_not_resumed(tmp_path):
    digits = data_lib.load_data('digits')
    directory = str(tmp_path / 'run')
    runner.build_run(dict(FAST, checkpoint_dir=directory), data=digits)
    with open(os.path.join(directory, resume.RUN_FILENAME)) as f:
        record = json.load(f)
    assert record['features'] == 'none'
    # A run.json written before --features existed means 'none'.
    del record['features'], record['validation_examples']
    with open(os.path.join(directory, resume.RUN_FILENAME), 'w') as f:
        json.dump(record, f)
    runner.build_run(dict(FAST, checkpoint_dir=directory), data=digits)
    with pytest.raises(ValueError, match='--features'):
        resume.check_resume(
            settings.check_config(dict(FAST, features='scattering')),
            directory, has_checkpoint=False, has_ledger=False)


def test_scattering_features_train_a_linear_model(tmp_path, monkeypatch):
    pytest.importorskip('kymatio')
    monkeypatch.setenv('TF_TWICE_CACHE_DIR', str(tmp_path / 'cache'))
    data_dir = tiny_fashion_mnist(tmp_path / 'fmnist', num_train=24,
                                  num_test=6)
    data = data_lib.load_data('fashion_mnist', data_dir=data_dir,
                              features='scattering', validation_examples=4)
    assert data.x_train.shape == (20, 7, 7, 81)
    assert data.x_test.shape == (6, 7, 7, 81)
    assert data.x_train.dtype == np.float32
    assert len(os.listdir(tmp_path / 'cache')) == 2  # Train and test.
    results = runner.train(dict(
        dataset='fashion_mnist', features='scattering', data_dir=data_dir,
        validation_examples=4, steps=2, batch_size=8, physical_batch_size=8,
        seed=0, verbose=0), data=data)
    assert (results['model'], results['mode']) == ('linear', 'dpsgd')
    assert results['total_steps'] == 2 and results['epsilon'] > 0
    assert results['recipe'].startswith(
        'Recipe: Tramer & Boneh (ICLR 2021), ScatterNet + linear')


def _weights(model):
    return np.concatenate([w.numpy().ravel()
                           for w in model.trainable_weights])


def _fit(config, data):
    run = runner.build_run(config, data=data)
    initial = _weights(run.inner_model)
    run.model.fit(run.dataset, epochs=1, callbacks=run.callbacks, verbose=0)
    return initial, _weights(run.inner_model)


def test_the_weights_end_as_their_moving_average():
    # With ema_momentum 0.999, three steps move the average by about 0.3 %
    # of the iterates' path from where Keras starts it (the initial weights,
    # or the first step's on some versions): the run must end there, not
    # at its last iterate.
    digits = data_lib.load_data('digits')
    initial, first = _fit(dict(FAST, steps=1), digits)
    _, last = _fit(dict(FAST, steps=3), digits)
    _, averaged = _fit(dict(FAST, steps=3, ema_momentum=0.999), digits)
    path = np.abs(last - initial).max()
    assert min(np.abs(averaged - initial).max(),
               np.abs(averaged - first).max()) < 0.1 * path
    with pytest.raises(ValueError, match='--ema_momentum'):
        settings.check_config(dict(FAST, ema_momentum=1.0))
