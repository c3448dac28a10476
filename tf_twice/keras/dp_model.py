"""The fast per-example training path: a Keras model with a DP train_step.

An optimizer only sees the batch loss, so tf_privacy's optimizers get
per-example gradients from ``tape.jacobian``, which back-propagates through
the whole batch once per example (O(B^2)). ``DPModel.train_step`` instead
runs the forward and backward pass of one example under
``tf.vectorized_map`` (O(B)) and feeds the per-example gradients to the same
``tf_twice.mechanism.aggregation`` as the optimizer classes.

Input contract: each dataset element is ONE logical batch ``(x, y)`` or
``(x, y, sample_weight)`` (weights in [0, 1]: 1 real, 0 padding) whose size
may change between steps, 0 included (an empty logical batch is a valid DP
step whose update is pure noise). The step pads it with zero-weight rows to a
multiple of ``physical_batch_size``, runs the physical microbatches in a
``tf.while_loop`` with static shapes, accumulates the clipped masked sums, adds
noise once and applies the update with the compiled (plain Keras) optimizer.

Privacy: with Poisson sampling of examples at rate q1 (``expected_batch_size``
= n * q1) each ``train_step`` is one (q1, q2)-twice-sampled Gaussian mechanism
with l2 bound ``l2_norm_clip`` and l-infinity bound ``linf_norm_clip``
(the paper's "Privacy Amplification from Twice Sampling" theorem); the
optimizer update is post-processing. Reported loss and metrics are computed
on the real examples without noise and are not private.

Hybrid clipping: with ``basis=`` (a ``HybridBasis`` learned from PUBLIC
data, e.g. ``learn_basis``) and per-block sequences ``l2_norm_clip``,
``noise_multiplier`` and ``linf_norm_clip`` (principal blocks, then the
residual), every microbatch's per-example gradients are split into the
basis's blocks, each block is clipped, masked and summed on its own, and
each gets its own noise (``tf_twice.mechanism.hybrid``, the same code as the
optimizer path). One step is then the multi-block
``TwiceSampledGaussianDpEvent`` with ``block_dimensions =
basis.block_dimensions``. The basis lives in fixed-shape non-trainable
variables: ``set_basis`` (e.g. ``BasisRefresh(...,
on_refresh=model.set_basis)``) changes it between steps without retracing.
The basis is NOT part of checkpoints (it is public data, possibly GBs): a
resumed run relearns it (``BasisRefresh`` refreshes at its first step) or
sets a saved one (``HybridBasis.save``/``load``, then ``set_basis``); any
public basis keeps the guarantee.

Accounting: ``DPModel.dp_event(n)`` is the ``TwiceSampledGaussianDpEvent``
of one step, and ``PrivacyLedger.for_model(model, num_examples=n, ...)``
builds a ledger from it. When ``fit`` gets a ``PrivacyLedger`` among its
callbacks it refuses input that is not Poisson-sampled and a ledger event
that differs from the model's parameters (``guards``), so the ledger's
epsilon is for the training that runs.

Checkpoints: the mask and noise generator (``dp_generator``) is part of the
model's TensorFlow checkpoint (``save_weights`` in the TF format,
``tf.train.Checkpoint``, ``BackupAndRestore``), so a restored run continues
its random stream instead of replaying it. Files without it (``.h5``,
``.keras``) reseed the generator from fresh OS entropy on ``load_weights``.
"""

import logging
import os
import secrets
from typing import Any, Dict, List, Optional, Sequence, Union

import tensorflow as tf

from tf_twice.accounting import TwiceSampledGaussianDpEvent
from tf_twice.keras import guards
from tf_twice.keras import ledger as ledger_lib
from tf_twice.mechanism import aggregation
from tf_twice.mechanism import basis as basis_lib
from tf_twice.mechanism import hybrid

__all__ = ['DPModel', 'make_private']

_LOGGER = logging.getLogger(__name__)
# Prefix of the generator's entries in the model's checkpoint.
_GENERATOR_CHECKPOINT_KEY = '_dp_generator/'


def _per_example_loss_fn(loss: Any):
    """Returns f(y_true, y_pred) -> per-example losses [B] for ``loss``."""
    if loss is None:
        raise ValueError('DPModel.compile needs a loss, got loss=None.')
    if isinstance(loss, (dict, list, tuple)):
        raise ValueError(
            'DPModel supports a single loss (one model output), got '
            f'{type(loss).__name__}.')
    if isinstance(loss, tf.keras.losses.Loss):
        # Loss.call is the unreduced per-sample loss; the reduction setting
        # is irrelevant here because every example is reduced on its own.
        fn = loss.call
    else:
        fn = tf.keras.losses.get(loss)
        if isinstance(fn, tf.keras.losses.Loss):
            fn = fn.call

    def per_example(y_true, y_pred):
        y_pred = tf.convert_to_tensor(y_pred)
        y_true = tf.cast(y_true, y_pred.dtype) if y_true.dtype.is_floating \
            else y_true
        values = tf.convert_to_tensor(fn(y_true, y_pred))
        values = tf.cast(values, tf.float32)
        if values.shape.rank is not None and values.shape.rank > 1:
            values = tf.reduce_mean(
                values, axis=list(range(1, values.shape.rank)))
        return values

    return per_example


def _example_weights(sample_weight, size: tf.Tensor) -> tf.Tensor:
    """Per-example weights [B] (ones when there are none)."""
    if sample_weight is None:
        return tf.ones([size], tf.float32)
    sample_weight = tf.convert_to_tensor(sample_weight)
    shape = sample_weight.shape
    if shape.rank is not None and not (
            shape.rank == 1 or (shape.rank == 2 and shape[1] == 1)):
        raise ValueError(
            'sample_weight must hold one weight per example (shape [B] or '
            f'[B, 1]), got shape {shape}.')
    return tf.reshape(tf.cast(sample_weight, tf.float32), [-1])


def _ledgers(callbacks: Any) -> List[ledger_lib.PrivacyLedger]:
    """The `PrivacyLedger`s among `fit`'s callbacks (list or CallbackList)."""
    if callbacks is None:
        return []
    if isinstance(callbacks, tf.keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    return [c for c in tf.nest.flatten(callbacks)
            if isinstance(c, ledger_lib.PrivacyLedger)]


def _checkpoint_has_generator(filepath: Any) -> bool:
    """Whether a TF-format checkpoint at `filepath` holds a DP generator."""
    try:
        names = [name for name, _ in tf.train.list_variables(
            os.fspath(filepath))]
    except (tf.errors.OpError, ValueError, TypeError):
        return False  # Not a TF checkpoint (.h5, .keras, SavedModel...).
    return any(name.startswith(_GENERATOR_CHECKPOINT_KEY) for name in names)


def _pad_rows(t: tf.Tensor, padded_size: tf.Tensor) -> tf.Tensor:
    rank = t.shape.rank
    if rank is None or rank == 0:
        raise ValueError(
            'every input, target and weight tensor needs a known rank >= 1 '
            f'(a leading batch dimension), got shape {t.shape}.')
    extra = padded_size - tf.shape(t)[0]
    return tf.pad(t, [[0, extra]] + [[0, 0]] * (rank - 1))


def _chunked(t: tf.Tensor, chunk: int) -> tf.Tensor:
    """[num_chunks * chunk, ...] -> [num_chunks, chunk, ...], static inner."""
    out = tf.reshape(t, tf.concat([[-1, chunk], tf.shape(t)[1:]], axis=0))
    out.set_shape([None, chunk] + t.shape[1:].as_list())
    return out


@tf.keras.utils.register_keras_serializable(package='tf_twice')
class DPModel(hybrid.BasisHolder, tf.keras.Model):
    """Wraps a Keras model so that ``fit`` runs twice-sampling DP-SGD.

    Compile it with a plain Keras optimizer (e.g. ``tf.keras.optimizers.SGD``)
    and any per-example-capable loss; the noise is added here, not by the
    optimizer. ``predict``/``evaluate`` act on the wrapped model;
    ``save_weights`` (TF format) also saves the optimizer and the DP
    generator state, so a restored run does not replay masks and noise.

    Guarantee: fed Poisson-sampled logical batches of n examples (one per
    step, ``tf_twice.sampling.poisson_batches``), each step is the
    ``dp_event(n)`` mechanism; T steps are (epsilon, delta)-DP with the
    epsilon of T compositions of that event (what ``PrivacyLedger`` reports).
    With ``basis=`` (hybrid clipping) that event has one block per basis
    block; the basis must depend on public data and the current model only.
    """

    def __init__(
        self,
        model: tf.keras.Model,
        *,
        l2_norm_clip: Union[float, Sequence[float]],
        noise_multiplier: Union[float, Sequence[float]],
        expected_batch_size: float,
        physical_batch_size: int,
        linf_norm_clip: Union[None, float, Sequence[Optional[float]]] = None,
        coordinate_sampling_rate: float = 1.0,
        seed: Optional[int] = None,
        basis: Optional[basis_lib.HybridBasis] = None,
        **kwargs,
    ) -> None:
        """Initialises the wrapper.

        Args:
          model: the Keras model to train; must not contain batch norm.
          l2_norm_clip: c2 > 0, l2 bound of one example's gradient; with a
            basis, c2_j per block (principal blocks, then the residual),
            e.g. ``split_l2_budget(c, public_block_norms(basis, ...))``.
          noise_multiplier: z >= 0; noise std per coordinate is z * c2. With
            a basis, z_j per block (e.g. ``hybrid_noise_multipliers``).
          expected_batch_size: n * q1 > 0; the update is divided by
            expected_batch_size * q2, never by the realised batch size.
          physical_batch_size: examples per vectorized chunk (an int >= 1);
            logical batches are padded to a multiple of it.
          linf_norm_clip: c_inf > 0 per coordinate after the l2 clip, or None;
            with a basis, None or c_inf_j (or None) per block.
          coordinate_sampling_rate: q2 in (0, 1], for every block.
          seed: seed of the mask and noise generator; None is
            non-deterministic.
          basis: None (one block), or a ``HybridBasis`` over the model's
            trainable variables learned from PUBLIC data only.
          **kwargs: passed to ``tf.keras.Model`` (e.g. ``name``).

        Raises:
          ValueError: an argument outside its range, or per-block arguments
            whose length is not ``basis.num_blocks`` (or that are
            sequences without a basis).
        """
        kwargs.setdefault('name', f'dp_{model.name}')
        super().__init__(**kwargs)
        if not isinstance(model, tf.keras.Model):
            raise ValueError(
                f'model must be a tf.keras.Model, got {type(model).__name__}.')
        guards.check_no_batch_norm(model)
        if (isinstance(physical_batch_size, bool)
                or not isinstance(physical_batch_size, int)
                or physical_batch_size < 1):
            raise ValueError(
                'physical_batch_size must be an integer >= 1, got '
                f'{physical_batch_size!r}.')
        self.inner_model = model
        self.dp_params = hybrid.block_params(
            basis,
            l2_norm_clip=l2_norm_clip,
            noise_multiplier=noise_multiplier,
            expected_batch_size=expected_batch_size,
            linf_norm_clip=linf_norm_clip,
            coordinate_sampling_rate=coordinate_sampling_rate)
        if basis is not None and model.built:
            hybrid.check_basis_matches_variables(basis,
                                                 model.trainable_variables)
        # A plain object: Keras does not track it, so the basis variables are
        # neither weights nor checkpointed (see the module docstring).
        self._basis_variables = (None if basis is None else
                                 hybrid.BasisVariables(basis))
        self.physical_batch_size = physical_batch_size
        self._seed = seed
        if seed is None:
            self._dp_generator = (
                tf.random.Generator.from_non_deterministic_state())
        else:
            self._dp_generator = tf.random.Generator.from_seed(seed)
        # Not an attribute Keras tracks: the tracker's state must not show up
        # in ``weights`` or the saved weights of the wrapped model.
        object.__setattr__(self, '_loss_tracker',
                           tf.keras.metrics.Mean(name='loss'))
        self._example_loss = None

    @property
    def dp_generator(self) -> tf.random.Generator:
        """The generator of the per-step mask and noise keys.

        Tracked by the model's checkpoint (as ``_dp_generator``): restoring
        a TF-format checkpoint rewinds it to the checkpoint's step.
        Restoring after a crash therefore redraws the keys of the steps that
        ran after the last checkpoint and were lost; that is harmless while
        nothing those lost steps computed was released (their weights were
        never saved). If it might have been (e.g. a callback exported the
        weights after every step), call
        ``model.dp_generator.reset_from_seed(<new seed>)`` after restoring.
        """
        return self._dp_generator

    def dp_event(self, num_examples: int) -> TwiceSampledGaussianDpEvent:
        """The DpEvent of one ``train_step`` on n = ``num_examples`` examples.

        With Poisson sampling at q1 = expected_batch_size / n, one step is
        exactly ``TwiceSampledGaussianDpEvent(example_sampling_rate=q1,
        coordinate_sampling_rate=q2, noise_multiplier=z, l2_norm_clip=c2,
        linf_norm_clip=c_inf)`` (q2 is the nominal rate; the masks keep
        coordinates with a rate at most q2, which the bound covers). With a
        basis the fields are per-block tuples and ``block_dimensions`` is
        ``basis.block_dimensions`` (principal ranks r_j, then d: the
        residual is released in all d natural coordinates).

        Raises:
          ValueError: num_examples is not an integer >= expected_batch_size,
            or a noise multiplier is 0 (no DP guarantee to account).
        """
        return guards.model_dp_event(self, num_examples)

    def call(self, inputs, training=None, mask=None):
        return self.inner_model(inputs, training=training)

    def compile(self, optimizer='rmsprop', loss=None, metrics=None,
                **kwargs):
        if getattr(optimizer, '_was_dp_gradients_called', None) is not None:
            raise ValueError(
                'DPModel adds the noise itself; compile it with a plain Keras '
                f'optimizer, not the DP optimizer {type(optimizer).__name__}.')
        self._example_loss = _per_example_loss_fn(loss)
        super().compile(optimizer=optimizer, loss=loss, metrics=metrics,
                        **kwargs)

    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose='auto',
            callbacks=None, *args, allow_non_poisson_input: bool = False,
            **kwargs):
        """``tf.keras.Model.fit``, checked against its privacy ledgers.

        Each element of ``x`` is one logical batch, i.e. one DP step. When a
        ``PrivacyLedger`` is among ``callbacks``, before any step runs:

        * ``x`` must be Poisson-sampled logical batches
          (``tf_twice.sampling.poisson_batches``) at the ledger event's
          example rate q1: the accountant's epsilon is not a bound for
          arrays batched by ``fit`` or ``shuffle().batch()`` pipelines, so
          they are refused (ValueError);
        * the ledger's event must match this model: noise multiplier, l2 and
          l-infinity clips, coordinate rate and q1 * n = expected_batch_size
          with n the dataset's number of examples (ValueError naming the
          field).

        Without a ledger, ``fit`` trains as ``tf.keras.Model.fit`` does and
        NOTHING IS ACCOUNTED: no epsilon holds unless the caller accounts
        the steps (and their sampling) by other means.

        Args:
          x, y, batch_size, epochs, verbose, callbacks, *args, **kwargs: as
            in ``tf.keras.Model.fit``.
          allow_non_poisson_input: True downgrades the refusal of
            non-Poisson input to a ``NonPoissonInputWarning``, for
            experiments that claim no epsilon: the ledger's epsilon then
            DOES NOT HOLD for the run. Event mismatches are always refused.

        Raises:
          ValueError: see above, or a check of ``tf.keras.Model.fit``.
        """
        if not isinstance(allow_non_poisson_input, bool):
            raise ValueError('allow_non_poisson_input must be True or False; '
                             f'got {allow_non_poisson_input!r}.')
        for ledger in _ledgers(callbacks):
            event = ledger.event
            info = guards.check_poisson_input(
                x,
                example_sampling_rate=getattr(event, 'example_sampling_rate',
                                              None),
                strict=not allow_non_poisson_input)
            guards.check_event_matches_model(
                event, self,
                num_examples=None if info is None else info.num_examples)
        return super().fit(x, y, batch_size, epochs, verbose, callbacks,
                           *args, **kwargs)

    def load_weights(self, filepath, *args, **kwargs):
        """``tf.keras.Model.load_weights``; never replays the DP generator.

        A TF-format checkpoint of a DPModel restores ``dp_generator`` with
        the weights. Any other file (``.h5``, ``.keras``, a TF checkpoint
        saved without it) leaves it where it is, and for a seeded
        model that is the seed's first keys again: a resumed run would add
        the same noise and masks as the first steps. So the generator is
        then reseeded from fresh OS entropy (a warning says so when the
        model was seeded).
        """
        status = super().load_weights(filepath, *args, **kwargs)
        if not _checkpoint_has_generator(filepath):
            self._dp_generator.reset_from_seed(secrets.randbits(63))
            if self._seed is not None:
                _LOGGER.warning(
                    'DPModel.load_weights: %s holds no DP generator state '
                    '(use the TF checkpoint format to keep it); reseeded the '
                    'mask and noise generator from OS entropy so that the '
                    'seed\'s keys are not replayed.', filepath)
        return status

    @property
    def metrics(self):
        metrics = [self._loss_tracker]
        compiled = getattr(self, 'compiled_metrics', None)
        if compiled is not None:
            metrics += compiled.metrics
        return metrics

    def _example_losses(self, y, y_pred) -> tf.Tensor:
        losses = self._example_loss(y, y_pred)
        regularization = self.inner_model.losses
        if regularization:
            losses += tf.cast(tf.add_n(regularization), losses.dtype)
        return losses

    def _ensure_built(self, x) -> None:
        # Variables cannot be created inside tf.vectorized_map, so an unbuilt
        # model is built here on one all-zero example.
        if self.inner_model.built:
            return
        for t in tf.nest.flatten(x):
            if not t.shape[1:].is_fully_defined():
                raise ValueError(
                    'Build the wrapped model before training (call it once '
                    'or give it an input shape); its input shape '
                    f'{t.shape} is not fully known.')
        self.inner_model(
            tf.nest.map_structure(
                lambda t: tf.zeros([1] + t.shape[1:].as_list(), t.dtype), x),
            training=False)

    def _per_example_gradients(self, x, y):
        """Per-example gradients [P, *shape], losses [P], predictions."""
        variables = self.inner_model.trainable_variables

        def one_example(args):
            xi, yi = args
            xi = tf.nest.map_structure(lambda t: tf.expand_dims(t, 0), xi)
            yi = tf.expand_dims(yi, 0)
            with tf.GradientTape() as tape:
                prediction = self.inner_model(xi, training=True)
                loss = self._example_losses(yi, prediction)[0]
            grads = tape.gradient(
                loss, variables,
                unconnected_gradients=tf.UnconnectedGradients.ZERO)
            grads = [tf.convert_to_tensor(g) for g in grads]
            prediction = tf.nest.map_structure(lambda t: t[0], prediction)
            return grads, loss, prediction

        return tf.vectorized_map(one_example, (x, y))

    def _update_metrics(self, y, predictions, losses, weights,
                        weighted: bool) -> None:
        """Updates loss and compiled metrics on the rows of weight > 0.

        Keras applies sample weights only to ``weighted_metrics``, so zero-
        weight (padding) rows are removed rather than down-weighted. The loss
        is the weighted mean of the per-example losses.
        """
        real = weights > 0
        self._loss_tracker.update_state(
            tf.boolean_mask(losses, real),
            sample_weight=tf.boolean_mask(weights, real))
        y_real = tf.boolean_mask(y, real)
        predictions = tf.nest.map_structure(
            lambda t: tf.boolean_mask(t, real), predictions)
        self.compiled_metrics.update_state(
            y_real, predictions,
            tf.boolean_mask(weights, real) if weighted else None)

    def train_step(self, data):
        if self._example_loss is None:
            raise ValueError('DPModel must be compiled before training.')
        x, y, sample_weight = tf.keras.utils.unpack_x_y_sample_weight(data)
        if y is None:
            raise ValueError('DPModel.train_step needs targets y.')
        y = tf.convert_to_tensor(y)
        x = tf.nest.map_structure(tf.convert_to_tensor, x)
        self._ensure_built(x)
        size = tf.shape(tf.nest.flatten(x)[0])[0]
        weights = _example_weights(sample_weight, size)
        chunk = self.physical_batch_size
        num_chunks = (size + chunk - 1) // chunk
        padded = num_chunks * chunk

        def to_chunks(t):
            return _chunked(_pad_rows(t, padded), chunk)

        x_chunks = tf.nest.map_structure(to_chunks, x)
        y_chunks = to_chunks(y)
        w_chunks = to_chunks(weights)

        params = self.dp_params
        variables = self.inner_model.trainable_variables
        # The structure is fixed at trace time; the values are read from the
        # basis variables at every step (set_basis needs no retracing).
        basis = self.basis
        matrices = None
        if basis is not None:
            hybrid.check_basis_matches_variables(basis, variables)
            matrices = self._basis_variables.variables
        key = aggregation.draw_step_key(self._dp_generator)

        def body(i, sums):
            xc = tf.nest.map_structure(lambda t: t[i], x_chunks)
            yc, wc = y_chunks[i], w_chunks[i]
            grads, losses, predictions = self._per_example_gradients(xc, yc)
            chunk_sums = hybrid.block_sums(
                grads, params, basis=basis, matrices=matrices, weights=wc,
                key=key, example_offset=i * chunk)
            self._update_metrics(yc, predictions, losses, wc,
                                 sample_weight is not None)
            return i + 1, [[s + c for s, c in zip(block, chunk_block)]
                           for block, chunk_block in zip(sums, chunk_sums)]

        zeros = hybrid.zero_block_sums(variables, basis)
        _, sums = tf.while_loop(
            lambda i, _: i < num_chunks, body, (tf.constant(0), zeros),
            parallel_iterations=1)
        update = hybrid.noisy_update(sums, params, basis=basis,
                                     matrices=matrices, key=key)
        self.optimizer.apply_gradients(zip(update, variables))
        return {m.name: m.result() for m in self.metrics}

    def test_step(self, data):
        if self._example_loss is None:
            raise ValueError('DPModel must be compiled before evaluation.')
        x, y, sample_weight = tf.keras.utils.unpack_x_y_sample_weight(data)
        y = tf.convert_to_tensor(y)
        y_pred = self.inner_model(x, training=False)
        losses = self._example_losses(y, y_pred)
        weights = _example_weights(sample_weight, tf.shape(losses)[0])
        self._update_metrics(y, y_pred, losses, weights,
                             sample_weight is not None)
        return {m.name: m.result() for m in self.metrics}

    def get_config(self) -> Dict[str, Any]:
        config = {
            'model': tf.keras.utils.serialize_keras_object(self.inner_model),
            'physical_batch_size': self.physical_batch_size,
            'seed': self._seed,
            'name': self.name,
        }
        config.update(self.dp_params.to_dict())
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Rebuilds a DPModel from ``get_config()``.

        The basis is not in the config (it can be GBs): for hybrid
        clipping pass it in as ``config['basis']``, e.g.
        ``DPModel.from_config({**config, 'basis': HybridBasis.load(path)})``.
        """
        config = dict(config)
        model = tf.keras.utils.deserialize_keras_object(
            config.pop('model'), custom_objects=custom_objects)
        return cls(model, **config)


def make_private(model: tf.keras.Model, **dp_kwargs) -> DPModel:
    """Returns ``DPModel(model, **dp_kwargs)``: ``model`` with a DP train_step.

    With hybrid clipping (``basis=`` and per-block parameters; the basis and
    the budgets come from PUBLIC data only):

    ```python
    grads = public_per_example_gradients(model, loss, x_pub, y_pub)
    basis = learn_basis(grads, ranks=[64, 192], groups=4)
    clips = split_l2_budget(1.0, public_block_norms(basis, grads,
                                                    clip_norm=1.0))
    noise = hybrid_noise_multipliers(
        basis, clips, target_epsilon=3.0, delta=1e-5, steps=steps,
        example_sampling_rate=256 / len(x), coordinate_sampling_rate=0.5)
    private = make_private(model, basis=basis, l2_norm_clip=clips,
                           noise_multiplier=noise,
                           coordinate_sampling_rate=0.5,
                           expected_batch_size=256, physical_batch_size=128)
    refresh = BasisRefresh(model, (x_pub, y_pub), loss, every_steps=100,
                           on_refresh=private.set_basis, ranks=[64, 192],
                           groups=4)
    private.fit(data, callbacks=[ledger, refresh])
    ```

    One block:

    Example:

    ```python
    private = make_private(model, l2_norm_clip=1.0, linf_norm_clip=0.1,
                           noise_multiplier=1.1, coordinate_sampling_rate=0.5,
                           expected_batch_size=256, physical_batch_size=128)
    private.compile(optimizer=tf.keras.optimizers.SGD(0.5),
                    loss=tf.keras.losses.SparseCategoricalCrossentropy(
                        from_logits=True), metrics=['accuracy'])
    data = tf_twice.sampling.poisson_batches(
        x, y, physical_batch_size=128, expected_batch_size=256)
    ledger = PrivacyLedger.for_model(
        private, num_examples=len(x), delta=1e-5, target_epsilon=3.0,
        state_path='checkpoints/privacy_ledger.json')
    private.fit(data, epochs=..., callbacks=[ledger])  # accounted and checked
    ```
    """
    return DPModel(model, **dp_kwargs)
