"""Choosing a hybrid plan by the public one-step progress of its update.

What ``plan_blocks`` optimises (noise variance, the cosine of the noisy
clipped mean) did not predict the loss decrease of a step: a plan can put
noise or mask variance into the few directions that carry the gradient
(docs/hybrid_clipping.md). ``public_progress`` measures what a plan's
private update does to the loss, on PUBLIC data only:

1. the public examples are split by a seeded permutation: one half gives
   per-example gradients at the model's weights, the other the loss;
2. each draw Poisson-samples the first half at expected batch b = min(B,
   half / 2) and privatises it with the plan's own step
   (``tf_twice.hybrid.staged_updates``, all stages), every block's noise
   multiplier scaled by b / B so that the update's noise has the standard
   deviation of a real step's (z_j c2_j / (B q2_j)); the masks' variance is
   that of b examples, more than a real batch's when b < B;
3. the update is applied for one SGD step at ``learning_rate`` and the
   decrease of the second half's mean loss is recorded; the weights are
   restored.

``choose_plan`` scores candidates on the same batches and keys and returns
the best; the model's variables are restored. Only public data, the weights
and a seed are read, so choosing costs no privacy, and the run's epsilon is
that of the chosen config, which the ledger charges. ``choose_plan`` does
not check that the candidates meet one budget: give it candidates
calibrated for the same target (the training script's
``--plan_by_progress`` does, and is refused with a fixed
``--noise_multiplier``, where another keep rate is another epsilon). The
simulated noise is not DP noise: nothing here is released.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Tuple

import attr
import numpy as np
import tensorflow as tf

from tf_twice import _validate
from tf_twice import config as config_lib
from tf_twice.hybrid import stages
from tf_twice.keras import basis_refresh
from tf_twice.keras import per_example
from tf_twice.mechanism import basis as basis_lib
from tf_twice.mechanism import randomness

__all__ = ['Progress', 'choose_plan', 'public_progress']

Candidate = Tuple[config_lib.TwiceSamplingConfig,
                  Optional[basis_lib.HybridBasis]]


class Progress(NamedTuple):
    """Public one-step loss decreases of one plan, one per draw."""
    decreases: Tuple[float, ...]

    @property
    def mean(self) -> float:
        return float(np.mean(self.decreases))

    @property
    def standard_error(self) -> float:
        return float(np.std(self.decreases, ddof=1)
                     / math.sqrt(len(self.decreases)))


def _public_batch_config(config: config_lib.TwiceSamplingConfig,
                         examples: int) -> config_lib.TwiceSamplingConfig:
    """Step 2's config: a Poisson batch of ``examples`` public gradients at
    expected size b, noise std per update as the real step's."""
    b = min(config.expected_batch_size, examples / 2)
    ratio = b / config.expected_batch_size
    return attr.evolve(
        config, num_examples=examples, expected_batch_size=b,
        non_private=True,
        blocks=tuple(attr.evolve(block,
                                 noise_multiplier=block.noise_multiplier
                                 * ratio) for block in config.blocks))


def choose_plan(model: tf.keras.Model, loss: Any, public_x: Any,
                public_y: Any, candidates: Mapping[str, Candidate], *,
                learning_rate: float, draws: int = 8, seed: int = 0,
                batch_size: int = 256
                ) -> Tuple[str, Dict[str, Progress]]:
    """The candidate whose private update decreases the public loss most.

    Args:
      model: the Keras model at the weights the plan is for.
      loss: the per-example loss, as ``DPModel`` reads it.
      public_x, public_y: PUBLIC examples (at least 4).
      candidates: {name: (config, basis)}; every config calibrated (its
        noise is simulated), basis None for a one-block config. The run's
        epsilon is the chosen config's: calibrate them all for one target.
      learning_rate: of the one SGD step.
      draws: batches per candidate (>= 2), the same for all of them.
      seed: of the split, the batches, the masks and the simulated noise.
      batch_size: examples per vectorised chunk of the gradients and loss.

    Returns:
      (the best name, {name: Progress}).
    """
    if not candidates:
        raise ValueError('candidates must name at least one plan.')
    draws = _validate.integer('draws', draws, 2)
    learning_rate = _validate.positive('learning_rate', learning_rate)
    for name, (config, _) in candidates.items():
        if not config.is_calibrated or config.non_private:
            raise ValueError(f'candidates[{name!r}] must be a calibrated, '
                             'private config.')
    x = tf.nest.map_structure(np.asarray, public_x)
    y = np.asarray(public_y)
    n = len(y)
    if n < 4:
        raise ValueError(f'public_x must hold at least 4 examples; got {n}.')
    order = np.random.default_rng(seed).permutation(n)
    take = lambda rows: (tf.nest.map_structure(lambda a: a[rows], x),
                         y[rows])
    grad_x, grad_y = take(order[:n // 2])
    eval_x, eval_y = take(order[n // 2:])
    if not model.built:
        per_example.build(model, tf.nest.map_structure(tf.convert_to_tensor,
                                                       grad_x))
    # Every variable is restored at the end: the gradients' forward pass in
    # training mode may move others (a random generator's state).
    everything = [(v, v.numpy()) for v in model.variables]
    example_loss = per_example.loss_fn(loss)
    variables = model.trainable_variables
    start = [v.numpy() for v in variables]

    def mean_loss() -> float:
        total = 0.0
        for i in range(0, len(eval_y), batch_size):
            xb = tf.nest.map_structure(lambda a: a[i:i + batch_size],
                                       eval_x)
            total += float(tf.reduce_sum(example_loss(
                tf.convert_to_tensor(eval_y[i:i + batch_size]),
                model(xb, training=False))))
        return total / len(eval_y)

    scores: Dict[str, List[float]] = {name: [] for name in candidates}
    rng = np.random.default_rng([seed, 1])
    try:
        gradients = basis_refresh.public_per_example_gradients(
            model, loss, grad_x, grad_y, batch_size=batch_size)
        before = mean_loss()
        for draw in range(draws):
            key = randomness.draw_step_key(
                tf.random.Generator.from_seed(seed * 7919 + draw))
            uniforms = rng.random(n // 2)
            for name, (config, basis) in candidates.items():
                public = _public_batch_config(config, n // 2)
                rows = np.flatnonzero(
                    uniforms < public.example_sampling_rate)
                update = stages.staged_updates(
                    [g[rows] for g in gradients], public, key=key,
                    basis=basis, stages=['noise'])['noise']
                for v, w, u in zip(variables, start, update):
                    v.assign(w - learning_rate * u.numpy().astype(w.dtype))
                scores[name].append(before - mean_loss())
    finally:
        for v, w in everything:
            v.assign(w)
    progress = {name: Progress(tuple(s)) for name, s in scores.items()}
    best = max(progress, key=lambda name: progress[name].mean)
    return best, progress


def public_progress(model: tf.keras.Model, loss: Any, public_x: Any,
                    public_y: Any, config: config_lib.TwiceSamplingConfig,
                    *, basis: Optional[basis_lib.HybridBasis] = None,
                    **kwargs) -> Progress:
    """``choose_plan``'s score of one plan (same arguments)."""
    _, progress = choose_plan(model, loss, public_x, public_y,
                              {'plan': (config, basis)}, **kwargs)
    return progress['plan']
