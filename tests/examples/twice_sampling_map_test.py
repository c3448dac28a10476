"""Fast checks of examples/twice_sampling_map.py on a tiny grid."""

import math
import os
import subprocess
import sys

import pytest

from examples import twice_sampling_map as tsm
import tf_twice
from tf_twice import accounting
from tests.paths import ROOT

_SCRIPT = ROOT / 'examples' / 'twice_sampling_map.py'

DELTA = 1e-5
D0 = 100.0
N = 60_000  # Only sets the configs' q1 = batch / N below.
GRID = dict(sampling_rates=(0.005, 0.1), steps=(100, 3000), epsilons=(3.0,),
            coordinate_sampling_rates=(0.5,), d0=D0, delta=DELTA)


@pytest.fixture(scope='module')
def cells():
    return tsm.compute_map(**GRID)


def _update_noise_std(*, q1, q2, linf, epsilon, steps):
    """Per-coordinate noise std of the normalised update, from a config
    calibrated here: z c2 / (expected_batch_size * q2)."""
    config = tf_twice.TwiceSamplingConfig.single(
        num_examples=N, expected_batch_size=q1 * N, l2_norm_clip=1.0,
        linf_norm_clip=linf, coordinate_sampling_rate=q2).calibrate(
            target_epsilon=epsilon, delta=DELTA, steps=steps,
            tolerance=1e-4)
    z = config.noise_multipliers[0]
    return z * config.l2_norm_clips[0] / (config.expected_batch_size * q2)


def test_grid_is_complete(cells):
    assert len(cells) == 4
    assert {(c.example_sampling_rate, c.steps) for c in cells} == {
        (0.005, 100), (0.005, 3000), (0.1, 100), (0.1, 3000)}
    for cell in cells:
        assert all(math.isfinite(z) for z in (
            cell.z_twice, cell.z_same_batch, cell.z_same_contributions))


def test_noise_multipliers_meet_the_target(cells):
    for cell in cells:
        q1, q2 = cell.example_sampling_rate, cell.coordinate_sampling_rate
        for z, rate, coordinates, linf in (
                (cell.z_twice, q1, q2, 1 / math.sqrt(D0)),
                (cell.z_same_batch, q1, 1.0, None),
                (cell.z_same_contributions, q1 * q2, 1.0, None)):
            eps = accounting.epsilon_after_steps(
                steps=cell.steps, delta=DELTA, example_sampling_rate=rate,
                coordinate_sampling_rate=coordinates, noise_multiplier=z,
                l2_norm_clip=1.0, linf_norm_clip=linf)
            assert (1 - 2 * tsm.TOLERANCE) * 3.0 <= eps <= 3.0


def test_ratios_match_direct_calibration(cells):
    """Both ratios against the update noise of configs calibrated here."""
    for cell in cells:
        q1, q2 = cell.example_sampling_rate, cell.coordinate_sampling_rate
        common = dict(epsilon=cell.epsilon, steps=cell.steps)
        twice = _update_noise_std(q1=q1, q2=q2, linf=1 / math.sqrt(D0),
                                  **common)
        same_batch = _update_noise_std(q1=q1, q2=1.0, linf=None, **common)
        same_contributions = _update_noise_std(q1=q1 * q2, q2=1.0,
                                               linf=None, **common)
        assert cell.ratio_same_batch == pytest.approx(
            (twice / same_batch) ** 2, rel=0.01)
        assert cell.ratio_same_contributions == pytest.approx(
            (twice / same_contributions) ** 2, rel=0.01)


def test_same_contributions_is_the_libraries_noise_variance_ratio(cells):
    for cell in cells:
        expected = accounting.noise_variance_ratio(
            target_epsilon=cell.epsilon, delta=DELTA, steps=cell.steps,
            example_sampling_rate=cell.example_sampling_rate,
            coordinate_sampling_rate=cell.coordinate_sampling_rate,
            l2_norm_clip=1.0, linf_norm_clip=1 / math.sqrt(D0))
        assert cell.ratio_same_contributions == pytest.approx(expected,
                                                              rel=0.01)


def test_the_map_separates_small_and_large_noise(cells):
    """Small q1, few steps (little noise): a large gain over DP-SGD at
    q1*q2 and a loss against DP-SGD at q1; q1 = 0.1, T = 3000 (much noise):
    both ratios within 5 % of 1."""
    by_point = {(c.example_sampling_rate, c.steps): c for c in cells}
    small = by_point[(0.005, 100)]
    assert small.ratio_same_contributions < 0.5
    assert small.ratio_same_batch > 1.05
    large = by_point[(0.1, 3000)]
    assert large.ratio_same_contributions == pytest.approx(1.0, abs=0.05)
    assert large.ratio_same_batch == pytest.approx(1.0, abs=0.02)


def test_unreachable_target_is_nan():
    cell, = tsm.compute_map(sampling_rates=(1.0,), steps=(10,),
                            epsilons=(1e-6,), coordinate_sampling_rates=(0.5,))
    assert math.isnan(cell.z_twice) and math.isnan(cell.ratio_same_batch)


def test_script_writes_csv_and_maps(tmp_path, cells):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, str(_SCRIPT), f'--output_dir={tmp_path}',
         '--sampling_rates=0.005,0.1', '--steps=100,3000', '--epsilons=3',
         '--coordinate_sampling_rates=0.5', '--dpi=30'],
        capture_output=True, text=True, env=env, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert 'delta = 1e-05' in result.stdout
    rows = tsm.read_csv(tmp_path / tsm.CSV_NAME)
    assert len(rows) == len(cells)
    for row, cell in zip(rows, cells):
        assert row['example_sampling_rate'] == cell.example_sampling_rate
        assert row['steps'] == cell.steps
        assert row['delta'] == DELTA
        assert row['ratio_same_batch'] == pytest.approx(
            cell.ratio_same_batch, rel=1e-5)
        assert row['ratio_same_contributions'] == pytest.approx(
            cell.ratio_same_contributions, rel=1e-5)
        assert f'{100 * cell.ratio_same_contributions:.1f}' in result.stdout
    for name in tsm.FIGURE_NAMES.values():
        data = (tmp_path / name).read_bytes()
        assert data.startswith(b'\x89PNG') and len(data) > 1000


@pytest.mark.parametrize('flag', ['--coordinate_sampling_rates=1',
                                  '--steps=0', '--d0=0.5'])
def test_bad_flags_are_refused(tmp_path, flag):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, str(_SCRIPT), f'--output_dir={tmp_path}', flag],
        capture_output=True, text=True, env=env, timeout=120, check=False)
    assert result.returncode != 0
    assert not (tmp_path / tsm.CSV_NAME).exists()
