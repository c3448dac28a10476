"""Checks of examples/tune.py: the grid, the budget, the store, the search.

The search's bookkeeping is checked with a stand-in for the training run;
one search trains for real (two points of two steps on digits) and must
never read the test split.
"""

import json

from absl import flags
import numpy as np
import pytest

pytest.importorskip('sklearn.datasets')

# pylint: disable=g-import-not-at-top,wrong-import-position
from examples import tune
from examples.training import data as data_lib
from examples.training import runner
from examples.training import settings
from examples.training.run_store import RunStore
from tests.examples.train_helpers import FAST
# pylint: enable=g-import-not-at-top,wrong-import-position


def test_assignments_name_a_training_flag():
    assert tune.parse_assignment('grid', 'learning_rate=8,16') == (
        'learning_rate', [8, 16])
    assert tune.parse_assignment('set', 'mode=twice') == ('mode', ['twice'])
    assert tune.parse_assignment('grid', 'linf_norm_clip=none,0.01') == (
        'linf_norm_clip', [None, 0.01])
    assert tune.parse_assignment('grid', 'replan_budgets=false,True') == (
        'replan_budgets', [False, True])
    with pytest.raises(ValueError, match='--replan_budgets must be true or '
                       "false; got 'false'"):
        settings.check_config(dict(mode='hybrid', replan_budgets='false'))
    for bad, match in (('learning_rate', 'NAME=VALUE'),
                       ('learning_rate=', 'NAME=VALUE'),
                       ('learnin_rate=1', 'learnin_rate'),
                       ('seed=1,2', "'seed'")):
        with pytest.raises(ValueError, match=match):
            tune.parse_assignment('grid', bad)


def test_a_search_may_fix_one_rank():
    # --set=ranks=16 parses as the integer 16: one principal block.
    _, (ranks,) = tune.parse_assignment('set', 'ranks=16')
    config = settings.check_config(dict(mode='hybrid', ranks=ranks))
    assert config.ranks == (16,)


def test_a_budget_below_the_grid_draws_a_fixed_subset():
    grid = {'learning_rate': [1, 2, 4], 'momentum': [0.0, 0.9]}
    every = tune.grid_points(grid, None, 0)
    assert len(every) == 6 and every[0] == {'learning_rate': 1,
                                            'momentum': 0.0}
    assert tune.grid_points(grid, 10, 0) == every
    some = tune.grid_points(grid, 3, 0)
    assert len(some) == 3 and all(p in every for p in some)
    assert tune.grid_points(grid, 3, 0) == some
    assert any(tune.grid_points(grid, 3, s) != some for s in range(1, 6))
    with pytest.raises(ValueError, match='--budget'):
        tune.grid_points(grid, 0, 0)


def _data(validation=10):
    x = np.zeros((30, 8, 8, 1), np.float32)
    y = np.zeros(30, np.int32)
    return data_lib.Data(x_train=x, y_train=y, x_public=x[:0],
                         y_public=y[:0], x_test=x, y_test=y, num_classes=10,
                         x_validation=x[:validation],
                         y_validation=y[:validation])


class _FakeTrain:
    """Stands in for runner.train: a validation accuracy per learning rate."""

    def __init__(self):
        self.calls = []

    def __call__(self, config, data, evaluate_test=True):
        assert evaluate_test is False  # Tuning never reads the test split.
        assert config['validation_examples'] == len(data.x_validation)
        self.calls.append(config)
        accuracy = {1: 0.5, 2: 0.9, 4: 0.7}[config['learning_rate']]
        return dict(validation_accuracy=accuracy + config['seed'] / 100,
                    epsilon=1.0, total_steps=3, train_seconds=0.1,
                    noise_multiplier=2.0, statement='...')


def test_the_search_scores_by_median_validation_and_resumes(tmp_path):
    path = str(tmp_path / 'tune.json')
    points = tune.grid_points({'learning_rate': [1, 2, 4]}, None, 0)
    fake = _FakeTrain()
    store = RunStore(path, {'mode': 'twice'})
    scored = tune.search(points, fixed=dict(mode='twice'), seeds=[0, 1],
                         data=_data(), store=store, train_fn=fake,
                         log=lambda *_: None)
    assert [p['learning_rate'] for p, _ in scored] == [2, 4, 1]
    assert len(fake.calls) == 6
    with open(path) as f:
        saved = json.load(f)
    assert saved['best'] == {'learning_rate': 2} and len(saved['runs']) == 6
    assert all('statement' not in run for run in saved['runs'].values())
    # A rerun skips every stored run; another search's file is refused.
    again = _FakeTrain()
    tune.search(points, fixed=dict(mode='twice'), seeds=[0, 1],
                data=_data(), store=RunStore(path, {'mode': 'twice'}),
                train_fn=again, log=lambda *_: None)
    assert not again.calls
    with pytest.raises(ValueError, match='other settings'):
        RunStore(path, {'mode': 'dpsgd'})
    assert '| 2 | 2 | 1.000 | 90.50 % | 90.00 - 91.00 % | 2 |' in (
        tune.markdown_table(scored))


def test_a_bad_point_is_refused_before_any_run():
    fake = _FakeTrain()
    points = [{'learning_rate': 1}, {'learning_rate': -1.0}]
    with pytest.raises(ValueError, match='--learning_rate'):
        tune.search(points, fixed={}, seeds=[0], data=_data(),
                    store=RunStore(None, {}), train_fn=fake)
    assert not fake.calls


def test_a_real_search_never_reads_the_test_split(monkeypatch):
    data = data_lib.load_data('digits', validation_examples=100)
    evaluate, splits = runner.evaluate, []

    def recording_evaluate(model, data, batch_size=512, split='test'):
        splits.append(split)
        return evaluate(model, data, batch_size, split)

    monkeypatch.setattr(runner, 'evaluate', recording_evaluate)
    fixed = {k: v for k, v in FAST.items() if k not in ('seed', 'verbose')}
    scored = tune.search(
        tune.grid_points({'learning_rate': [0.1, 0.5]}, None, 0),
        fixed=fixed, seeds=[0], data=data, store=RunStore(None, {}),
        log=lambda *_: None)
    assert len(scored) == 2
    for _, (run,) in scored:
        assert 0.0 <= run['validation_accuracy'] <= 1.0
        assert run['test_accuracy'] is None and run['epsilon'] > 0
    assert splits == ['validation', 'validation']


@pytest.mark.parametrize('public_examples', [0, 40])
def test_the_public_split_is_held_out_for_every_trial(
        monkeypatch, tmp_path, public_examples):
    # Hybrid clipping's trials learn their basis from it; a search without
    # one keeps the stored settings of the searches made before the flag.
    seen = []

    def fake_train(config, data, evaluate_test=True):
        seen.append((config.get('public_examples'), len(data.x_public),
                     len(data.x_validation)))
        return dict(validation_accuracy=0.5, epsilon=1.0, total_steps=1,
                    train_seconds=0.0, noise_multiplier=1.0)

    flag_values = flags.FlagValues()
    tune.define_flags(flag_values)
    path = tmp_path / 'tune.json'
    flag_values(['tune.py', '--dataset=digits', '--validation_examples=100',
                 f'--public_examples={public_examples}', '--set=mode=hybrid',
                 '--grid=learning_rate=0.1,0.2', f'--results_json={path}'])
    monkeypatch.setattr(flags, 'FLAGS', flag_values)
    monkeypatch.setattr(runner, 'train', fake_train)
    tune.main(['tune.py'])
    assert seen == [(public_examples or None, public_examples, 100)] * 2
    settings = json.loads(path.read_text())['settings']
    assert settings.get('public_examples') == (public_examples or None)
