"""``make_private``: model, data and config in; private model, Poisson
pipeline and ledger out, all derived from one ``TwiceSamplingConfig``.

```python
config = tf_twice.TwiceSamplingConfig.single(
    num_examples=len(x), expected_batch_size=256,
    coordinate_sampling_rate=0.5, l2_norm_clip=1.0, linf_norm_clip=0.1)
training = tf_twice.keras.make_private(
    model, config, x, y, delta=1e-5, target_epsilon=3.0, epochs=20)
training.model.compile(optimizer=tf.keras.optimizers.SGD(1.0), loss=...)
training.model.fit(training.data, epochs=training.epochs,
                   callbacks=[training.ledger])
```

Guarantee: the noise is calibrated (when the config has none) so that the
planned ``steps`` give at most ``target_epsilon`` at ``delta``; the data are
Poisson samples at the config's q1 of its n examples; the ledger's event is
the model's (``DPModel.dp_event``), it stops training after the planned
steps (``max_steps``) and before any step past ``target_epsilon``, and it
is attached to the model (``DPModel.attach_ledger``): every ``fit`` runs
with it, whether or not ``callbacks`` names it. Nothing
is described twice, so nothing can disagree.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Callable, NamedTuple, Optional, Tuple

import tensorflow as tf

from tf_twice import _validate
from tf_twice import config as config_lib
from tf_twice import sampling
from tf_twice.keras import dp_model as dp_model_lib
from tf_twice.keras import ledger as ledger_lib
from tf_twice.mechanism import basis as basis_lib

__all__ = ['PrivateTraining', 'make_private']


class PrivateTraining(NamedTuple):
    """What ``make_private`` returns (unpacks as model, data, ledger).

    Attributes:
      model: the ``DPModel`` (compile it with a plain Keras optimizer).
      data: Poisson-sampled logical batches, one epoch (1 / q1 steps) per
        iteration; every iteration draws fresh batches.
      ledger: the ``PrivacyLedger``, attached to the model: ``fit`` adds
        it to its callbacks when they hold no ledger.
      steps: the planned number of DP steps (the ledger's ``max_steps``).
      epochs: iterations of ``data`` that cover ``steps``: pass it to
        ``fit``; the ledger stops after exactly ``steps`` steps.
    """
    model: dp_model_lib.DPModel
    data: tf.data.Dataset
    ledger: ledger_lib.PrivacyLedger
    steps: int
    epochs: int


def _planned_steps(config: config_lib.TwiceSamplingConfig,
                   epochs: Optional[float], steps: Optional[int]) -> int:
    if (epochs is None) == (steps is None):
        raise ValueError('give exactly one of epochs (expected passes over '
                         'the data) and steps (DP steps); got epochs='
                         f'{epochs!r}, steps={steps!r}.')
    if steps is not None:
        return _validate.integer('steps', steps, 1)
    return config.steps_for_epochs(epochs)


def _resumed_seed(seed: int, steps: int) -> int:
    """The sampling seed of a run resumed after ``steps`` charged steps: a
    hash of both, in [0, 2**63), secret as ``seed`` is."""
    digest = hashlib.sha256(
        f'tf_twice.resumed_sampling:{int(seed)}:{int(steps)}'.encode())
    return int.from_bytes(digest.digest()[:8], 'big') >> 1


def make_private(
        model: tf.keras.Model,
        config: config_lib.TwiceSamplingConfig,
        x: Any,
        y: Any,
        *,
        delta: float,
        target_epsilon: Optional[float] = None,
        epochs: Optional[float] = None,
        steps: Optional[int] = None,
        physical_batch_size: Optional[int] = None,
        basis: Optional[basis_lib.HybridBasis] = None,
        seed: Optional[int] = None,
        data_seed: Optional[int] = None,
        preprocess_fn: Optional[Callable[[Any, Any], Tuple[Any, Any]]] = None,
        state_path: Optional[str] = None,
        log_dir: Optional[str] = None,
        verbose: int = 1,
) -> PrivateTraining:
    """Wires a private training run from one config.

    Args:
      model: the Keras model to train (no layer may mix examples).
      config: the mechanism; ``num_examples`` must be the number of
        examples in ``x``. Without noise multipliers it is calibrated to
        ``target_epsilon`` over the planned steps (one z for all blocks).
      x, y: the private training data (arrays or nests of arrays).
      delta: in (0, 1).
      target_epsilon: the budget; required when the config has no noise.
        With noise given, the planned steps must fit in it.
      epochs, steps: the plan, exactly one of them (epochs of 1 / q1 steps).
      physical_batch_size: chunk size (speed and memory only); None picks
        ``default_physical_batch_size``.
      basis: a ``HybridBasis`` from PUBLIC data for hybrid clipping (the
        config then has one Block per basis block).
      seed: of the masks and noise (experiments only; see ``DPModel``).
      data_seed: of the Poisson sampling (None: from the OS). A run
        resumed from ``state_path`` samples with a seed derived from it
        and the steps the ledger charged, so a fixed seed never replays a
        batch of the earlier run.
      preprocess_fn: per-example preprocessing of sampled batches (see
        ``tf_twice.sampling.poisson_batches``); data-independent only.
      state_path, log_dir, verbose: of the ``PrivacyLedger``.

    Returns:
      ``PrivateTraining(model, data, ledger, steps, epochs)``.

    Raises:
      ValueError: naming the argument, for inconsistent or out-of-range
        settings (n differing from the data, no noise and no target, a plan
        that the given noise cannot fit in the target).
    """
    if not isinstance(config, config_lib.TwiceSamplingConfig):
        raise ValueError('config must be a tf_twice.TwiceSamplingConfig; '
                         f'got {type(config).__name__}.')
    delta = _validate.probability('delta', delta)
    if target_epsilon is not None:
        target_epsilon = _validate.positive('target_epsilon', target_epsilon)
    if basis is not None:
        config = config.with_dimensions(basis.block_dimensions)
    steps = _planned_steps(config, epochs, steps)
    if not config.is_calibrated:
        if target_epsilon is None:
            raise ValueError('target_epsilon is required: the config has no '
                             'noise_multiplier to account.')
        config = config.calibrate(target_epsilon=target_epsilon, delta=delta,
                                  steps=steps)
    elif target_epsilon is not None:
        planned = config.epsilon(steps, delta)
        if planned > target_epsilon:
            raise ValueError(
                f'The config\'s noise gives epsilon {planned:.4g} after the '
                f'planned {steps} steps, above target_epsilon='
                f'{target_epsilon}: plan fewer steps, or leave '
                'noise_multiplier unset to calibrate it.')
    private = dp_model_lib.DPModel(model, config,
                                   physical_batch_size=physical_batch_size,
                                   seed=seed, basis=basis)
    ledger = ledger_lib.PrivacyLedger.for_model(
        private, delta=delta, target_epsilon=target_epsilon,
        max_steps=steps, state_path=state_path, log_dir=log_dir,
        verbose=verbose)
    # Every fit of the model accounts with this ledger, passed in
    # callbacks or not: a forgotten ledger must not overrun the plan.
    private.attach_ledger(ledger)
    # A run resumed from the ledger's state file samples from another
    # stream (the seed mixed with the steps charged), starting after those
    # steps: with the same data_seed, no logical batch of the earlier run
    # is drawn again, also if it made more iterators than it trained on.
    if data_seed is not None and ledger.steps:
        data_seed = _resumed_seed(data_seed, ledger.steps)
    data = sampling.poisson_batches(
        x, y, expected_batch_size=config.expected_batch_size, seed=data_seed,
        start_step=ledger.steps, preprocess_fn=preprocess_fn)
    info = sampling.get_poisson_sampling_info(data)
    if info.num_examples != config.num_examples:
        raise ValueError(
            f'config.num_examples is {config.num_examples} but x and y hold '
            f'{info.num_examples} examples.')
    return PrivateTraining(private, data, ledger, steps,
                           math.ceil(steps / config.steps_per_epoch))
