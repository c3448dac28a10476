"""What ``DPModel.fit`` refuses before any step runs, in the order it runs.

``DPModel.fit``'s docstring states the contract (Poisson input from the
config's n at its q1, the ledger's event, no callback acting on a
``nonprivate_*`` log). ``check_fit`` runs those refusals and the ones that
need no ledger: steps on input not known to be Poisson-sampled, run without
a ledger, are marked in the weights' record so that no ledger accounts
them later (and warned about, unless the config is non-private); a
multi-worker dataset that would sum an example once per
worker, weights outside [0, 1], and layers that write statistics of their
inputs into their state. The checks themselves live in ``guards``,
``per_example`` and ``layer_state``; this module is the one place that
composes them for ``fit``. First of all, a hybrid mechanism rebuilt from
a model artifact must have its basis back (``set_basis``, or a
``BasisRefresh`` callback before the first step).
"""

import logging
import warnings
from typing import Any, Mapping, Sequence

import tensorflow as tf

from tf_twice.keras import basis_refresh
from tf_twice.keras import class_weights
from tf_twice.keras import guards
from tf_twice.keras import layer_state
from tf_twice.keras import ledger as ledger_lib
from tf_twice.keras import per_example

__all__ = ['check_batches_fit_model', 'check_fit', 'end_fit',
           'prepared_input', 'with_attached_ledger']

_LOGGER = logging.getLogger(__name__)


def with_attached_ledger(model: Any, callbacks: Any) -> Any:
    """``fit``'s callbacks with ``model.attached_ledger`` first where they
    hold no ledger (so that every callback after it sees
    ``logs['epsilon']``).

    Raises:
      ValueError: the callbacks hold a ledger other than the attached one,
        which would leave the attached ledger's budget and plan unenforced.
    """
    attached = model.attached_ledger
    if attached is None:
        return callbacks
    ledgers = ledger_lib.ledgers_in(callbacks)
    if any(ledger is not attached for ledger in ledgers):
        raise ValueError(
            f'{model.name} has a PrivacyLedger attached (by make_private or '
            'attach_ledger), and fit\'s callbacks hold another one: pass '
            'the attached ledger (training.ledger), or none; to go on under '
            'another ledger (e.g. PrivacyLedger.from_state), attach it '
            'first: model.attach_ledger(ledger).')
    if ledgers:
        return callbacks
    if attached.verbose:
        _LOGGER.warning('DPModel.fit: accounting with the attached '
                        'PrivacyLedger (not in callbacks, so added).')
    return [attached] + guards.fit_callbacks(callbacks)


def check_fit(model: Any, x: Any, callbacks: Any, args: Sequence[Any],
              kwargs: Mapping[str, Any], *, strict: bool,
              nonprivate_prefix: str) -> None:
    """Refuses a ``fit`` call of ``model`` (a DPModel with a mechanism).

    Args:
      model: the DPModel, whose ``config`` is set.
      x, callbacks: ``fit``'s.
      args, kwargs: ``fit``'s other positional and keyword arguments, read
        for ``sample_weight``.
      strict: False downgrades the refusal of non-Poisson input to a
        ``NonPoissonInputWarning`` (``guards.check_poisson_input``).
      nonprivate_prefix: the prefix of the logs computed without noise.

    Raises:
      ValueError: see the module docstring.
    """
    check_batches_fit_model(model, x)
    # A hybrid DPModel rebuilt from an artifact has no basis yet; a
    # BasisRefresh may give it one before the first step (whose trace
    # refuses the step otherwise: PrivateAggregator.begin).
    if not any(isinstance(c, basis_refresh.BasisRefresh)
               for c in guards.fit_callbacks(callbacks)):
        model.aggregator.require_basis()
    guards.check_sharding(model.distribute_strategy, x)
    ledgers = ledger_lib.ledgers_in(callbacks)
    for ledger in ledgers:
        guards.check_ledger_event(ledger.event, model)
        guards.check_poisson_input(
            x, example_sampling_rate=model.config.example_sampling_rate,
            num_examples=model.config.num_examples,
            strict=strict)
        guards.check_no_nonprivate_monitor(callbacks, nonprivate_prefix)
    poisson = guards.is_poisson_input(
        x, example_sampling_rate=model.config.example_sampling_rate,
        num_examples=model.config.num_examples)
    if not ledgers and poisson and not model.config.non_private:
        warnings.warn(
            'DPModel.fit without a PrivacyLedger: these DP steps run, but '
            'nothing here accounts them or stops them at a budget. Pass '
            'callbacks=[PrivacyLedger.for_model(model, delta=..., '
            'target_epsilon=...)], or attach one (model.attach_ledger; '
            'make_private does).', UserWarning, stacklevel=3)
    # Steps on input not known to be Poisson are marked so in the weights'
    # record: no ledger later charges them as the config's Poisson steps.
    # With a ledger they reach this point only by the explicit opt-in
    # (strict=False, warned): that fit's ledgers charge them as the event.
    model.set_input_checked(poisson)
    if not poisson:
        for ledger in ledgers:
            ledger.watch_unchecked_input()
    if not ledgers and not poisson:
        if not model.config.non_private:
            # Said loudly: an epsilon computed apart from a ledger (e.g. by
            # the privacy statement for the planned steps) would not hold.
            warnings.warn(
                f'DPModel.fit without a PrivacyLedger on input '
                f'({type(x).__name__}) that is not Poisson-sampled logical '
                'batches for the config: these steps are not the config\'s '
                'DP mechanism, so no epsilon computed for it holds for them, '
                'and no PrivacyLedger will accept these weights later. Build '
                'the input with tf_twice.sampling.poisson_batches(...) and '
                'pass a PrivacyLedger in callbacks.',
                guards.NonPoissonInputWarning, stacklevel=3)
    # Positional: validation_split, validation_data, shuffle,
    # class_weight, sample_weight (the same on Keras 2 and 3). class_weight
    # is checked where DPModel.fit applies it (class_weights).
    per_example.check_weights(
        'sample_weight', args[4] if len(args) > 4 else
        kwargs.get('sample_weight'))
    layer_state.check_no_input_dependent_state(
        model.inner_model, layer_state.input_spec_of(x),
        model.distribute_strategy)


def prepared_input(model: Any, x: Any, y: Any, args: Sequence[Any],
                   kwargs: Mapping[str, Any]):
    """``fit``'s (x, args, kwargs) once checked: class weights applied by
    tf_twice (``class_weights``), dataset weights checked before an XLA
    step, no shuffle of logical batches."""
    x, args, kwargs = class_weights.apply_class_weight(x, y, args, kwargs)
    if isinstance(x, tf.data.Dataset):
        if getattr(model, 'jit_compile', False) is True:
            # XLA drops the step's refusal of weights outside [0, 1] (the
            # step gives them weight 0): refused here, before.
            x = x.map(per_example.with_checked_weights)
        if len(args) < 3:
            # Each element is one logical batch: nothing to shuffle (Keras
            # 3 warns about its default shuffle=True).
            kwargs.setdefault('shuffle', False)
    return x, args, kwargs


def end_fit(model: Any, callbacks: Any) -> None:
    """Undoes what one ``fit`` set, however it ended: the next steps (a
    custom loop's) are taken as checked input, as documented; the ledgers
    neither watch the train function nor charge unchecked input."""
    model.set_input_checked(True)
    ledger_lib.release_train_function(model)
    for ledger in ledger_lib.ledgers_in(callbacks):
        ledger.watch_unchecked_input(False)


def _per_example_shape(spec: Any) -> Any:
    return tuple(spec.shape[1:].as_list()) if spec.shape.rank else ()


def check_batches_fit_model(model: Any, x: Any) -> None:
    """Refuses, naming the argument, batches that the model or its loss
    cannot take, before any trace (whose errors would show a made-up probe
    batch or per-example shapes the caller never passed): string labels,
    one-hot labels for a sparse loss, inputs of another per-example shape
    than the built model's single input. Reads only a dataset's element
    spec (other input is left to Keras)."""
    spec = x.element_spec if isinstance(x, tf.data.Dataset) else None
    if not isinstance(spec, tuple) or len(spec) < 2:
        return
    x_spec, y_spec = spec[0], spec[1]
    if isinstance(y_spec, tf.TensorSpec):
        if y_spec.dtype == tf.string:
            raise ValueError(
                'fit\'s labels (y) are strings; the loss needs numbers. Map '
                'them to integer class ids (e.g. with '
                'tf.keras.layers.StringLookup, or a dict) before '
                'poisson_batches.')
        loss = getattr(model, '_example_loss', None)
        shape = _per_example_shape(y_spec)
        # Sparse labels have one axis fewer than the model's output (a
        # sequence's labels too); one-hot ones the output's shape.
        outputs = (getattr(model.inner_model, 'outputs', None)
                   if model.inner_model.built else None)
        output_shape = (tuple(outputs[0].shape[1:])
                        if outputs and len(outputs) == 1 else None)
        classes = output_shape[-1] if output_shape else None
        if (getattr(loss, 'sparse', False) and classes not in (None, 1)
                and len(shape) == len(output_shape)
                and shape[-1] == classes):
            raise ValueError(
                f'fit\'s labels (y) have per-example shape {shape}, like '
                'one-hot vectors, but the loss is sparse categorical '
                'cross-entropy, which takes one integer class id per '
                'example: compile with CategoricalCrossentropy, or pass '
                'y.argmax(-1).')
    inner = model.inner_model
    inputs = getattr(inner, 'inputs', None) if inner.built else None
    if isinstance(x_spec, tf.TensorSpec) and inputs and len(inputs) == 1:
        want = tuple(inputs[0].shape[1:])
        got = _per_example_shape(x_spec)
        if len(want) != len(got) or any(
                w is not None and g is not None and w != g
                for w, g in zip(want, got)):
            raise ValueError(
                f'fit\'s inputs (x) have per-example shape {got}, but '
                f'{inner.name} takes {want}.')
