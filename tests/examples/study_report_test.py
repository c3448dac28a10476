"""Checks of examples/study_report.py: runs of several results files merged
into the study's tables and plot, without training."""

import json

import pytest

from examples import study_report


def _run(accuracy, epsilon):
    return dict(test_accuracy=accuracy, epsilon=epsilon * 0.99, delta=1e-5,
                expected_batch_size=2048.0, coordinate_sampling_rate=0.5,
                noise_multiplier=[1.0], total_steps=400, train_seconds=1.0)


def _write(path, runs):
    path.write_text(json.dumps({'settings': {}, 'runs': runs}))
    return str(path)


def test_runs_of_several_files_are_grouped_by_epsilon_and_row(tmp_path):
    study_file = _write(tmp_path / 'study.json', {
        'twice | epsilon=3 | seed=1': _run(0.84, 3),
        'twice | epsilon=3 | seed=0': _run(0.83, 3),
        'dpsgd q=q1 | epsilon=1 | seed=0': _run(0.80, 1),
    })
    hybrid_file = _write(tmp_path / 'hybrid.json', {
        'hybrid | epsilon=3 | seed=0': _run(0.82, 3),
    })
    results = study_report.load_results([hybrid_file, study_file])
    assert sorted(results) == [1.0, 3.0]
    assert list(results[3.0]) == ['twice', 'hybrid']  # The study's order.
    assert [r['test_accuracy'] for r in results[3.0]['twice']] == [0.83, 0.84]
    assert list(results[1.0]) == ['dpsgd q=q1']
    png = tmp_path / 'accuracy.png'
    study_report.study.plot_accuracy(results, str(png))
    assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_a_run_in_two_files_or_a_foreign_file_is_refused(tmp_path):
    run = {'twice | epsilon=3 | seed=0': _run(0.83, 3)}
    a, b = _write(tmp_path / 'a.json', run), _write(tmp_path / 'b.json', run)
    with pytest.raises(ValueError, match='is also in'):
        study_report.load_results([a, b])
    foreign = tmp_path / 'foreign.json'
    foreign.write_text('[1, 2]')
    with pytest.raises(ValueError, match='not a results file'):
        study_report.load_results([str(foreign)])
    bad_key = _write(tmp_path / 'bad.json', {'twice at 3': _run(0.8, 3)})
    with pytest.raises(ValueError, match='unexpected run key'):
        study_report.load_results([bad_key])
