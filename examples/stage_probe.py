r"""Where does a mechanism lose? One-step progress after clip, masks, noise.

At the weights of a reference run (`--reference_mode`, DP-SGD by default,
trained by the training script for each of `--probe_steps` steps), every row
of the accuracy study (its flags: `--rows` and the mechanism settings, the
first of `--seeds` and of `--target_epsilons`) privatises the
same `--draws` fresh Poisson batches of the private set in three stages
(`tf_twice.hybrid.stages`, the library's own step with one key per batch):

* clip: the row's clips, no masks, no noise (its clipped mean);
* masks: + its coordinate masks (unbiased, so they cost variance only);
* noise: + its DP noise, calibrated for the target epsilon after the run's
  planned steps: the update a private step releases.

Each update is applied for one plain SGD step at `--learning_rate` and the
script prints the decrease of the mean training loss on `--eval_examples`
private examples after the clip stage, what the masks and the noise each
take from it (paired differences: same batch, same key) and the decrease
of the private update (means and standard errors over the draws, in units
of 1e-3). The stage after which the decrease falls is where a mechanism loses:
masks on hybrid clipping's principal coefficients were found this way
(docs/hybrid_clipping.md). Hybrid rows plan their basis and budgets from the
PUBLIC split at the probed weights (what `--replan_budgets` does at a basis
refresh). The table is computed from private examples, two of its stages
without noise: it is NOT differentially private (keep it as private as the
data). No model, checkpoint or ledger leaves the probe.

Run (digits, about a minute):
  python examples/stage_probe.py --target_epsilons=3 --probe_steps=0,20 \
    --rows='dpsgd q=q1,twice,hybrid,hybrid unmasked'
Fashion-MNIST, ScatterNet + linear, the hybrid study's setting:
  python examples/stage_probe.py --dataset=fashion_mnist \
    --features=scattering --public_examples=2000 --batch_size=2048 \
    --epochs=80 --learning_rate=4 --target_epsilons=3 --probe_steps=0,200 \
    --rows='dpsgd q=q1,twice,hybrid,hybrid unmasked'
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
from typing import Any, Dict, List, Sequence, Tuple

if __package__ in (None, ''):
    sys.path.insert(0, os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags
import numpy as np
import tensorflow as tf

from examples import accuracy_study as study
from examples.training import console
from examples.training import data as data_lib
from examples.training import modeling
from examples.training import plan as plan_lib
from examples.training import runner
from examples.training import settings
from tf_twice.hybrid import stages
from tf_twice.keras import basis_refresh
from tf_twice.mechanism import randomness
# pylint: enable=g-import-not-at-top,wrong-import-position

# Decreases: {row: {stage: [one per draw]}}.
Decreases = Dict[str, Dict[str, List[float]]]


def reference_model(common: Dict[str, Any], steps: int, data
                    ) -> tf.keras.Model:
    """The inner model after the first `steps` steps of the reference run
    (the training script's run, ledger and all; 0: the initial weights)."""
    run = runner.build_run(common, data)
    if steps:
        runner.fit(run, stop_after=steps)
    return run.inner_model


def row_mechanism(common: Dict[str, Any], overrides: Dict[str, Any], data,
                  model: tf.keras.Model):
    """(config, basis) of one row, hybrid rows planned at `model`'s weights
    from the public split, exactly as the training script plans them."""
    config = settings.check_config(settings.TrainConfig.from_object(
        dict(common, **overrides)))
    plan = plan_lib.resolve_plan(config, len(data.x_train))
    basis = None
    if config.mode == 'hybrid':
        plan, basis = plan_lib.hybrid_setup(config, plan, data, model, None)
    return plan.mechanism, basis


def probe(model: tf.keras.Model, mechanisms: Dict[str, Tuple[Any, Any]],
          data, *, learning_rate: float, draws: int, eval_examples: int,
          seed: int, physical_batch_size: int) -> Decreases:
    """One-step loss decreases of every row's staged updates (module doc).

    Every row samples its Poisson batch from the same uniforms per draw
    (rows at one rate see one batch; a lower rate, a subset of it) and uses
    the same key."""
    rng = np.random.default_rng(seed)
    n = len(data.x_train)
    held = rng.choice(n, size=min(eval_examples, n), replace=False)
    x_eval = data_lib.to_unit_float(data.x_train[held])
    y_eval = data.y_train[held]
    mean_loss = modeling.loss()
    variables = model.trainable_variables
    start = [v.numpy() for v in variables]

    def loss_after(update) -> float:
        """The loss one step from the probed weights, which it restores:
        the next batch's gradients are taken there."""
        for v, w, u in zip(variables, start, update):
            v.assign(w - learning_rate * u.numpy().astype(w.dtype))
        loss = float(mean_loss(y_eval, model.predict(x_eval, verbose=0)))
        for v, w in zip(variables, start):
            v.assign(w)
        return loss

    before = loss_after([tf.zeros_like(w) for w in start])
    out: Decreases = {row: {s: [] for s in stages.STAGES}
                      for row in mechanisms}
    for draw in range(draws):
        key = randomness.draw_step_key(
            tf.random.Generator.from_seed(seed * 1000 + draw))
        uniforms = rng.random(n)
        batches: Dict[Tuple[int, ...], List[np.ndarray]] = {}
        for row, (config, basis) in mechanisms.items():
            # A Poisson batch at the row's rate, as the step samples.
            chosen = np.flatnonzero(uniforms < config.example_sampling_rate)
            if tuple(chosen) not in batches:
                batches[tuple(chosen)] = (
                    basis_refresh.public_per_example_gradients(
                        model, modeling.per_example_loss(),
                        data_lib.to_unit_float(data.x_train[chosen]),
                        data.y_train[chosen],
                        batch_size=physical_batch_size))
            updates = stages.staged_updates(batches[tuple(chosen)], config,
                                            key=key, basis=basis)
            for stage, update in updates.items():
                out[row][stage].append(before - loss_after(update))
    return out


def markdown_table(decreases: Decreases, mechanisms) -> str:
    """Per row: the clip stage's decrease, what masks and noise each take
    from it (paired: same batch and key), and the private update's."""
    def cell(values):
        mean = statistics.fmean(values) * 1e3
        sem = statistics.stdev(values) / len(values) ** 0.5 * 1e3
        return f'{mean:.2f} ± {sem:.2f}'

    def lost(a, b):
        return cell([x - y for x, y in zip(a, b)])

    lines = ['| row | noise multiplier(s) | clip | lost to masks | '
             'lost to noise | private update |', '|---|---|---|---|---|---|']
    for row, d in decreases.items():
        noise = ', '.join(f'{z:.3g}' for z in mechanisms[row][0]
                          .noise_multipliers)
        lines.append(
            f"| {row} | {noise} | {cell(d['clip'])} | "
            f"{lost(d['clip'], d['masks'])} | "
            f"{lost(d['masks'], d['noise'])} | {cell(d['noise'])} |")
    return '\n'.join(lines)


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """The accuracy study's flags (rows, data, model, mechanism settings;
    the first of --seeds and of --target_epsilons) and the probe's own."""
    study.define_flags(flag_values)
    fv = dict(flag_values=flag_values)
    flags.DEFINE_enum('reference_mode', 'dpsgd', ['dpsgd', 'twice', 'hybrid',
                                                  'nonprivate'],
                      'Mode of the run whose weights are probed.', **fv)
    flags.DEFINE_list('probe_steps', ['0', '100'], "Steps of the reference "
                      'run at which to probe.', **fv)
    flags.DEFINE_integer('draws', 4, 'Batches per probe.', **fv)
    flags.DEFINE_integer('eval_examples', 4096, 'Private examples whose mean '
                         'loss measures progress.', **fv)


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    console.quiet_known_noise()
    run_probes(flags.FLAGS)


def run_probes(f) -> Dict[int, Decreases]:
    """Probes at every --probe_steps; prints and returns the decreases."""
    for name in ('draws', 'eval_examples'):
        if getattr(f, name) < 2:
            raise app.UsageError(f'--{name} must be >= 2; got '
                                 f'{getattr(f, name)}.')
    try:
        probe_steps = sorted({int(s) for s in f.probe_steps})
        if probe_steps[0] < 0:
            raise ValueError('--probe_steps must be >= 0.')
    except ValueError as e:
        raise app.UsageError(f'--probe_steps: {e}') from e
    try:
        seed, target = int(f.seeds[0]), float(f.target_epsilons[0])
        common = settings.check_config(settings.TrainConfig.from_object(dict(
            dataset=f.dataset, data_dir=f.data_dir, features=f.features,
            model=f.model, mode=f.reference_mode, batch_size=f.batch_size,
            epochs=f.epochs, steps=f.steps, learning_rate=f.learning_rate,
            momentum=f.momentum, l2_norm_clip=f.l2_norm_clip,
            physical_batch_size=f.physical_batch_size, target_epsilon=target,
            public_examples=f.public_examples, seed=seed, verbose=0)))
    except ValueError as e:
        raise app.UsageError(str(e)) from e
    data = data_lib.load_data(f.dataset, data_dir=f.data_dir,
                              features=f.features,
                              public_examples=f.public_examples)
    reference = plan_lib.resolve_plan(common, len(data.x_train))
    rows = study.rows_from_flags(f, reference.mechanism.expected_batch_size)
    # Every row calibrates for the reference run's planned steps.
    shared = dict(dataclasses.asdict(common),
                  steps=reference.planned_steps, epochs=None)

    results = {}
    for steps in probe_steps:
        model = reference_model(shared, steps, data)
        mechanisms = {row: row_mechanism(shared, overrides, data, model)
                      for row, overrides in rows.items()}
        results[steps] = probe(
            model, mechanisms, data, learning_rate=common.learning_rate,
            draws=f.draws, eval_examples=f.eval_examples, seed=seed,
            physical_batch_size=common.physical_batch_size)
        print()
        print(f'Not DP (private examples, noise-free stages). After {steps} '
              f'steps of {f.reference_mode} (of '
              f'{reference.planned_steps} planned): one-step decrease of the '
              f'training loss x 1e3, learning rate {common.learning_rate:g}, '
              f'{f.draws} batches of expected size '
              f'{reference.mechanism.expected_batch_size:g}, epsilon '
              f'{target:g}:')
        print()
        print(markdown_table(results[steps], mechanisms))
    return results


if __name__ == '__main__':
    define_flags()
    app.run(main)
