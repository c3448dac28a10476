"""A white-box canary audit of one DP step: an empirical epsilon LOWER bound.

An accountant gives an upper bound: if the implementation is the mechanism it
claims to be, no test can tell a dataset D from D plus one record better than
(epsilon, delta) allows. An audit checks this from the other side
(Jagielski et al. 2020, "Auditing Differentially Private Machine Learning:
How Private is Private SGD?", arXiv:2006.07709; Nasr et al. 2021,
"Adversary Instantiation: Lower Bounds for Differentially Private Machine
Learning", arXiv:2101.04535; Nasr et al. 2023, "Tight Auditing of
Differentially Private Machine Learning", arXiv:2302.07956): run the real
step many times on D (world 0) and on D plus a canary (world 1), score each
released update, and turn the error rates of the test "score > threshold
means world 1" into a bound on epsilon.

For (epsilon, delta)-DP and any test with false-positive rate FPR and
false-negative rate FNR (Kairouz et al. 2015, arXiv:1311.0776, Thm. 2.1):

    FPR + e^epsilon FNR >= 1 - delta  and  FNR + e^epsilon FPR >= 1 - delta,

so epsilon >= max(log((1 - delta - FNR) / FPR), log((1 - delta - FPR) / FNR)).
With FPR and FNR replaced by one-sided Clopper-Pearson upper bounds (each at
level alpha / 2, alpha = 1 - confidence), ``epsilon_lower_bound`` holds with
probability at least ``confidence`` over the trials. The threshold is chosen
on a separate set of trials, so it needs no multiple-testing correction.

What the bound means: with probability >= ``confidence``, every (epsilon',
delta)-DP guarantee of this step has epsilon' >= ``epsilon_lower_bound``. It
comes from finitely many trials and one canary, so it can only refute a
claimed guarantee (a bound above the accountant's epsilon means the step
leaks more than accounted, e.g. less noise than claimed); a bound below it
proves nothing. Its largest possible value is about
log(num_evaluation_trials) (no test can certify a false-positive rate much
below 1 / trials).

The audit is white-box: the adversary sees the update of one step and knows
the canary. A canary whose gradient is large (clipped to exactly c2) and
lies on coordinates no other record touches realises the accountant's worst
case (e.g. a linear model at zero weights with the squared loss, and a
canary with a large target whose input has d0 = (c2 / c_inf)^2 non-zero
entries), which makes the audit tight up to the number of trials and the
linear score. The steps run through the model's own ``train_step``; the
weights and the optimizer state are restored before every trial (the random
generator is not, so every trial draws fresh masks and noise) and after the
audit. No ledger is charged: the weights keep nothing of the trials, but the
result depends on the records used, so audit with public or synthetic
records.
"""

import dataclasses
import math
from typing import Any, Optional, Sequence, Tuple

import numpy as np
from scipy import stats
import tensorflow as tf

from tf_twice import _keras  # noqa: F401  pylint: disable=unused-import
from tf_twice import _validate
from tf_twice.accounting import TwiceSamplingRdpAccountant

__all__ = [
    'AuditResult',
    'audit_one_step',
    'clopper_pearson_upper',
    'epsilon_lower_bound',
    'select_threshold',
]


@dataclasses.dataclass(frozen=True)
class AuditResult:
    """The outcome of ``audit_one_step``.

    Attributes:
      epsilon_lower_bound: >= 0; with probability >= ``confidence`` the
        audited step is not (epsilon', delta)-DP for any epsilon' below it.
      delta: the delta of the bound (and of ``accountant_epsilon``).
      confidence: 1 - alpha of the Clopper-Pearson intervals (both rates).
      num_trials: trials per world (with and without the canary), selection
        and evaluation together.
      num_evaluation_trials: trials per world that estimate the error rates.
      threshold: the score above which the test says "canary".
      false_positive_rate: observed on the evaluation trials of world 0.
      false_negative_rate: observed on the evaluation trials of world 1.
      false_positive_rate_upper: its Clopper-Pearson upper bound.
      false_negative_rate_upper: its Clopper-Pearson upper bound.
      accountant_epsilon: the accountant's epsilon at ``delta`` for one step
        of the claimed event (the model's ``dp_event`` unless another was
        given).
    """
    epsilon_lower_bound: float
    delta: float
    confidence: float
    num_trials: int
    num_evaluation_trials: int
    threshold: float
    false_positive_rate: float
    false_negative_rate: float
    false_positive_rate_upper: float
    false_negative_rate_upper: float
    accountant_epsilon: float

    @property
    def refutes_accountant(self) -> bool:
        """True if the audit shows more leakage than the accountant allows."""
        return self.epsilon_lower_bound > self.accountant_epsilon


def clopper_pearson_upper(successes: int, trials: int,
                          alpha: float) -> float:
    """One-sided (1 - alpha) Clopper-Pearson upper bound of a binomial rate."""
    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(f'need 0 <= successes <= trials and trials >= 1; '
                         f'got {successes} of {trials}.')
    if successes == trials:
        return 1.0
    return float(stats.beta.ppf(1.0 - alpha, successes + 1,
                                trials - successes))


def _bounds(fpr_upper, fnr_upper, delta):
    """The two hypothesis-testing bounds of (epsilon, delta)-DP, elementwise.

    epsilon >= log((1 - delta - FNR) / FPR) and log((1 - delta - FPR) / FNR)
    (Kairouz et al. 2015, Thm. 2.1; Jagielski et al. 2020, Sec. 3; Nasr et
    al. 2021, Eq. 1), with the rates at their upper confidence bounds.
    """
    fpr_upper = np.asarray(fpr_upper, np.float64)
    fnr_upper = np.asarray(fnr_upper, np.float64)
    with np.errstate(divide='ignore', invalid='ignore'):
        first = np.log(np.maximum(1.0 - delta - fnr_upper, 0.0) / fpr_upper)
        second = np.log(np.maximum(1.0 - delta - fpr_upper, 0.0) / fnr_upper)
    return np.maximum(np.maximum(first, second), 0.0)


def epsilon_lower_bound(false_positives: int, negatives: int,
                        false_negatives: int, positives: int, *,
                        delta: float, confidence: float = 0.95) -> float:
    """The epsilon lower bound of one test from its error counts.

    Args:
      false_positives: world-0 trials (no canary) that the test called 1.
      negatives: world-0 trials.
      false_negatives: world-1 trials (with the canary) that it called 0.
      positives: world-1 trials.
      delta: in [0, 1).
      confidence: in (0, 1); each rate gets a one-sided Clopper-Pearson bound
        at level (1 - confidence) / 2, so both hold together with
        probability >= confidence.

    Returns:
      max(0, log((1 - delta - FNR_u) / FPR_u), log((1 - delta - FPR_u) /
      FNR_u)) with FPR_u, FNR_u the upper bounds.
    """
    _check_delta_confidence(delta, confidence)
    alpha = (1.0 - confidence) / 2.0
    return float(_bounds(
        clopper_pearson_upper(false_positives, negatives, alpha),
        clopper_pearson_upper(false_negatives, positives, alpha), delta))


def _error_counts(scores_without: np.ndarray, scores_with: np.ndarray,
                  thresholds: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """False positives (#world-0 > t) and negatives (#world-1 <= t)."""
    without = np.sort(scores_without)
    with_ = np.sort(scores_with)
    false_positives = without.size - np.searchsorted(without, thresholds,
                                                     side='right')
    false_negatives = np.searchsorted(with_, thresholds, side='right')
    return false_positives, false_negatives


def select_threshold(scores_without: Sequence[float],
                     scores_with: Sequence[float], *, delta: float,
                     confidence: float = 0.95) -> float:
    """The threshold whose bound is largest on these (selection) scores.

    Every observed score is a candidate. Scoring candidates by their
    Clopper-Pearson bound rather than by raw rates avoids thresholds that
    look good only because they see no false positive by chance. Evaluate
    the chosen threshold on OTHER trials: on these it is biased upwards.
    """
    _check_delta_confidence(delta, confidence)
    without = np.asarray(scores_without, np.float64).ravel()
    with_ = np.asarray(scores_with, np.float64).ravel()
    if without.size < 1 or with_.size < 1:
        raise ValueError('select_threshold needs scores of both worlds.')
    candidates = np.unique(np.concatenate([without, with_]))
    false_positives, false_negatives = _error_counts(without, with_,
                                                     candidates)
    alpha = (1.0 - confidence) / 2.0
    # Vectorised Clopper-Pearson upper bounds (rate 1 where all trials err).
    fpr_upper = np.where(
        false_positives >= without.size, 1.0,
        stats.beta.ppf(1.0 - alpha, false_positives + 1,
                       np.maximum(without.size - false_positives, 1)))
    fnr_upper = np.where(
        false_negatives >= with_.size, 1.0,
        stats.beta.ppf(1.0 - alpha, false_negatives + 1,
                       np.maximum(with_.size - false_negatives, 1)))
    return float(candidates[int(np.argmax(
        _bounds(fpr_upper, fnr_upper, delta)))])


def _check_delta_confidence(delta: float, confidence: float) -> None:
    # delta = 0 is allowed here: a lower bound on pure-DP epsilon.
    if _validate.real('delta', delta) != 0.0:
        _validate.probability('delta', delta)
    _validate.probability('confidence', confidence)


def _optimizer_variables(optimizer) -> list:
    variables = getattr(optimizer, 'variables', [])
    return list(variables() if callable(variables) else variables)


def _accountant_epsilon(event, delta: float) -> float:
    accountant = TwiceSamplingRdpAccountant()
    accountant.compose(event)
    return float(accountant.get_epsilon(delta))


def _one_example_batch(t) -> tf.Tensor:
    return tf.expand_dims(tf.convert_to_tensor(t), 0)


def audit_one_step(model: tf.keras.Model,
                   canary: Tuple[Any, Any],
                   *,
                   num_trials: int,
                   delta: float,
                   background: Optional[Tuple[Any, Any]] = None,
                   direction: Optional[Sequence[Any]] = None,
                   claimed_event=None,
                   confidence: float = 0.95,
                   selection_fraction: float = 0.3,
                   seed: Optional[int] = None) -> AuditResult:
    """Audits one ``train_step`` of a compiled ``DPModel`` with a canary.

    World 0 runs the step on the background records D, world 1 on D plus
    the canary; every record of a world (the canary too) joins the logical
    batch independently with probability q1 = expected_batch_size / n (the
    model config's; a record that does not join has sample_weight 0), as
    Poisson sampling of a dataset of n records does. The score
    of a trial is the projection of the weight change w_before - w_after on
    ``direction``; larger scores mean "canary". The first
    ``selection_fraction`` of each world's trials chooses the threshold
    (``select_threshold``), the rest estimate its error rates.

    Args:
      model: a compiled ``tf_twice.keras.DPModel`` (or a model with the same
        ``train_step(data)`` and ``dp_event()`` API). Its weights and
        optimizer state are restored afterwards; its random generator
        advances.
      canary: ``(x, y)`` of ONE record, without a batch dimension.
      num_trials: trials per world, >= 2 (a few thousand bound epsilon up to
        about log(num_trials)).
      delta: the delta of the bound and of the accountant's epsilon.
      background: ``(x, y)`` of the other records D (leading batch
        dimension), or None for D empty (the cleanest audit: the update is
        then the canary's masked clipped gradient plus noise).
      direction: one array per trainable variable; default: the canary's
        loss gradient at the current weights (its clipped contribution
        points there when no other record shares its coordinates).
      claimed_event: the DpEvent whose one-step epsilon is reported as
        ``accountant_epsilon``; default ``model.dp_event()``.
      confidence: of the bound, in (0, 1).
      selection_fraction: share of the trials that choose the threshold, in
        (0, 1).
      seed: of the record sampling (numpy); the model's own ``seed`` sets
        its masks and noise. None: OS entropy.

    Returns:
      An ``AuditResult``.

    Raises:
      ValueError: an argument outside its range, an uncompiled model, or a
        zero direction.
    """
    _check_delta_confidence(delta, confidence)
    num_trials = _validate.integer('num_trials', num_trials, 2)
    _validate.probability('selection_fraction', selection_fraction)
    num_selection = min(max(int(round(selection_fraction * num_trials)), 1),
                        num_trials - 1)
    if getattr(model, 'optimizer', None) is None:
        raise ValueError('audit_one_step needs a compiled model.')
    event = model.dp_event()
    q1 = float(event.example_sampling_rate)
    if claimed_event is None:
        claimed_event = event

    canary_x = tf.nest.map_structure(_one_example_batch, canary[0])
    canary_y = _one_example_batch(canary[1])
    if background is None:
        x, y = canary_x, canary_y
    else:
        x = tf.nest.map_structure(
            lambda b, c: tf.concat([tf.convert_to_tensor(b, c.dtype), c], 0),
            background[0], canary_x)
        y = tf.concat([tf.convert_to_tensor(background[1], canary_y.dtype),
                       canary_y], 0)
    num_rows = int(y.shape[0])

    # Build the model and the optimizer first, so that the saved state is
    # the state before any step; then one warm-up step creates whatever else
    # a step needs (metrics, lazily created optimizer slots) outside the trial
    # loop, where no variable may be created.
    model(x, training=False)
    variables = list(model.trainable_variables)
    optimizer = model.optimizer
    if callable(getattr(optimizer, 'build', None)):
        optimizer.build(variables)
    # A DPModel's record of the steps its weights hold is restored with
    # them: a ledger then sees no trial step.
    record = getattr(model, 'privacy_record', None)
    counters = [] if record is None else [record]
    before = {id(v): v.numpy() for v in
              variables + _optimizer_variables(optimizer) + counters}
    tf.function(model.train_step)((x, y, tf.zeros([num_rows], tf.float32)))
    state = variables + _optimizer_variables(optimizer) + counters
    # A variable the warm-up created starts every trial from its value
    # after the warm-up.
    initial = [before.get(id(v), v.numpy()) for v in state]

    try:
        for v, value in zip(state, initial):
            v.assign(value)
        saved = [tf.constant(value) for value in initial]
        if direction is None:
            # A DPModel's own call passes no gradient to its weights.
            forward = getattr(model, 'inner_model', model)
            with tf.GradientTape() as tape:
                prediction = forward(canary_x, training=True)
                loss = model.compute_loss(x=canary_x, y=canary_y,
                                          y_pred=prediction)
            direction = tape.gradient(
                loss, variables,
                unconnected_gradients=tf.UnconnectedGradients.ZERO)
        if len(direction) != len(variables):
            raise ValueError(f'direction needs one array per trainable '
                             f'variable ({len(variables)}); got '
                             f'{len(direction)}.')
        direction = [tf.cast(tf.convert_to_tensor(d), v.dtype)
                     for d, v in zip(direction, variables)]
        norm = math.sqrt(sum(float(tf.reduce_sum(tf.square(d)))
                             for d in direction))
        if not norm > 0 or not math.isfinite(norm):
            raise ValueError('the audit direction (default: the canary\'s '
                             'gradient) must be finite and non-zero.')
        direction = [d / norm for d in direction]

        @tf.function
        def run_trials(weights):
            count = tf.shape(weights)[0]

            def body(i, scores):
                for v, s in zip(state, saved):
                    v.assign(s)
                model.train_step((x, y, weights[i]))
                score = tf.add_n([
                    tf.reduce_sum(tf.cast((s - v) * d, tf.float64))
                    for v, s, d in zip(variables, saved[:len(variables)],
                                       direction)])
                return i + 1, scores.write(i, score)

            _, scores = tf.while_loop(
                lambda i, _: i < count, body,
                (tf.constant(0), tf.TensorArray(tf.float64, size=count)),
                parallel_iterations=1)
            return scores.stack()

        rng = np.random.default_rng(seed)
        scores = []
        for world in (0, 1):
            joins = rng.random((num_trials, num_rows)) < q1
            # The canary is the last row: absent in world 0.
            joins[:, -1] &= bool(world)
            scores.append(run_trials(
                tf.constant(joins.astype(np.float32))).numpy())
    finally:
        for v, value in zip(state, initial):
            v.assign(value)

    without, with_ = scores
    threshold = select_threshold(without[:num_selection],
                                 with_[:num_selection], delta=delta,
                                 confidence=confidence)
    evaluation = num_trials - num_selection
    fp, fn = _error_counts(without[num_selection:], with_[num_selection:],
                           np.array([threshold]))
    fp, fn = int(fp[0]), int(fn[0])
    alpha = (1.0 - confidence) / 2.0
    return AuditResult(
        epsilon_lower_bound=epsilon_lower_bound(
            fp, evaluation, fn, evaluation, delta=delta,
            confidence=confidence),
        delta=delta,
        confidence=confidence,
        num_trials=num_trials,
        num_evaluation_trials=evaluation,
        threshold=threshold,
        false_positive_rate=fp / evaluation,
        false_negative_rate=fn / evaluation,
        false_positive_rate_upper=clopper_pearson_upper(fp, evaluation,
                                                        alpha),
        false_negative_rate_upper=clopper_pearson_upper(fn, evaluation,
                                                        alpha),
        accountant_epsilon=_accountant_epsilon(claimed_event, delta))
