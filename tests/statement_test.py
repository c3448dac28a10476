"""Tests of the privacy statement, its numbers and the command line."""

import math
import re
import subprocess
import sys

import pytest
from tensorflow_privacy.privacy.analysis import compute_dp_sgd_privacy_lib

from tf_twice.accounting import compute_twice_sampling_privacy
from tf_twice.accounting import compute_twice_sampling_privacy_statement
from tf_twice.accounting import epsilon_after_steps
from tf_twice.accounting import noise_variance_ratio

# tf_privacy's compute_dp_sgd_privacy orders (integer above 4.5).
TF_PRIVACY_ORDERS = ([1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0, 4.5]
                     + list(range(5, 64)) + [128, 256, 512])


def test_without_coordinate_sampling_equals_tf_privacy():
    n, batch, z, epochs, delta = 60000, 256, 1.1, 60, 1e-5
    theirs, their_order = compute_dp_sgd_privacy_lib.compute_dp_sgd_privacy(
        n, batch, z, epochs, delta)
    ours, our_order = compute_twice_sampling_privacy(
        n, batch, z, epochs, delta, coordinate_sampling_rate=1.0,
        linf_norm_clip=None, orders=TF_PRIVACY_ORDERS)
    assert our_order == their_order and our_order == int(our_order)
    assert ours == pytest.approx(theirs, rel=1e-9)


def test_steps_follow_tf_privacy():
    eps, _ = compute_twice_sampling_privacy(
        50000, 1000, 1.2, 2.5, 1e-5, 0.5, 1.0, 0.1)
    # ceil(2.5 * 50000 / 1000) = 125 steps at q1 = 0.02.
    expected = epsilon_after_steps(
        steps=125, delta=1e-5, example_sampling_rate=0.02,
        coordinate_sampling_rate=0.5, noise_multiplier=1.2,
        linf_norm_clip=0.1)
    assert eps == expected


def _numbers_after(label, text):
    match = re.search(re.escape(label) + r'[^0-9]*([0-9.]+)', text)
    assert match, f'{label!r} not in statement:\n{text}'
    return float(match.group(1))


def test_statement_reports_the_accountants_numbers():
    n, batch, epochs, z, delta, q2 = 50000, 1000, 50, 1.2, 1e-5, 0.5
    text = compute_twice_sampling_privacy_statement(
        n, batch, epochs, z, delta, q2, 1.0, 0.1)
    eps, _ = compute_twice_sampling_privacy(n, batch, z, epochs, delta, q2,
                                            1.0, 0.1)
    assert _numbers_after('Epsilon with twice sampling:', text) == round(eps, 3)
    standard, _ = compute_dp_sgd_privacy_lib.compute_dp_sgd_privacy(
        n, batch * q2, z, epochs * q2, delta)
    assert _numbers_after('(by tensorflow_privacy):', text) == round(
        standard, 3)
    ratio = _numbers_after('Noise-variance ratio at equal epsilon (', text
                           .replace(f'({eps:.3f}):', '(eps):'))
    assert ratio == pytest.approx(noise_variance_ratio(
        target_epsilon=eps, delta=delta, steps=2500,
        example_sampling_rate=0.02, coordinate_sampling_rate=q2,
        linf_norm_clip=0.1), abs=1e-4)
    assert 0.0 < ratio < 1.0
    assert 'Poisson sampling' in text and 'shuffled' in text
    assert 'no microbatching' in ' '.join(text.split())


def test_microbatching_is_refused():
    with pytest.raises(ValueError, match='used_microbatching must be False'):
        compute_twice_sampling_privacy_statement(
            50000, 1000, 5, 2.4, 1e-5, 0.5, 1.0, 0.1, used_microbatching=True)


def test_noise_variance_ratio_is_one_without_coordinate_sampling():
    ratio = noise_variance_ratio(
        target_epsilon=2.0, delta=1e-5, steps=1000, example_sampling_rate=0.01,
        coordinate_sampling_rate=1.0, linf_norm_clip=0.1)
    assert ratio == pytest.approx(1.0, abs=1e-3)


def test_multi_block_statement_lists_blocks():
    text = compute_twice_sampling_privacy_statement(
        50000, 1000, 5, (1.0, 2.0), 1e-5, 0.5, (0.5, 1.0), (0.1, None))
    text = ' '.join(text.split())  # Undo line wrapping.
    assert 'over 2 hybrid-clipping blocks' in text
    assert 'noise multiplier (1, 2)' in text


@pytest.mark.parametrize('args,message', [
    ((0, 10, 1, 1.0, 1e-5, 0.5), 'number_of_examples'),
    ((100, 200, 1, 1.0, 1e-5, 0.5), r'batch_size must be in \(0, '),
    ((100, 10, 0, 1.0, 1e-5, 0.5), 'num_epochs'),
    ((100, 10, 1, 1.0, 2.0, 0.5), 'delta'),
    ((100, 10, 1, 1.0, 1e-5, 0.0), 'coordinate_sampling_rate'),
])
def test_statement_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        compute_twice_sampling_privacy_statement(*args)


def test_command_line():
    result = subprocess.run(
        [sys.executable, '-m', 'tf_twice.compute_privacy', '--N=50000',
         '--batch_size=1000', '--noise_multiplier=1.2', '--epochs=50',
         '--delta=1e-5', '--coordinate_sampling_rate=0.5',
         '--l2_norm_clip=1.0', '--linf_norm_clip=0.1'],
        capture_output=True, text=True, timeout=300, check=True)
    eps, _ = compute_twice_sampling_privacy(50000, 1000, 1.2, 50, 1e-5, 0.5,
                                            1.0, 0.1)
    assert _numbers_after('Epsilon with twice sampling:',
                          result.stdout) == round(eps, 3)
    bad = subprocess.run(
        [sys.executable, '-m', 'tf_twice.compute_privacy', '--N=100',
         '--batch_size=10', '--noise_multiplier=1', '--epochs=1',
         '--coordinate_sampling_rate=1.5'],
        capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0
    assert 'coordinate_sampling_rate must be in (0, 1]' in bad.stderr
    assert math.isfinite(eps)


def test_multi_block_statement_compares_total_noise_variance():
    from tf_twice.accounting.statement import hybrid_noise_variance_ratio
    z, c2, c_inf = (3.0, 2.0, 1.5), (0.5, 0.3, 0.2), (0.1, None, 0.01)
    dims = (10, 30, 5000)
    args = (50000, 1000, 5, z, 1e-5, 0.5, c2, c_inf)
    text = compute_twice_sampling_privacy_statement(*args,
                                                    block_dimensions=dims)
    flat = ' '.join(text.split())
    # One row per block: l2 clip, l-inf clip, d0, z, sigma, r.
    assert re.search(r'residual 0\.2 0\.01 400 1\.5 0\.3 5,000', flat)
    assert re.search(r' 1 0\.5 0\.1 25 3 1\.5 10 ', flat)
    eps, _ = compute_twice_sampling_privacy(50000, 1000, z, 5, 1e-5, 0.5,
                                            c2, c_inf, block_dimensions=dims)
    cmp = hybrid_noise_variance_ratio(
        noise_multipliers=z, l2_norm_clips=c2, block_dimensions=dims,
        target_epsilon=eps, delta=1e-5, steps=250,
        example_sampling_rate=0.02, coordinate_sampling_rate=0.5)
    hybrid = 10 * 1.5**2 + 30 * 0.6**2 + 5000 * 0.3**2
    assert cmp.hybrid_variance == pytest.approx(hybrid)
    assert cmp.global_l2_clip == pytest.approx(math.sqrt(0.25 + 0.09 + 0.04))
    assert cmp.standard_variance == pytest.approx(
        5000 * (cmp.standard_noise_multiplier * cmp.global_l2_clip)**2)
    ratio = _numbers_after('Hybrid noise-variance ratio at equal epsilon (',
                           flat.replace(f'({eps:.3f}):', '(eps):'))
    assert ratio == pytest.approx(cmp.ratio, abs=1e-4)
    assert 'q1*q2 = 0.01' in flat and 'standard DP-SGD' in flat
    # Without dimensions the blocks are listed and the ratio is explained.
    text = ' '.join(compute_twice_sampling_privacy_statement(*args).split())
    assert 'pass block_dimensions' in text and 'residual 0.2' in text
    # One block: unchanged (no block table).
    one = compute_twice_sampling_privacy_statement(50000, 1000, 5, 2.4, 1e-5,
                                                   0.5, 1.0, 0.1)
    assert 'Hybrid-clipping blocks' not in one
