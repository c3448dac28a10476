"""Checks of examples/accuracy_study.py: its rows, tables, store and plot.

The study's training runs are replaced by a fake that encodes each run in
its accuracy, so the tables can be checked without training.
"""

import json

import pytest

from examples import accuracy_study as study


def test_accuracy_study_table():
    configs = study.row_configs(batch_size=128, coordinate_sampling_rate=0.5,
                                d0=100, ranks=[16], basis_refresh_steps=20)
    assert configs['dpsgd q=q1*q2']['batch_size'] == 64
    assert configs['twice']['coordinate_sampling_rate'] == 0.5
    assert list(configs) == list(study.ROWS)  # Variants run when named.
    variants = study.row_configs(
        batch_size=128, coordinate_sampling_rate=0.5, d0=100, ranks=[16],
        basis_refresh_steps=20, rows=list(study.HYBRID_ROWS))
    # 'hybrid' is the paper's (every block masked at q2); the variants
    # change one thing each.
    assert configs['hybrid']['principal_coordinate_sampling_rate'] == 0.5
    both = variants['hybrid unmasked replanned']
    assert both == dict(configs['hybrid'], replan_budgets=True,
                        principal_coordinate_sampling_rate=1.0)
    assert variants['hybrid replanned'] == dict(configs['hybrid'],
                                                replan_budgets=True)
    assert 'replan_budgets' not in variants['hybrid unmasked']
    # --plan_by_progress chooses the keep rate: the row sets none.
    assert 'principal_coordinate_sampling_rate' not in variants[
        'hybrid by progress']
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


def test_accuracy_study_keeps_runs_and_plots(tmp_path):
    configs = study.row_configs(batch_size=64, coordinate_sampling_rate=0.5,
                                d0=100, ranks=[4], basis_refresh_steps=5,
                                rows=['dpsgd q=q1', 'twice'])
    calls = []

    def fake_train(config, data):
        # Accuracy encodes the run, so that the tables can be checked.
        calls.append(config)
        accuracy = 0.5 + 0.1 * config['target_epsilon'] / 8 + (
            0.01 * config['seed'])
        return dict(test_accuracy=accuracy, epsilon=config['target_epsilon'],
                    train_seconds=1.0, delta=1e-5, statement='not kept',
                    expected_batch_size=config['batch_size'],
                    coordinate_sampling_rate=config.get(
                        'coordinate_sampling_rate', 1.0),
                    noise_multiplier=[1.0], total_steps=config['steps'])

    settings = dict(steps=7, rows=configs)
    path = str(tmp_path / 'runs.json')
    kwargs = dict(seeds=[0, 1], common=dict(steps=7), public_examples=0,
                  data=object(), train_fn=fake_train, log=lambda _: None)
    first = study.run_study(configs, target_epsilons=[1.0],
                            store=study.RunStore(path, settings), **kwargs)
    assert len(calls) == 4
    assert {c['target_epsilon'] for c in calls} == {1.0}
    # A second part of the study reruns nothing it already has.
    both = study.run_study(configs, target_epsilons=[1.0, 8.0],
                           store=study.RunStore(path, settings), **kwargs)
    assert len(calls) == 8
    assert {c['target_epsilon'] for c in calls[4:]} == {8.0}
    assert both[1.0] == first[1.0]
    assert [r['test_accuracy'] for r in both[8.0]['twice']] == [0.6, 0.61]
    assert 'statement' not in both[8.0]['twice'][0]
    table = study.markdown_table(both[8.0])
    assert '| twice | 64 | 0.5 | 1 | 8.000 | 7 | 60.5 % | 60.0 - 61.0 % ' \
        '| 2 |' in table
    with pytest.raises(ValueError, match='--results_json'):
        study.RunStore(path, dict(settings, steps=8))
    png = tmp_path / 'plot' / 'accuracy.png'
    study.plot_accuracy(both, str(png),
                        published=study.PUBLISHED['fashion_mnist'])
    assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_budget_split_flags_reach_only_the_hybrid_row(tmp_path):
    kwargs = dict(batch_size=128, coordinate_sampling_rate=0.5, d0=100,
                  ranks=[16], basis_refresh_steps=20)
    default = study.row_configs(**kwargs)
    # Defaults add nothing: a --results_json written before these flags
    # existed keeps this study's settings.
    assert not {'budget_split', 'budget_quantile', 'noise_objective'} & set(
        default['hybrid'])
    path = str(tmp_path / 'runs.json')
    earlier = dict(steps=7, rows=default)
    study.RunStore(path, earlier).put('a run', dict(test_accuracy=0.5))
    assert study.RunStore(path, dict(steps=7, rows=study.row_configs(
        **kwargs))).get('a run') == dict(test_accuracy=0.5)
    quantile = study.row_configs(budget_split='quantile', budget_quantile=0.7,
                                 **kwargs)
    assert quantile['hybrid'] == dict(default['hybrid'],
                                      budget_split='quantile',
                                      budget_quantile=0.7)
    assert {row: c for row, c in quantile.items() if row != 'hybrid'} == {
        row: c for row, c in default.items() if row != 'hybrid'}
    # Another split is another study.
    with pytest.raises(ValueError, match='--results_json'):
        study.RunStore(path, dict(steps=7, rows=quantile))
    fisher = study.row_configs(noise_objective='public_fisher', **kwargs)
    assert fisher['hybrid'] == dict(default['hybrid'],
                                    noise_objective='public_fisher')
    assert fisher['twice'] == default['twice']
    for bad, flag in ((dict(budget_split='norms'), '--budget_split'),
                      (dict(noise_objective='curvature'),
                       '--noise_objective'),
                      (dict(budget_quantile=0.5), '--budget_quantile'),
                      (dict(budget_split='quantile', budget_quantile=0.0),
                       '--budget_quantile')):
        with pytest.raises(ValueError, match=flag):
            study.row_configs(**bad, **kwargs)


def test_principal_d0_and_parameter_groups_reach_only_the_hybrid_row(
        tmp_path):
    kwargs = dict(batch_size=128, coordinate_sampling_rate=0.5, d0=100,
                  ranks=[16], basis_refresh_steps=20)
    default = study.row_configs(**kwargs)
    # The defaults, given explicitly, leave every row as it was: a
    # --results_json written before these flags existed is still reused.
    explicit = study.row_configs(
        principal_d0=study.settings_lib.TrainConfig.principal_d0,
        parameter_groups=study.settings_lib.TrainConfig.parameter_groups,
        **kwargs)
    assert explicit == default
    assert default['hybrid'] == dict(
        mode='hybrid', batch_size=128, coordinate_sampling_rate=0.5, d0=100,
        ranks=(16,), basis_refresh_steps=20,
        principal_coordinate_sampling_rate=0.5)
    path = str(tmp_path / 'runs.json')
    study.RunStore(path, dict(steps=7, rows=default)).put(
        'a run', dict(test_accuracy=0.5))
    assert study.RunStore(path, dict(steps=7, rows=explicit)).get(
        'a run') == dict(test_accuracy=0.5)
    changed = study.row_configs(principal_d0=16, parameter_groups=4,
                                **kwargs)
    assert changed['hybrid'] == dict(default['hybrid'], principal_d0=16.0,
                                     parameter_groups=4)
    assert {row: c for row, c in changed.items() if row != 'hybrid'} == {
        row: c for row, c in default.items() if row != 'hybrid'}
    for row, c in changed.items():
        if row != 'hybrid':
            assert not {'principal_d0', 'parameter_groups'} & set(c)
    assert study.row_configs(principal_d0=16, **kwargs)['hybrid'] == dict(
        default['hybrid'], principal_d0=16.0)
    assert study.row_configs(parameter_groups=4, **kwargs)['hybrid'] == dict(
        default['hybrid'], parameter_groups=4)
    # Other values are another study.
    with pytest.raises(ValueError, match='--results_json'):
        study.RunStore(path, dict(steps=7, rows=changed))
    for bad, flag in ((dict(principal_d0=0.5), '--principal_d0'),
                      (dict(parameter_groups=0), '--parameter_groups')):
        with pytest.raises(ValueError, match=flag):
            study.row_configs(**bad, **kwargs)


def test_study_flags_pass_principal_d0_and_parameter_groups():
    flag_values = study.flags.FlagValues()
    study.define_flags(flag_values)
    flag_values(['study'])
    assert flag_values.principal_d0 == (
        study.settings_lib.TrainConfig.principal_d0)
    assert flag_values.parameter_groups == (
        study.settings_lib.TrainConfig.parameter_groups)
    flag_values(['study', '--principal_d0=16', '--parameter_groups=3'])
    assert flag_values.principal_d0 == 16.0
    assert flag_values.parameter_groups == 3


def test_tuned_rows_take_the_searchs_fixed_settings_and_best_point(tmp_path):
    path = tmp_path / 'tune_twice.json'
    path.write_text(json.dumps(dict(
        settings=dict(mode='twice', coordinate_sampling_rate=0.5,
                    target_epsilon=3, dataset='fashion_mnist',
                    features='scattering', data_dir=None,
                    validation_examples=5000),
        runs={}, best=dict(learning_rate=8, epochs=60))))
    rows = study.tuned_rows([f'best twice={path}'])
    assert rows == {'best twice': dict(mode='twice',
                                       coordinate_sampling_rate=0.5,
                                       target_epsilon=3,
                                       learning_rate=8, epochs=60)}
    calls = []

    def fake_train(config, data):
        calls.append(config)
        return dict(test_accuracy=0.9, epsilon=3.0, train_seconds=1.0)

    study.run_study(rows, seeds=[0, 1], target_epsilons=[1.0, 8.0],
                    common=dict(steps=280, learning_rate=16),
                    public_examples=0, data=object(), train_fn=fake_train,
                    log=lambda _: None)
    # The tuned schedule replaces the study's steps; its rate the common one.
    assert 'steps' not in calls[0] and calls[0]['epochs'] == 60
    assert calls[0]['learning_rate'] == 8
    # The study's epsilons and seeds, not the search's epsilon 3.
    assert [(c['target_epsilon'], c['seed']) for c in calls] == [
        (1.0, 0), (1.0, 1), (8.0, 0), (8.0, 1)]
    unfinished = tmp_path / 'unfinished.json'
    unfinished.write_text(json.dumps(dict(settings={}, runs={}, best=None)))
    for bad, match in ((f'x{path}', 'NAME=FILE'),
                       (f'row={unfinished}', 'no finished search')):
        with pytest.raises(ValueError, match=match):
            study.tuned_rows([bad])


def test_a_study_file_takes_rows_in_parts_but_never_renames_one(tmp_path):
    path = str(tmp_path / 'runs.json')
    rows = study.row_configs(batch_size=64, coordinate_sampling_rate=0.5,
                             d0=100, ranks=[4], basis_refresh_steps=5)
    part = lambda *names, **common: study.RunStore(
        path, dict(common or dict(steps=7),
                   rows={name: rows[name] for name in names}),
        union_key='rows')
    part('dpsgd q=q1').put('dpsgd q=q1 | epsilon=1 | seed=0',
                           dict(test_accuracy=0.5))
    # Another row joins the study; the first row's run is kept.
    second = part('twice', 'hybrid')
    assert second.get('dpsgd q=q1 | epsilon=1 | seed=0') == dict(
        test_accuracy=0.5)
    second.put('twice | epsilon=1 | seed=0', dict(test_accuracy=0.6))
    with open(path, encoding='utf-8') as f:
        assert set(json.load(f)['settings']['rows']) == {
            'dpsgd q=q1', 'twice', 'hybrid'}
    # A stored name with other settings, or other shared settings, is
    # another study.
    with pytest.raises(ValueError, match=r"other rows \['twice'\]"):
        study.RunStore(path, dict(steps=7, rows={'twice': rows['hybrid']}),
                       union_key='rows')
    with pytest.raises(ValueError, match='other settings'):
        part('twice', steps=8)
    assert part('dpsgd q=q1').get('twice | epsilon=1 | seed=0') == dict(
        test_accuracy=0.6)
