"""Tests of the privacy statement, its numbers and the command line.

The comparison with standard DP-SGD is checked against tf_privacy's
`compute_dp_sgd_privacy` where tensorflow-privacy is installed, and
everywhere against the subsampled Gaussian's RDP computed here from its
binomial expansion.
"""

import importlib
import importlib.util
import logging
import math
import re
import subprocess
import sys

import numpy as np
import pytest

from tf_twice.accounting import compute_twice_sampling_privacy
from tf_twice.accounting import compute_twice_sampling_privacy_statement
from tf_twice.accounting import epsilon_after_steps
from tf_twice.accounting import noise_variance_ratio
from tf_twice.accounting import statement

pytestmark = pytest.mark.tf_free  # Run in one environment (conftest).

needs_tf_privacy = pytest.mark.skipif(
    importlib.util.find_spec('tensorflow_privacy') is None,
    reason='compares with tensorflow-privacy, which is not installed')


def _tf_privacy_compute_dp_sgd_privacy():
    """tf_privacy's compute_dp_sgd_privacy (its package __init__ needs
    tensorflow-estimator, gone since TensorFlow 2.16: skipped then)."""
    if importlib.util.find_spec('tensorflow_estimator') is None:
        sys.skip_tf_privacy_import = True
    lib = importlib.import_module(
        'tensorflow_privacy.privacy.analysis.compute_dp_sgd_privacy_lib')
    return lib.compute_dp_sgd_privacy

# tf_privacy's compute_dp_sgd_privacy orders (integer above 4.5).
TF_PRIVACY_ORDERS = ([1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0, 4.5]
                     + list(range(5, 64)) + [128, 256, 512])


@needs_tf_privacy
def test_without_coordinate_sampling_equals_tf_privacy():
    n, batch, z, epochs, delta = 60000, 256, 1.1, 60, 1e-5
    theirs, their_order = _tf_privacy_compute_dp_sgd_privacy()(
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


def _log_binomial(n, k):
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def _subsampled_gaussian_rdp_by_hand(q, z, order):
    """RDP at an integer order of the Poisson-subsampled Gaussian with
    sensitivity 1: log(sum_k C(a,k) (1-q)^(a-k) q^k exp(k(k-1)/(2 z^2)))
    / (a-1) (arXiv:1908.10530, Section 3.3), summed in log space."""
    terms = [_log_binomial(order, k) + (order - k) * math.log1p(-q)
             + k * math.log(q) + k * (k - 1) / (2 * z * z)
             for k in range(order + 1)] if q < 1 else [
                 order * (order - 1) / (2 * z * z)]
    top = max(terms)
    log_a = top + math.log(sum(math.exp(t - top) for t in terms))
    return log_a / (order - 1)


def _epsilon_at_order(rdp, order, delta):
    """(epsilon, delta)-DP from RDP at one order: arXiv:2004.00010,
    Proposition 12."""
    return rdp + math.log1p(-1 / order) - math.log(delta * order) / (order - 1)


def _standard_epsilon_by_hand(q, z, steps, delta, orders=range(2, 64)):
    """The best epsilon over integer orders, composed over `steps`."""
    return min(_epsilon_at_order(
        steps * _subsampled_gaussian_rdp_by_hand(q, z, a), a, delta)
        for a in orders)


# (q, z, steps, delta): DP-SGD settings across regimes (small and large q,
# little and much noise, few and many steps).
STANDARD_SETTINGS = [
    (256 / 60000, 1.1, 14063, 1e-5),
    (0.01, 0.8, 1000, 1e-5),
    (0.02 * 0.5, 1.2, 2500, 1e-5),
    (0.1, 2.0, 50, 1e-6),
    (0.5, 5.0, 10, 1e-3),
    (1.0, 10.0, 1, 1e-5),
]


@pytest.mark.parametrize('q, z, steps, delta', STANDARD_SETTINGS)
def test_standard_epsilon_equals_the_binomial_expansion(q, z, steps, delta):
    eps, order = statement.standard_dp_sgd_epsilon(
        example_sampling_rate=q, noise_multiplier=z, steps=steps, delta=delta)
    by_hand = _standard_epsilon_by_hand(q, z, steps, delta)
    # tf_privacy's orders include fractional ones and 128..512: its minimum
    # can only be lower than over integer orders 2..63, and where it is an
    # integer order of that range both give the same number.
    assert eps <= by_hand * (1 + 1e-9)
    if order == int(order) and 2 <= order < 64:
        assert eps == pytest.approx(_epsilon_at_order(
            steps * _subsampled_gaussian_rdp_by_hand(q, z, int(order)),
            int(order), delta), rel=1e-9)
        assert eps == pytest.approx(by_hand, rel=1e-9)


def test_standard_epsilon_hits_an_integer_order_and_grows_with_steps():
    # The settings above are not all decided by a fractional or huge order:
    # the equality branch of the test above runs.
    orders = [statement.standard_dp_sgd_epsilon(
        example_sampling_rate=q, noise_multiplier=z, steps=t, delta=d)[1]
        for q, z, t, d in STANDARD_SETTINGS]
    assert sum(2 <= o < 64 and o == int(o) for o in orders) >= 4
    eps = [statement.standard_dp_sgd_epsilon(
        example_sampling_rate=0.01, noise_multiplier=1.0, steps=t,
        delta=1e-5)[0] for t in (10, 100, 1000)]
    assert 0 < eps[0] < eps[1] < eps[2]


def test_standard_epsilon_hides_only_the_dropped_order_notice(caplog):
    # q = 0.25, z = 0.6: dp_accounting >= 0.5 drops orders 1.25 and 1.5
    # (its series does not converge there) and logs it. The statement hides
    # that notice, and only while it computes: the absl logger is left as it
    # was, and the result is dp_accounting's own.
    import dp_accounting
    caplog.set_level(logging.WARNING)
    eps, order = statement.standard_dp_sgd_epsilon(
        example_sampling_rate=0.25, noise_multiplier=0.6, steps=100,
        delta=1e-5)
    assert not [r for r in caplog.records if 'failed to converge' in
                r.getMessage()]
    assert not logging.getLogger('absl').filters
    accountant = dp_accounting.rdp.RdpAccountant(
        list(statement.STANDARD_DP_SGD_ORDERS))
    accountant.compose(dp_accounting.PoissonSampledDpEvent(
        0.25, dp_accounting.GaussianDpEvent(0.6)), 100)
    assert (eps, order) == pytest.approx(
        accountant.get_epsilon_and_optimal_order(1e-5), rel=1e-12)
    logging.getLogger('absl').warning('failed to converge (not hidden)')
    assert [r for r in caplog.records if 'not hidden' in r.getMessage()]


@needs_tf_privacy
@pytest.mark.parametrize('n, batch, z, epochs, delta', [
    (60000, 256, 1.1, 60, 1e-5),
    (50000, 500, 1.2, 25, 1e-5),
    (10000, 100, 0.7, 3, 1e-6),
    (1000, 500, 4.0, 2, 1e-3),
])
def test_standard_epsilon_equals_tf_privacy(n, batch, z, epochs, delta):
    theirs, their_order = _tf_privacy_compute_dp_sgd_privacy()(
        n, batch, z, epochs, delta)
    ours, our_order = statement.standard_dp_sgd_epsilon(
        example_sampling_rate=batch / n, noise_multiplier=z,
        steps=math.ceil(epochs * n / batch), delta=delta)
    assert ours == pytest.approx(theirs, rel=1e-12)
    assert our_order == their_order


@pytest.mark.parametrize('kwargs, name', [
    (dict(example_sampling_rate=0.0), 'example_sampling_rate'),
    (dict(example_sampling_rate=1.5), 'example_sampling_rate'),
    (dict(noise_multiplier=-1.0), 'noise_multiplier'),
    (dict(noise_multiplier=float('nan')), 'noise_multiplier'),
    (dict(steps=0), 'steps'),
    (dict(steps=2.5), 'steps'),
    (dict(delta=0.0), 'delta'),
])
def test_standard_epsilon_bad_arguments(kwargs, name):
    full = dict(example_sampling_rate=0.01, noise_multiplier=1.0, steps=10,
                delta=1e-5)
    full.update(kwargs)
    with pytest.raises(ValueError, match=name):
        statement.standard_dp_sgd_epsilon(**full)


def test_statement_imports_no_tensorflow():
    # The statement (and so the command line) needs dp_accounting only.
    code = ('import sys; from tf_twice.accounting import statement; '
            'statement.compute_twice_sampling_privacy_statement('
            '1000, 10, 1, 1.0, 1e-5, 0.5); '
            'bad = [m for m in ("tensorflow", "tensorflow_privacy") '
            'if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)')
    result = subprocess.run([sys.executable, '-c', code], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


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
    standard = _standard_epsilon_by_hand(q=0.02 * q2, z=z, steps=2500,
                                         delta=delta)
    assert _numbers_after("(tf_privacy's accounting):", text) == round(
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
    # Hybrid clipping's default: an unmasked principal block beside the
    # residual at q2; one rate for both would understate epsilon.
    hybrid = subprocess.run(
        [sys.executable, '-m', 'tf_twice.compute_privacy', '--N=60000',
         '--batch_size=2048', '--noise_multiplier=3,1.34', '--epochs=80',
         '--coordinate_sampling_rate=1,0.5', '--l2_norm_clip=0.6,0.8',
         '--linf_norm_clip=0.6,0.08'],
        capture_output=True, text=True, timeout=300, check=True)
    eps, _ = compute_twice_sampling_privacy(
        60000, 2048, (3.0, 1.34), 80, 1e-5, (1.0, 0.5), (0.6, 0.8),
        (0.6, 0.08))
    masked, _ = compute_twice_sampling_privacy(
        60000, 2048, (3.0, 1.34), 80, 1e-5, 0.5, (0.6, 0.8), (0.6, 0.08))
    assert _numbers_after('Epsilon with twice sampling:',
                          hybrid.stdout) == round(eps, 3) > masked
    # So one rate below 1 for several blocks is refused, naming the flag.
    single = subprocess.run(
        [sys.executable, '-m', 'tf_twice.compute_privacy', '--N=60000',
         '--batch_size=2048', '--noise_multiplier=3,1.34', '--epochs=80',
         '--coordinate_sampling_rate=0.5', '--l2_norm_clip=0.6,0.8'],
        capture_output=True, text=True, timeout=300)
    assert single.returncode != 0
    assert ('--coordinate_sampling_rate must give one rate per block (2)'
            in single.stderr)


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


def test_plain_dp_sgd_is_named_so_without_twice_samplings_terms():
    # q2 = 1 and no l-infinity clip: the step is DP-SGD's, and the
    # statement says so (no "q2 = 1", no "d0 = 1").
    text = statement.compute_twice_sampling_privacy_statement(
        60000, 256, 3, 1.1, 1e-5, 1.0)
    assert text.startswith('DP-SGD performed over 60000 examples')
    assert 'q2 =' not in text.split('\n\n')[0] and 'd0' not in text
    twice = statement.compute_twice_sampling_privacy_statement(
        60000, 256, 3, 1.1, 1e-5, 0.5, 1.0, 0.1)
    assert twice.startswith('Twice-sampled DP-SGD')
    assert 'q2 = 0.5' in twice and 'd0 = 100' in twice


def test_a_statement_with_per_block_rates_lists_them_and_scales_the_comparison():
    args = (60_000, 256, 5, [1.0, 1.1], 1e-5)
    kwargs = dict(l2_norm_clip=[0.5, 1.0], linf_norm_clip=[None, 0.05],
                  block_dimensions=[8, 10_000])
    text = compute_twice_sampling_privacy_statement(*args, [1.0, 0.5],
                                                    **kwargs)
    eps = epsilon_after_steps(
        steps=math.ceil(5 * 60_000 / 256), delta=1e-5,
        example_sampling_rate=256 / 60_000,
        coordinate_sampling_rate=[1.0, 0.5], noise_multiplier=[1.0, 1.1],
        **kwargs)
    assert f'Epsilon with twice sampling:{eps:>37.3f}' in text
    assert 'q2 = (1, 0.5)' in text and re.search(r'coordinates +q2\n', text)
    assert '(q2 / q2_j)^2' in text
    # The comparison's hybrid variance: block j's over (q2_j / max q2)^2.
    got = statement.hybrid_noise_variance_ratio(
        noise_multipliers=[1.0, 1.1], l2_norm_clips=[0.5, 1.0],
        block_dimensions=[8, 10_000], target_epsilon=eps, delta=1e-5,
        steps=1172, example_sampling_rate=256 / 60_000,
        coordinate_sampling_rate=[1.0, 0.5])
    assert got.hybrid_variance == pytest.approx(
        8 * 0.5**2 + 10_000 * (1.1 * 2)**2)
    # Equal rates give the one-rate statement, the rates written as given.
    assert compute_twice_sampling_privacy_statement(
        *args, [0.5, 0.5], **kwargs) == compute_twice_sampling_privacy_statement(
            *args, 0.5, **kwargs).replace('q2 = 0.5', 'q2 = (0.5, 0.5)')


def test_a_statement_takes_numpy_per_block_arguments():
    args = (60_000, 256, 5)
    kwargs = dict(delta=1e-5, l2_norm_clip=[0.5, 1.0],
                  block_dimensions=[8, 10_000])
    assert compute_twice_sampling_privacy_statement(
        *args, noise_multiplier=np.array([1.0, 1.1]),
        coordinate_sampling_rate=np.array([1.0, 0.5]), **kwargs) == (
            compute_twice_sampling_privacy_statement(
                *args, noise_multiplier=[1.0, 1.1],
                coordinate_sampling_rate=[1.0, 0.5], **kwargs))


def test_the_one_rate_noise_ratio_refuses_per_block_rates_by_name():
    with pytest.raises(ValueError, match='hybrid_noise_variance_ratio'):
        noise_variance_ratio(
            target_epsilon=3.0, delta=1e-5, steps=100,
            example_sampling_rate=0.01, coordinate_sampling_rate=[1.0, 0.5],
            l2_norm_clip=[0.5, 1.0], linf_norm_clip=[None, 0.1])
