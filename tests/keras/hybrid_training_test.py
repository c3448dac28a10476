"""Hybrid clipping in training: both paths, the basis in fit, the config
and its event, and the noise it saves at equal epsilon."""

import json
import re

import attr

import numpy as np
import pytest
import tensorflow as tf

from tests import markers
from tests import tiny_models
from tests.hybrid_setup import assert_all_close as _assert_all_close
from tests.hybrid_setup import basis as _basis
from tests.hybrid_setup import data as _data
from tests.hybrid_setup import loss as _loss
from tests.hybrid_setup import mlp as _mlp
from tests.hybrid_setup import orthonormal_basis as _orthonormal_basis
from tests.hybrid_setup import params as _params
from tests.hybrid_setup import weights as _weights
from tests.hybrid_setup import (DELTA, GROUPS, HYBRID, NUM_EXAMPLES, RANKS,
                                 SEED, SINGLE)
from tf_twice import optimizers
from tf_twice import sampling
from tf_twice.accounting import TwiceSampledGaussianDpEvent
from tf_twice.accounting import calibrate_noise_multiplier
from tf_twice.accounting.statement import hybrid_noise_variance_ratio
from tf_twice.config import Block, TwiceSamplingConfig
from tf_twice.hybrid import block_statistics
from tf_twice.hybrid import budgets
from tf_twice.hybrid.budget_splits import floored, split_l2_budget
from tf_twice.hybrid import learning
import tf_twice.keras as tf_twice_keras
from tf_twice.keras import DPModel, PrivacyLedger
from tf_twice.keras import basis_refresh
from tf_twice.keras import guards
from tf_twice.keras import vectorized_backprop
from tf_twice.mechanism import aggregation as agg
from tf_twice.mechanism import basis as basis_lib
from tf_twice.mechanism import hybrid


# --- the two training paths -------------------------------------------------


def _fast(basis, physical_batch_size=8, model=None, config=HYBRID):
    dp = DPModel(model or _mlp(), config, basis=basis,
                 physical_batch_size=physical_batch_size, seed=SEED)
    dp.compile(optimizer=tf.keras.optimizers.SGD(0.3), loss=_loss())
    return dp


def _optimizer_path(basis, physical_batch_size=4, seed=SEED, config=HYBRID):
    dp = DPModel(_mlp(), physical_batch_size=physical_batch_size)
    dp.compile(optimizer=optimizers.TwiceSamplingDPKerasSGDOptimizer(
        config, learning_rate=0.3, basis=basis, seed=seed), loss=_loss())
    return dp


def test_unmasked_principal_blocks_train_and_are_accounted_per_block():
    basis = _basis()
    dp = _fast(basis, 3, config=UNMASKED_PRINCIPAL)
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, verbose=0)
    x, y = _data(NUM_EXAMPLES, seed=2)
    dp.fit(sampling.poisson_batches(x, y, expected_batch_size=6.0,
                                    physical_batch_size=3, steps=3, seed=1),
           callbacks=[ledger], verbose=0)
    assert ledger.event.coordinate_sampling_rate == (1.0, 1.0, 0.5)
    assert ledger.steps == 3
    dims = basis.block_dimensions  # DPModel sets them from the basis.
    assert ledger.epsilon == pytest.approx(UNMASKED_PRINCIPAL.with_dimensions(
        dims).epsilon(3, DELTA), rel=1e-9)
    assert ledger.epsilon > HYBRID.with_dimensions(dims).epsilon(3, DELTA)


# Unmasked principal blocks, the residual at the config's q2 = 1/2.
UNMASKED_PRINCIPAL = attr.evolve(HYBRID, blocks=tuple(
    attr.evolve(b, coordinate_sampling_rate=q2)
    for b, q2 in zip(HYBRID.blocks, (1.0, 1.0, None))))


@markers.needs_tf_privacy_optimizers
@pytest.mark.parametrize('physical_batch_size, config, block_scales', [
    (8, HYBRID, None), (3, HYBRID, (2.0, 0.5, 1.5)),
    (3, UNMASKED_PRINCIPAL, None)])
def test_fast_path_equals_optimizer_path_with_a_basis(physical_batch_size,
                                                      config, block_scales):
    basis = _basis()
    x, y = _data(8, seed=2)
    reference = _optimizer_path(basis, physical_batch_size, config=config)
    reference.set_basis(basis, block_scales=block_scales)
    tiny_models.one_step(reference, x, y)
    dp = _fast(basis, physical_batch_size, config=config)
    dp.set_basis(basis, block_scales=block_scales)
    tiny_models.one_step(dp, x, y)
    assert not np.allclose(_weights(dp)[0], _weights(_mlp())[0])
    _assert_all_close(_weights(dp), _weights(reference))
    # And the basis matters: without it (one block) the step differs.
    plain = DPModel(_mlp(), SINGLE, physical_batch_size=8, seed=SEED)
    plain.compile(optimizer=tf.keras.optimizers.SGD(0.3), loss=_loss())
    tiny_models.one_step(plain, x, y)
    assert not np.allclose(_weights(plain)[0], _weights(dp)[0])


def _scaled_clips(config, scales):
    return attr.evolve(config, blocks=tuple(attr.evolve(
        b, l2_norm_clip=b.l2_norm_clip * s,
        linf_norm_clip=None if b.linf_norm_clip is None
        else b.linf_norm_clip * s) for b, s in zip(config.blocks, scales)))


@pytest.mark.parametrize('path', [
    'model', pytest.param('optimizer',
                          marks=markers.needs_tf_privacy_optimizers)])
def test_block_scales_run_the_config_with_scaled_clips(path):
    # A step with block scales (noise, masks, l-infinity clips) is the step
    # of the config whose clips are scaled, from the same seeded key: the
    # scales act once, at both ends of the aggregation, on either path.
    basis, scales = _basis(), (2.0, 0.5, 1.5)
    x, y = _data(8, seed=2)
    steps = []
    for config, block_scales in ((HYBRID, scales),
                                 (_scaled_clips(HYBRID, scales), None)):
        if path == 'model':
            dp = _fast(basis, 3, config=config)
            dp.set_basis(basis, block_scales=block_scales)
        else:
            dp = _optimizer_path(basis, 3, config=config)
            dp.optimizer.set_basis(basis, block_scales=block_scales)
        tiny_models.one_step(dp, x, y)
        steps.append(_weights(dp))
    _assert_all_close(*steps)
    assert not np.allclose(steps[0][0], _weights(_mlp())[0])


@pytest.mark.parametrize('with_basis', [False, True])
def test_a_float64_layer_among_float32_ones_trains_as_if_all_were_float64(
        with_basis):
    # An example's norm spans both layers, so the step clips, masks, sums
    # and draws noise in float64 (precision.accumulation_dtype) and each
    # variable keeps its dtype. Only the float32 layer's own arithmetic differs from
    # an all-float64 model with the same weights (so the same seeded keys).
    basis, config = (_basis(), HYBRID) if with_basis else (None, SINGLE)
    x, y = _data(8, seed=2)
    initial = _mlp(dtypes=('float64', 'float32')).get_weights()
    results = []
    for dtypes in (('float64', 'float32'), ('float64', 'float64')):
        model = _mlp(dtypes=dtypes)
        model.set_weights(initial)
        dp = DPModel(model, config, basis=basis, physical_batch_size=3,
                     seed=SEED)
        dp.compile(optimizer=tf.keras.optimizers.SGD(0.3), loss=_loss())
        tiny_models.one_step(dp, x, y)
        assert [tf.as_dtype(v.dtype).name for v in dp.trainable_variables
                ] == [dtypes[0]] * 2 + [dtypes[1]] * 2
        results.append(_weights(dp))
    assert not np.allclose(results[0][0], _weights(_mlp())[0])
    _assert_all_close(results[0], results[1])


def test_microbatching_does_not_change_the_hybrid_update():
    basis = _basis()
    x, y = _data(10, seed=4)
    results = []
    for physical in (3, 16):  # 4 chunks (2 rows of padding) vs 1 chunk
        dp = _fast(basis, physical)
        tiny_models.one_step(dp, x, y)
        results.append(_weights(dp))
    _assert_all_close(results[0], results[1])


def test_set_basis_takes_effect_without_retracing():
    traces = []

    class CountingDPModel(DPModel):

        def train_step(self, data):
            traces.append(1)  # once per trace, not per step
            return super().train_step(data)

    first, second = _basis(seed=0), _basis(seed=0, public_seed=9)
    assert first.structure == second.structure
    x, y = _data(6, seed=1)
    dp = CountingDPModel(_mlp(), HYBRID, basis=first, physical_batch_size=4,
                         seed=SEED)
    dp.compile(optimizer=tf.keras.optimizers.SGD(0.3), loss=_loss())
    tiny_models.one_step(dp, x, y)
    count = len(traces)
    weights, state = _weights(dp), dp.aggregator.keys.get_state()
    dp.set_basis(second)
    assert dp.basis is second
    tiny_models.one_step(dp, x, y)
    assert len(traces) == count
    # The step used the new basis: a model built with it from the same
    # weights and generator state takes the same step.
    ref = _fast(second, 4)
    for v, w in zip(ref.inner_model.trainable_variables, weights):
        v.assign(w)
    ref.aggregator.keys.set_state(state)
    tiny_models.one_step(ref, x, y)
    _assert_all_close(_weights(dp), _weights(ref))
    # The basis variables are neither weights nor in checkpoints.
    # + privacy_record, its own weight.
    assert len(dp.weights) == len(dp.inner_model.weights) + 1


def test_basis_refresh_callback_drives_set_basis_in_fit():
    traces = []

    class CountingDPModel(DPModel):

        def train_step(self, data):
            traces.append(1)
            return super().train_step(data)

    public = _data(32, seed=1)
    inner = _mlp()
    learn = dict(ranks=RANKS, groups=GROUPS)
    basis = learning.learn_basis(basis_refresh.public_per_example_gradients(
        inner, _loss(), *public), **learn)
    dp = CountingDPModel(inner, HYBRID, basis=basis, physical_batch_size=4,
                         seed=SEED)
    dp.compile(optimizer=tf.keras.optimizers.SGD(0.3), loss=_loss())
    refresh = basis_refresh.BasisRefresh(inner, public, _loss(), every_steps=2,
                                         on_refresh=dp.set_basis, **learn)
    dp.fit(_poisson(steps=5), callbacks=[refresh], verbose=0)
    assert refresh.refresh_count == 3  # before steps 0, 2 and 4
    assert dp.basis is refresh.basis
    assert len(traces) <= 2  # the first trace creates the optimizer's vars


def test_replanned_budgets_follow_the_public_norms_at_the_same_epsilon():
    public = _data(32, seed=1)
    inner = _mlp()
    learn = dict(ranks=RANKS, groups=GROUPS)
    grads = basis_refresh.public_per_example_gradients(inner, _loss(),
                                                       *public)
    basis = learning.learn_basis(grads, **learn)
    config = budgets.plan_blocks(
        TwiceSamplingConfig.single(
            num_examples=NUM_EXAMPLES, expected_batch_size=6.0,
            l2_norm_clip=0.6, coordinate_sampling_rate=0.5),
        basis, grads, target_epsilon=3.0, delta=DELTA, steps=5)
    dp = _fast(basis, 4, model=inner, config=config)
    seen = []

    def set_basis(basis, *, block_scales):
        seen.append((_weights(inner), basis, block_scales))
        dp.set_basis(basis, block_scales=block_scales)

    refresh = basis_refresh.BasisRefresh(
        inner, public, _loss(), every_steps=2, on_refresh=set_basis,
        replan_config=dp.config, budget_split='projection_norms', **learn)
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, verbose=0)
    dp.fit(_poisson(steps=5), callbacks=[ledger, refresh], verbose=0)
    # The event, so epsilon, is the plan's; the mechanism's clips follow
    # the public projection norms at each refresh's weights.
    assert ledger.epsilon == pytest.approx(config.epsilon(5, DELTA),
                                           rel=1e-12)
    assert len(seen) == 3
    assert dp.aggregator.block_scales == seen[-1][2]
    for weights, basis, scales in seen:
        model = _mlp()
        model.set_weights(weights)
        norms = block_statistics.public_block_statistics(
            basis, basis_refresh.public_per_example_gradients(
                model, _loss(), *public), clip_norm=0.6).mean_norms
        np.testing.assert_allclose(
            np.multiply(scales, config.l2_norm_clips),
            split_l2_budget(0.6, floored(norms)), rtol=1e-6)
    assert not np.allclose(seen[-1][2], 1.0, atol=1e-3)


def test_set_basis_refuses_another_structure_or_no_basis():
    dp = _fast(_basis())
    grads = basis_refresh.public_per_example_gradients(_mlp(), _loss(),
                                                       *_data(32))
    with pytest.raises(ValueError, match='same structure|structure of'):
        dp.set_basis(learning.learn_basis(grads, [4, 4], groups=GROUPS))
    plain = DPModel(_mlp(), SINGLE, physical_batch_size=4)
    with pytest.raises(ValueError, match='built with basis'):
        plain.set_basis(_basis())


MISFITS = [
    (SINGLE, 'one Block per block of the basis: 3'),
    (_params(l2_norm_clip=(0.5, 0.3), noise_multiplier=(1.0, 2.0),
             linf_norm_clip=None), 'one Block per block of the basis: 3'),
    # A block whose dimension is not the basis block's.
    (TwiceSamplingConfig(
        num_examples=NUM_EXAMPLES, expected_batch_size=6.0,
        blocks=(Block(l2_norm_clip=0.5, noise_multiplier=1.0, dimension=4),
                Block(l2_norm_clip=0.3, noise_multiplier=2.0),
                Block(l2_norm_clip=0.2, noise_multiplier=1.5))),
     'dimension is 4 but the basis block has 3'),
]


def test_hybrid_dp_model_keeps_chunks_of_at_most_256(monkeypatch):
    # Its per-example gradients are written out for the projection: the
    # 512-row chunks of a model of Dense layers were slower there.
    monkeypatch.setattr(vectorized_backprop, 'gpu_visible', lambda: False)
    sizes = dict(num_examples=10_000, expected_batch_size=1000.0)
    single = TwiceSamplingConfig.single(l2_norm_clip=0.6,
                                        noise_multiplier=1.0, **sizes)
    assert DPModel(_mlp(), single).physical_batch_size == 512
    assert DPModel(_mlp(), _params(**sizes),
                   basis=_basis()).physical_batch_size == 256


@pytest.mark.parametrize('config, match', MISFITS)
def test_config_blocks_must_fit_the_basis(config, match):
    with pytest.raises(ValueError, match=match):
        DPModel(_mlp(), config, basis=_basis(), physical_batch_size=4)


@markers.needs_tf_privacy_optimizers
@pytest.mark.parametrize('config, match', MISFITS)
def test_dp_optimizer_config_blocks_must_fit_the_basis(config, match):
    with pytest.raises(ValueError, match=match):
        optimizers.TwiceSamplingDPKerasSGDOptimizer(config, basis=_basis())


def test_several_blocks_without_a_basis_and_foreign_bases_are_refused():
    with pytest.raises(ValueError, match='no basis is given'):
        DPModel(_mlp(), HYBRID, physical_batch_size=4)
    other = _orthonormal_basis([43], [[2, 3]])  # one variable of 43
    with pytest.raises(ValueError, match='variable_shapes'):
        DPModel(_mlp(), HYBRID, basis=other, physical_batch_size=4)


@markers.needs_tf_privacy_optimizers
def test_dp_optimizer_with_several_blocks_needs_a_basis():
    with pytest.raises(ValueError, match='no basis is given'):
        optimizers.TwiceSamplingDPKerasSGDOptimizer(HYBRID)


def test_config_round_trip_with_a_basis():
    basis = _basis()
    dp = _fast(basis)
    config = dp.get_config()
    assert [b['l2_norm_clip'] for b in config['config']['blocks']] == [
        0.5, 0.3, 0.2]
    json.dumps({k: v for k, v in config.items() if k != 'model'})
    clone = DPModel.from_config({**config, 'basis': basis})
    assert clone.config == dp.config and clone.basis is basis
    assert clone.dp_event() == dp.dp_event()
    assert not clone.aggregator.awaiting_basis


def _same_step(dp, reference, x, y):
    # From the same weights and key state both models take the same step.
    for v, w in zip(dp.inner_model.trainable_variables,
                    _weights(reference)):
        v.assign(w)
    for model in (dp, reference):
        tiny_models.fix_next_step_key(model)
    start = _weights(reference)
    tiny_models.one_step(dp, x, y)
    tiny_models.one_step(reference, x, y)
    assert not np.allclose(_weights(dp)[0], start[0])
    _assert_all_close(_weights(dp), _weights(reference))


@pytest.mark.parametrize('path', [
    'model', pytest.param('optimizer',
                          marks=markers.needs_tf_privacy_optimizers)])
def test_rebuilt_from_its_config_a_hybrid_model_trains_only_with_a_basis(
        path):
    # Keras's loaders call from_config without a basis (no artifact holds
    # it); raising there made Keras 2's SavedModel loader revive a generic
    # model that trains without DP. Now the model comes back and refuses
    # every step until set_basis.
    basis = _basis()
    x, y = _data(6, seed=3)
    if path == 'model':
        original = _fast(basis, 4)
        rebuilt = DPModel.from_config(original.get_config())
        rebuilt.compile(optimizer=tf.keras.optimizers.SGD(0.3),
                        loss=_loss())
    else:
        original = _optimizer_path(basis)
        optimizer = optimizers.TwiceSamplingDPKerasSGDOptimizer.from_config(
            original.optimizer.get_config())
        rebuilt = DPModel(_mlp(), physical_batch_size=4)
        rebuilt.compile(optimizer=optimizer, loss=_loss())
    assert rebuilt.aggregator.awaiting_basis and rebuilt.basis is None
    assert rebuilt.config == original.config
    assert rebuilt.dp_event() == original.dp_event()
    before = _weights(rebuilt)
    for run in (lambda: tiny_models.one_step(rebuilt, x, y),
                lambda: rebuilt.train_step((x, y))):
        with pytest.raises(ValueError, match='set_basis'):
            run()
    _assert_all_close(_weights(rebuilt), before)
    # A basis of other block dimensions is refused.
    other = learning.learn_basis(
        basis_refresh.public_per_example_gradients(_mlp(), _loss(),
                                                   *_data(32, seed=1)),
        [2, 5], groups=GROUPS, seed=0)
    assert other.block_dimensions != basis.block_dimensions
    with pytest.raises(ValueError, match='coordinates'):
        rebuilt.set_basis(other)
    with pytest.raises(ValueError, match='HybridBasis'):
        rebuilt.set_basis('basis.npz')
    assert rebuilt.aggregator.awaiting_basis
    rebuilt.set_basis(basis)
    assert rebuilt.basis is basis and rebuilt.config == original.config
    _same_step(rebuilt, original, x, y)


def test_a_basis_refresh_gives_a_rebuilt_hybrid_model_its_basis():
    # The refresh before step 0 runs before the step is traced.
    public = _data(32, seed=1)
    rebuilt = DPModel.from_config(_fast(_basis(), 4).get_config())
    rebuilt.compile(optimizer=tf.keras.optimizers.SGD(0.3), loss=_loss())
    assert rebuilt.aggregator.awaiting_basis
    refresh = basis_refresh.BasisRefresh(
        rebuilt.inner_model, public, _loss(), every_steps=2,
        on_refresh=rebuilt.set_basis, ranks=RANKS, groups=GROUPS)
    rebuilt.fit(_poisson(steps=3), callbacks=[refresh], verbose=0)
    assert refresh.refresh_count == 2 and rebuilt.basis is refresh.basis
    assert int(rebuilt.steps_taken) == 3
    # A refresh that feeds another model leaves this one refused.
    other = DPModel.from_config(rebuilt.get_config())
    other.compile(optimizer=tf.keras.optimizers.SGD(0.3), loss=_loss())
    with pytest.raises(ValueError, match='set_basis'):
        other.fit(_poisson(steps=1), callbacks=[refresh], verbose=0)
    assert int(other.steps_taken) == 0


def test_a_hybrid_config_without_dimensions_still_needs_its_basis():
    # Without the block dimensions the event is not known: from_config of
    # such a config cannot wait for a basis.
    config = _fast(_basis()).get_config()
    config['config'] = HYBRID.to_dict()
    assert HYBRID.dimensions is None
    with pytest.raises(ValueError, match='no basis is given'):
        DPModel.from_config(config)


@pytest.mark.parametrize('path', [
    'model', pytest.param('optimizer',
                          marks=markers.needs_tf_privacy_optimizers)])
def test_a_saved_hybrid_model_reloads_awaiting_its_basis(tmp_path, path):
    # No artifact holds the basis. Keras 2's SavedModel loader revived such
    # a model as a generic one whose fit trained without DP, and .keras
    # refused to load; now both come back as a DPModel that refuses to
    # train until set_basis, with its steps and config.
    basis = _basis()
    if path == 'model':
        dp = _fast(basis, 4)
    else:
        dp = _optimizer_path(basis, seed=None)
    dp.fit(_poisson(steps=2), verbose=0)
    basis.save(str(tmp_path / 'basis.npz'))
    files = [str(tmp_path / 'model.keras')]
    dp.save(files[0])
    if markers.KERAS_MAJOR == 2:  # Keras 3 writes no SavedModel by save.
        files.append(str(tmp_path / 'saved_model'))
        dp.save(files[1], save_format='tf')
    for saved in files:
        restored = tf.keras.models.load_model(saved)
        assert isinstance(restored, DPModel), saved
        assert restored.aggregator.awaiting_basis, saved
        assert restored.config == dp.config, saved
        assert int(restored.steps_taken) == 2, saved
        weights = _weights(restored)
        with pytest.raises(ValueError, match='set_basis'):
            restored.fit(_poisson(steps=2), verbose=0)
        _assert_all_close(_weights(restored), weights)
        assert int(restored.steps_taken) == 2, saved
        restored.set_basis(
            basis_lib.HybridBasis.load(str(tmp_path / 'basis.npz')))
        assert restored.basis.structure == basis.structure, saved
        restored.fit(_poisson(steps=2), verbose=0)
        assert int(restored.steps_taken) == 4, saved
        assert not np.allclose(_weights(restored)[0], weights[0]), saved


@markers.needs_tf_privacy_optimizers
def test_dp_optimizer_config_round_trip_with_a_basis():
    basis = _basis()
    opt = optimizers.TwiceSamplingDPKerasSGDOptimizer(HYBRID, basis=basis)
    again = type(opt).from_config({**opt.get_config(), 'basis': basis})
    assert again.config == opt.config and again.basis is basis
    assert not again.aggregator.awaiting_basis


# --- accounting -------------------------------------------------------------


def _poisson(steps=3, seed=1):
    x, y = _data(NUM_EXAMPLES, seed=7)
    return sampling.poisson_batches(x, y, physical_batch_size=4,
                                    example_sampling_rate=0.25, steps=steps,
                                    seed=seed)


def _event(basis, **changes):
    fields = dict(example_sampling_rate=0.25, coordinate_sampling_rate=0.5,
                  noise_multiplier=(1.0, 2.0, 1.5),
                  l2_norm_clip=(0.5, 0.3, 0.2),
                  linf_norm_clip=(0.2, None, 0.03),
                  block_dimensions=basis.block_dimensions)
    fields.update(changes)
    return TwiceSampledGaussianDpEvent(**fields)


def test_event_and_ledger_round_trip_with_a_basis(tmp_path):
    basis = _basis()
    assert basis.block_dimensions == (3, 5, 43)
    dp = _fast(basis, 4)
    assert dp.dp_event() == _event(basis)
    path = tmp_path / 'ledger.json'
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, state_path=path,
                                     verbose=0)
    assert ledger.event == _event(basis)
    dp.fit(_poisson(), callbacks=[ledger], verbose=0)
    assert ledger.steps == 3
    state = json.loads(path.read_text())
    resumed = PrivacyLedger.from_state(state, verbose=0)
    assert resumed.event == _event(basis)
    assert resumed.epsilon == pytest.approx(ledger.epsilon, rel=1e-12)


@markers.needs_tf_privacy_optimizers
def test_optimizer_path_runs_the_same_multi_block_event():
    basis = _basis()
    model = DPModel(_mlp(), physical_batch_size=4)
    model.compile(optimizer=optimizers.TwiceSamplingDPKerasSGDOptimizer(
        HYBRID, basis=basis), loss=_loss())
    assert model.dp_event() == _event(basis)
    guards.check_ledger_event(_event(basis), model)


@pytest.mark.parametrize('changes', [
    dict(noise_multiplier=(1.0, 2.5, 1.5)),
    dict(l2_norm_clip=(0.5, 0.3, 0.25)),
    dict(linf_norm_clip=(0.1, None, 0.03)),
    dict(block_dimensions=(3, 5, 40)),
    dict(block_dimensions=None),  # Looser, but not the model's event.
    dict(noise_multiplier=1.0, l2_norm_clip=0.6, linf_norm_clip=None,
         block_dimensions=None),
])
def test_mismatched_multi_block_event_is_refused(changes):
    basis = _basis()
    dp = _fast(basis, 4)
    field, value = next(iter(changes.items()))
    with pytest.raises(ValueError,
                       match=re.escape(f'{field}={value!r}') + '.*for_model'):
        dp.fit(_poisson(), callbacks=[PrivacyLedger(_event(basis, **changes),
                                                    DELTA)], verbose=0)
    assert int(dp.optimizer.iterations) == 0


# --- the point of it: less noise at the same epsilon ------------------------


def test_public_basis_needs_less_noise_than_dp_sgd_at_equal_epsilon():
    # Gradients concentrated near a rank-8 subspace, public and private
    # drawn from the same distribution: the basis learned from public
    # gradients predicts the private ones' geometry.
    d, rank, c = 1000, 8, 1.0
    rng = np.random.default_rng(0)
    v = np.linalg.qr(rng.standard_normal((d, rank)))[0]
    mean = 0.3 * v[:, 0]

    def gradients(n):
        s = rng.standard_normal((n, rank)) * np.geomspace(1, 0.2, rank)
        return (mean + s @ v.T + 0.01 * rng.standard_normal((n, d))).astype(
            np.float32)

    public, private = gradients(200), gradients(500)
    basis = learning.learn_basis(public, [rank])
    budget = dict(target_epsilon=2.0, delta=1e-5, steps=1000,
                  example_sampling_rate=0.01, coordinate_sampling_rate=1.0)
    planned = budgets.plan_blocks(
        TwiceSamplingConfig.single(num_examples=10_000,
                                   expected_batch_size=100.0,
                                   l2_norm_clip=c),
        basis, public, target_epsilon=2.0, delta=1e-5, steps=1000)
    clips, z = planned.l2_norm_clips, planned.noise_multipliers
    hybrid_var = sum(r * (zj * cj)**2 for r, zj, cj in
                     zip(basis.block_dimensions, z, clips))
    z_std = calibrate_noise_multiplier(l2_norm_clip=c, linf_norm_clip=None,
                                       tolerance=1e-4, **budget)
    standard_var = d * (z_std * c)**2
    assert hybrid_var < 0.2 * standard_var
    ratio = hybrid_noise_variance_ratio(
        noise_multipliers=z, l2_norm_clips=clips,
        block_dimensions=basis.block_dimensions, **budget)
    assert ratio.ratio == pytest.approx(hybrid_var / standard_var, rel=1e-3)
    # ...without clipping the private signal away: the mean clipped private
    # gradient is nearly the one of plain clipping to c.
    silent = tiny_models.dp_config(l2_norm_clip=tuple(clips),
                                   noise_multiplier=(0.0, 0.0),
                                   expected_batch_size=500.0,
                                   num_examples=500)
    assert silent.non_private
    mean_hybrid = hybrid.noisy_update(
        hybrid.block_sums([private], silent, basis=basis), silent,
        basis=basis)[0].numpy()
    mean_plain = agg.clipped_masked_sum([private],
                                        l2_norm_clip=c)[0].numpy() / 500
    cosine = mean_hybrid @ mean_plain / (np.linalg.norm(mean_hybrid)
                                         * np.linalg.norm(mean_plain))
    assert cosine > 0.95


if __name__ == '__main__':
    raise SystemExit(pytest.main([__file__]))


# --- one call: plan_hybrid_clipping -----------------------------------------

_ONE_BLOCK = TwiceSamplingConfig.single(
    num_examples=NUM_EXAMPLES, expected_batch_size=6.0, l2_norm_clip=0.6,
    linf_norm_clip=0.1, coordinate_sampling_rate=0.5)


def test_plan_hybrid_clipping_is_the_three_calls_it_chains():
    x, y = _data(32, seed=1)
    budget = dict(target_epsilon=4.0, delta=DELTA, steps=50)
    plan = tf_twice_keras.plan_hybrid_clipping(
        _mlp(), _loss(), x, y, _ONE_BLOCK, ranks=RANKS, groups=GROUPS,
        seed=3, batch_size=8, budget_split='quantile', **budget)
    grads = basis_refresh.public_per_example_gradients(
        _mlp(), _loss(), x, y, batch_size=8)
    basis = learning.learn_basis(grads, RANKS, groups=GROUPS, seed=3)
    want = budgets.plan_blocks(_ONE_BLOCK, basis, grads,
                               budget_split='quantile', **budget)
    assert plan.config == want and plan.config.num_blocks == len(RANKS) + 1
    for a, b in zip(plan.basis.group_matrices, basis.group_matrices):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    # It trains as DPModel's hybrid config, and the ledger accounts it.
    dp = DPModel(_mlp(), plan.config, basis=plan.basis, physical_batch_size=8,
                 seed=SEED)
    dp.compile(optimizer=tf.keras.optimizers.SGD(0.3), loss=_loss())
    ledger = PrivacyLedger.for_model(dp, delta=DELTA, verbose=0)
    data = sampling.poisson_batches(*_data(NUM_EXAMPLES, seed=5),
                                    physical_batch_size=8,
                                    expected_batch_size=6.0, steps=2, seed=1)
    dp.fit(data, callbacks=[ledger], verbose=0)
    assert ledger.steps == 2 and ledger.epsilon < budget['target_epsilon']


@pytest.mark.parametrize('changes, match', [
    (dict(config=_params()), r'config must have one Block'),
    (dict(config='c'), r'config must be a tf_twice.TwiceSamplingConfig'),
    (dict(seed=-1), r'seed must be an integer >= 0'),
    (dict(target_epsilon=None), r'target_epsilon'),
])
def test_plan_hybrid_clipping_refusals(changes, match):
    x, y = _data(8, seed=1)
    kwargs = dict(config=_ONE_BLOCK, ranks=RANKS, target_epsilon=4.0,
                  delta=DELTA, steps=50)
    kwargs.update(changes)
    with pytest.raises(ValueError, match=match):
        tf_twice_keras.plan_hybrid_clipping(_mlp(), _loss(), x, y, **kwargs)
