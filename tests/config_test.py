"""TwiceSamplingConfig: validation once, and everything derived from it."""

import json
import math
import subprocess
import sys
import warnings

import attr
import dp_accounting
import pytest

from tf_twice import config as config_lib
from tf_twice.accounting import ledger_state
from tf_twice.config import Block, TwiceSamplingConfig

pytestmark = pytest.mark.tf_free  # Run in one environment (conftest).

N = 60_000


def _single(**overrides):
    kwargs = dict(num_examples=N, expected_batch_size=256,
                  coordinate_sampling_rate=0.5, l2_norm_clip=1.0,
                  linf_norm_clip=0.1, noise_multiplier=1.1)
    kwargs.update(overrides)
    return TwiceSamplingConfig.single(**kwargs)


def test_importing_the_config_does_not_import_tensorflow():
    code = ('import sys, tf_twice, tf_twice.config; '
            'print("tensorflow" in sys.modules)')
    out = subprocess.run([sys.executable, '-c', code], check=True,
                         capture_output=True, text=True).stdout
    assert out.strip() == 'False'


@pytest.mark.parametrize('overrides, message', [
    (dict(num_examples=0), r'num_examples must be an integer >= 1'),
    (dict(num_examples=2.5), r'num_examples must be an integer'),
    (dict(expected_batch_size=0), r'expected_batch_size must be a finite'),
    (dict(expected_batch_size=N + 1), r'expected_batch_size must be in \(0, '
                                      r'num_examples = 60000\]'),
    (dict(coordinate_sampling_rate=0), r'coordinate_sampling_rate must be in '
                                       r'\(0, 1\]'),
    (dict(coordinate_sampling_rate=1.5), r'coordinate_sampling_rate'),
    (dict(coordinate_sampling_rate=2**-17), r'mask resolution'),
    (dict(l2_norm_clip=-1), r'l2_norm_clip must be a finite number > 0'),
    (dict(l2_norm_clip=math.inf), r'l2_norm_clip must be a finite number > 0'),
    (dict(l2_norm_clip=1e-20), r'l2_norm_clip must be a finite number > 0 '
                               r'in \[1e-12, 1e\+30\]'),
    (dict(linf_norm_clip=0), r'linf_norm_clip must be a finite number > 0'),
    (dict(noise_multiplier=-0.1), r'noise_multiplier must be a finite '
                                  r'number >= 0'),
    (dict(noise_multiplier=True), r'noise_multiplier must be a real number'),
    (dict(noise_multiplier=0.0), r'non_private=True'),
])
def test_bad_settings_name_the_argument_and_range(overrides, message):
    with pytest.raises(ValueError, match=message):
        _single(**overrides)


def test_the_config_is_frozen():
    config = _single()
    with pytest.raises(AttributeError):
        config.num_examples = 10
    with pytest.raises(AttributeError):
        config.blocks[0].noise_multiplier = 0.0


def test_blocks_must_be_blocks():
    with pytest.raises(ValueError, match=r'blocks\[1\] must be a tf_twice'):
        TwiceSamplingConfig(num_examples=N, expected_batch_size=10,
                            blocks=(Block(l2_norm_clip=1.0), 1.0))
    with pytest.raises(ValueError, match='between 1 and'):
        TwiceSamplingConfig(num_examples=N, expected_batch_size=10,
                            blocks=())


def test_the_accounting_reads_the_configs_blocks_resolved():
    # One description of a block: the event's blocks are config Blocks,
    # with the config's rate where a block sets none, no l-infinity clip
    # read as c2 and one above c2 capped at it.
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', UserWarning)  # linf above l2.
        config = TwiceSamplingConfig(
            num_examples=N, expected_batch_size=100,
            coordinate_sampling_rate=0.5,
            blocks=(Block(l2_norm_clip=0.2, noise_multiplier=2.0,
                          coordinate_sampling_rate=1.0, dimension=16),
                    Block(l2_norm_clip=0.1, noise_multiplier=1.0,
                          linf_norm_clip=0.5, dimension=1000),
                    Block(l2_norm_clip=0.3, noise_multiplier=3.0,
                          linf_norm_clip=0.01, dimension=50)))
    blocks = config.dp_event().blocks()
    assert all(isinstance(b, Block) for b in blocks.blocks)
    assert blocks.coordinate_sampling_rates == (1.0, 0.5, 0.5)
    assert blocks.linf_norm_clips == (0.2, 0.1, 0.01)
    assert blocks.noise_multipliers == (2.0, 1.0, 3.0)
    assert blocks.dimensions == (16, 1000, 50)


def test_a_block_rate_below_the_mask_resolution_is_the_configs_refusal():
    # The accountant takes any rate in (0, 1]; masks cannot realise one
    # below 2**-16, so the config refuses it and names the block.
    block = Block(l2_norm_clip=1.0, noise_multiplier=1.0,
                  coordinate_sampling_rate=2**-17)
    setting = dict(steps=10, delta=1e-5, example_sampling_rate=0.01,
                   noise_multiplier=1.0)
    epsilon = config_lib.accounting.epsilon_after_steps
    assert 0 <= epsilon(coordinate_sampling_rate=2**-17, **setting) < epsilon(
        coordinate_sampling_rate=0.5, **setting)
    with pytest.raises(ValueError, match=r'blocks\[1\]\.coordinate_sampling_'
                                         r'rate must be >= 2\*\*-16'):
        TwiceSamplingConfig(num_examples=N, expected_batch_size=10,
                            blocks=(Block(l2_norm_clip=1.0), block))


def test_derived_rates():
    config = _single(coordinate_sampling_rate=0.3)
    assert config.example_sampling_rate == 256 / N
    assert config.effective_coordinate_sampling_rate == (
        math.floor(0.3 * 2**16) / 2**16)
    assert config.mask_bits == 16
    assert _single(coordinate_sampling_rate=0.5).mask_bits == 1
    assert _single(coordinate_sampling_rate=0.25).mask_bits == 2
    assert _single(coordinate_sampling_rate=1.0).mask_bits == 1


def test_one_block_event_has_scalar_fields():
    assert _single().dp_event() == (
        config_lib.accounting.TwiceSampledGaussianDpEvent(
            example_sampling_rate=256 / N, coordinate_sampling_rate=0.5,
            noise_multiplier=1.1, l2_norm_clip=1.0, linf_norm_clip=0.1))


def test_several_blocks_give_tuples_with_dimensions():
    config = TwiceSamplingConfig(
        num_examples=N, expected_batch_size=256, coordinate_sampling_rate=0.5,
        blocks=(Block(l2_norm_clip=0.6, noise_multiplier=2.0,
                      linf_norm_clip=0.2),
                Block(l2_norm_clip=0.3, noise_multiplier=3.0)),
    ).with_dimensions((16, 1000))
    event = config.dp_event()
    assert event.l2_norm_clip == (0.6, 0.3)
    assert event.noise_multiplier == (2.0, 3.0)
    assert event.linf_norm_clip == (0.2, None)
    assert event.block_dimensions == (16, 1000)


def test_with_dimensions_refuses_other_block_counts_and_conflicts():
    config = _single()
    with pytest.raises(ValueError, match='the basis has 2 blocks'):
        config.with_dimensions((3, 4))
    config = config.with_dimensions((100,))
    with pytest.raises(ValueError, match='dimension is 100'):
        config.with_dimensions((200,))


def test_standard_dp_sgd_epsilon_equals_dp_accounting():
    # q2 = 1 without an l-infinity clip is the Poisson-subsampled Gaussian:
    # dp_accounting's own RDP accountant is an independent computation.
    config = _single(coordinate_sampling_rate=1.0, linf_norm_clip=None,
                     noise_multiplier=1.1)
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(
        256 / N, dp_accounting.GaussianDpEvent(1.1)), 2000)
    assert config.epsilon(2000, 1e-5) == pytest.approx(
        accountant.get_epsilon(1e-5), rel=1e-9)


def test_twice_sampling_spends_less_than_dp_sgd_at_the_same_noise():
    assert _single().epsilon(2000, 1e-5) < _single(
        coordinate_sampling_rate=1.0, linf_norm_clip=None).epsilon(2000, 1e-5)


def test_calibrate_meets_the_target_tightly():
    template = _single(noise_multiplier=None)
    assert not template.is_calibrated
    with pytest.raises(ValueError, match='calibrate'):
        template.dp_event()
    config = template.calibrate(target_epsilon=3.0, delta=1e-5, steps=2000)
    z = config.noise_multipliers[0]
    assert 2.97 <= config.epsilon(2000, 1e-5) <= 3.0
    # A little less noise would miss the target.
    assert config.with_noise_multipliers((0.98 * z,)).epsilon(
        2000, 1e-5) > 3.0


def test_non_private_needs_the_switch_and_cannot_be_accounted():
    config = _single(noise_multiplier=0.0, non_private=True)
    for call in (config.dp_event, lambda: config.epsilon(10, 1e-5),
                 lambda: config.calibrate(target_epsilon=1.0, delta=1e-5,
                                          steps=10)):
        with pytest.raises(ValueError, match='non_private'):
            call()


def test_steps_for_epochs():
    config = _single(expected_batch_size=250, num_examples=1000)
    assert config.steps_for_epochs(3) == 12
    assert config.steps_for_epochs(0.1) == 1
    with pytest.raises(ValueError, match='epochs must be'):
        config.steps_for_epochs(0)


def test_dict_round_trip_through_json():
    config = TwiceSamplingConfig(
        num_examples=N, expected_batch_size=100.5,
        coordinate_sampling_rate=0.25,
        blocks=(Block(l2_norm_clip=0.6, noise_multiplier=2.0, dimension=7),
                Block(l2_norm_clip=0.3, noise_multiplier=None,
                      linf_norm_clip=0.01)))
    restored = TwiceSamplingConfig.from_dict(
        json.loads(json.dumps(config.to_dict())))
    assert restored == config
    with pytest.raises(ValueError, match='TwiceSamplingConfig version 1'):
        TwiceSamplingConfig.from_dict({'num_examples': 3})


def test_swapped_clips_and_a_large_delta_are_warned_once():
    # Sound settings, so warned rather than refused: an l-infinity clip
    # above the l2 clip clips nothing (the two were likely swapped), and
    # delta >= 1 / n allows a record in the clear.
    with pytest.warns(UserWarning, match='linf_norm_clip = 0.7 is larger'):
        config = _single(l2_norm_clip=0.07, linf_norm_clip=0.7)
    with pytest.warns(UserWarning, match='delta = 0.0003 is at least'):
        config.calibrate(target_epsilon=2.0, delta=3e-4, steps=5)
    # Once per process and values: the calibrated copy and a second
    # calibration say nothing more.
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        config.calibrate(target_epsilon=2.0, delta=3e-4, steps=5)
        _single(l2_norm_clip=1.0, linf_norm_clip=1.0)  # Equal: no warning.
        _single().calibrate(target_epsilon=2.0, delta=1 / (2 * N), steps=5)


def _hybrid(principal_rate, **overrides):
    kwargs = dict(num_examples=N, expected_batch_size=256,
                  coordinate_sampling_rate=0.5,
                  blocks=(Block(l2_norm_clip=0.5, noise_multiplier=1.0,
                                dimension=8,
                                coordinate_sampling_rate=principal_rate),
                          Block(l2_norm_clip=1.0, noise_multiplier=1.2,
                                linf_norm_clip=0.1, dimension=1000)))
    kwargs.update(overrides)
    return TwiceSamplingConfig(**kwargs)


def test_a_block_may_keep_its_coordinates_at_a_rate_of_its_own():
    config = _hybrid(1.0)
    assert config.coordinate_sampling_rates == (1.0, 0.5)
    assert config.effective_coordinate_sampling_rates == (1.0, 0.5)
    assert config.dp_event().coordinate_sampling_rate == (1.0, 0.5)
    # Blocks that share one rate keep the one-rate event (and its key).
    assert _hybrid(None).dp_event() == _hybrid(0.5).dp_event()
    assert _hybrid(None).dp_event().coordinate_sampling_rate == 0.5
    assert config.epsilon(100, 1e-5) > _hybrid(None).epsilon(100, 1e-5)
    calibrated = _hybrid(1.0, blocks=tuple(
        attr.evolve(b, noise_multiplier=None) for b in config.blocks)
                         ).calibrate(target_epsilon=3, delta=1e-5, steps=100)
    assert calibrated.epsilon(100, 1e-5) <= 3
    with pytest.raises(ValueError, match='coordinate_sampling_rate'):
        Block(l2_norm_clip=1.0, coordinate_sampling_rate=1.5)


def test_a_block_rate_round_trips_and_a_block_without_one_is_written_as_before():
    config = _hybrid(1.0)
    data = config.to_dict()
    assert data['blocks'][0]['coordinate_sampling_rate'] == 1.0
    assert 'coordinate_sampling_rate' not in data['blocks'][1]
    assert TwiceSamplingConfig.from_dict(json.loads(json.dumps(data))) == (
        config)


def test_event_keys_of_one_rate_configs_are_pinned():
    # State files and the weights' step records are keyed by these
    # strings: a change would make every earlier run's ledger refuse its
    # own checkpoints. Per-block rates may add keys, never change these.
    assert ledger_state.event_key(_single().dp_event()) == (
        '{"arguments": {"block_dimensions": null, "coordinate_sampling_rate":'
        ' 0.5, "example_sampling_rate": 0.004266666666666667, '
        '"l2_norm_clip": 1.0, "linf_norm_clip": 0.1, "noise_multiplier": '
        '1.1}, "class_name": "TwiceSampledGaussianDpEvent", "module_name": '
        '"tf_twice.accounting.dp_event"}')
    hybrid = TwiceSamplingConfig(
        num_examples=1000, expected_batch_size=50,
        coordinate_sampling_rate=0.5,
        blocks=(Block(l2_norm_clip=0.5, noise_multiplier=1.0, dimension=8),
                Block(l2_norm_clip=1.0, noise_multiplier=1.2,
                      linf_norm_clip=0.1, dimension=100)))
    assert ledger_state.event_key(hybrid.dp_event()) == (
        '{"arguments": {"block_dimensions": [8, 100], '
        '"coordinate_sampling_rate": 0.5, "example_sampling_rate": 0.05, '
        '"l2_norm_clip": [0.5, 1.0], "linf_norm_clip": [null, 0.1], '
        '"noise_multiplier": [1.0, 1.2]}, "class_name": '
        '"TwiceSampledGaussianDpEvent", "module_name": '
        '"tf_twice.accounting.dp_event"}')
