"""What a `DPModel`'s artifacts hold and do not hold.

* Keras 2 writes every metric's state into `.weights.h5`, `.keras` and
  SavedModel files: computed on private batches without noise (e.g. the
  exact sum of the sampled examples' losses), it must not be in a released
  artifact, so saving clears it however it is called.
* A legacy (Keras 2) DP optimizer's state is saved beside the model's own
  variables (`privacy_record`), and loaded once the model is compiled.
* The SECRET random state of a seeded run is saved and loaded only
  explicitly, tied to the weights and steps it belongs to.
* On Keras 3, `export` takes the input signature of the batches `fit`
  trained on.
* The config holds the wrapped model and the mechanism's public parameters,
  never a seed, a random state or the basis.

`ArtifactHygiene` is a mixin of `DPModel`, before `tf.keras.Model`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import importlib
from typing import Any, Dict, List

import numpy as np
import tensorflow as tf

from tf_twice import _keras
from tf_twice import config as config_lib
from tf_twice.mechanism import aggregator as aggregator_lib

__all__ = ['ArtifactHygiene', 'Mean', 'loss_mean']

_LOGGER = logging.getLogger('tf_twice.keras.dp_model')


@tf.keras.utils.register_keras_serializable(package='tf_twice',
                                            name='LossMean')
class Mean(tf.keras.metrics.Mean):
    """Keras 2's mean, whose saved state loads as numpy values: Keras 2
    assigns a weights file's h5 datasets as they are, which a metric's
    variables under a tf.distribute strategy (summed over replicas on read,
    so divided on assignment) cannot take. Named ``Mean`` because Keras 2
    files name a metric's entry after its class (``metrics/mean``): files
    written with Keras's own mean load into it, and its files into them.
    Registered: a SavedModel names the class, and loading looks it up."""

    def load_own_variables(self, store) -> None:
        super().load_own_variables(
            {key: np.asarray(store[key]) for key in store.keys()})


def loss_mean() -> tf.keras.metrics.Mean:
    """The mean per-example loss of ``fit``'s logs (Keras 3 saves no
    metric state)."""
    if _keras.IS_KERAS_3:
        return tf.keras.metrics.Mean(name='loss')
    return Mean(name='loss')


class ArtifactHygiene:
    """`DPModel`'s saving and loading (module docstring)."""

    if not _keras.IS_KERAS_3:

        @property
        def _trackable_saved_model_saver(self):
            # Keras 2's SavedModel loader revives a model that it cannot
            # rebuild from its config (tf_twice not imported, a wrapped
            # class Keras does not know) as a generic model whose fit
            # trains without DP: make that load fail instead.
            return _keras.restored_from_config_only(
                super()._trackable_saved_model_saver)

        # Keras 2 writes the state of every metric into .weights.h5, .keras
        # and SavedModel files (Keras 3 into none): computed on private
        # batches without noise (e.g. the exact sum of the sampled
        # examples' losses), it must not be in a released artifact. Saving
        # clears it however it is called (Keras cannot be kept from
        # writing its entries): here for SavedModels, in save_own_variables
        # for the other two. save and save_weights (and so ModelCheckpoint)
        # then put the running values of fit's logs back.

        def _trackable_children(self, save_type='checkpoint', **kwargs):
            if save_type == 'savedmodel':
                self._clear_metric_state()
            return super()._trackable_children(save_type, **kwargs)

        def save(self, *args, **kwargs):
            with self._metric_state_kept():
                return super().save(*args, **kwargs)

        def save_weights(self, *args, **kwargs):
            with self._metric_state_kept():
                return super().save_weights(*args, **kwargs)

    def _training_metrics(self) -> List[Any]:
        """The metrics that steps update: the loss tracker, the compiled
        metrics and those the wrapped model's layers add."""
        metrics = self.metrics + list(self.inner_model.metrics)
        return list({id(metric): metric for metric in metrics}.values())

    def _clear_metric_state(self) -> None:
        if not _keras.IS_KERAS_3:
            for metric in self._training_metrics():
                metric.reset_state()

    @contextlib.contextmanager
    def _metric_state_kept(self):
        variables = [variable for metric in self._training_metrics()
                     for variable in metric.variables]
        values = [variable.numpy() for variable in variables]
        try:
            yield
        finally:
            for variable, value in zip(variables, values):
                variable.assign(value)

    def save_random_state(self, path: str) -> None:
        """Writes the SECRET state of the step keys to ``path``.

        Only for bit-reproducible seeded experiments that must resume
        exactly: anyone holding the file can recompute the noise of every
        later step and subtract it from released weights. Keep it apart
        from checkpoints and models, as secret as the training data.
        The file records the DP steps the weights hold and a digest of the
        weights, so that it only loads into a model at that step with those
        weights.
        """
        self._require_aggregator().keys.save(
            path, step=self._step_count(), weights=self._weights_digest())

    def load_random_state(self, path: str) -> None:
        """Continues the step keys from a ``save_random_state`` file.

        Raises:
          ValueError: the file was saved at another step count than the
            model's, or with other weights, or records neither (a file of
            an earlier version) (``StepKeys.load``).
        """
        self._require_aggregator().keys.load(
            path, step=self._step_count(), weights=self._weights_digest())

    def _step_count(self) -> int:
        return int(self.privacy_record.numpy()[0])

    def _weights_digest(self) -> str:
        """SHA-256 of the wrapped model's weights and the DP steps they
        hold: a run state continues only the weights it was saved with.

        Raises:
          ValueError: the wrapped model is not built (its weights, e.g. a
            deferred checkpoint restore, are not there to compare).
        """
        if not self.inner_model.built:
            raise ValueError(
                f'{self.inner_model.name} is not built, so its weights cannot '
                'be matched with a random state file: call the model on a '
                'batch of inputs first (a TF-format checkpoint is restored '
                'then), and save or load the random state after that.')
        digest = hashlib.sha256()
        for value in self.inner_model.get_weights() + [
                self.privacy_record.numpy()[0]]:
            value = np.ascontiguousarray(value)
            digest.update(f'{value.dtype.str}{value.shape}'.encode())
            digest.update(value.tobytes())
        return digest.hexdigest()

    def export(self, filepath, *args, **kwargs):
        """As Keras's ``Model.export``. On Keras 3 an ``input_signature``
        that is not given is that of the batches ``fit`` trained on, else
        of the wrapped functional model's inputs: Keras records none for a
        model that only ``fit`` runs (its steps call the wrapped model)."""
        # Keras 3's export(filepath, format, verbose, input_signature):
        # three positional arguments after filepath give it.
        if (_keras.IS_KERAS_3 and len(args) < 3
                and kwargs.get('input_signature') is None):
            signature = _keras.export_input_signature(self, self.inner_model)
            if signature is not None:
                kwargs['input_signature'] = signature
        return super().export(filepath, *args, **kwargs)

    def save_own_variables(self, store) -> None:
        self._clear_metric_state()  # Before Keras saves the metrics.
        super().save_own_variables(store)
        _keras.save_legacy_optimizer(getattr(self, 'optimizer', None), store)

    def load_own_variables(self, store) -> None:
        own, saved = _keras.split_legacy_optimizer(store)
        if len(own):  # None in a file from before the binding: unbound.
            super().load_own_variables(own)
        optimizer = getattr(self, 'optimizer', None)
        if optimizer is not None:
            _keras.load_legacy_optimizer(optimizer, saved, self.inner_model)
        elif saved:
            _LOGGER.warning('DPModel: not compiled yet, so the file\'s '
                            'optimizer state was not loaded.')

    def get_config(self) -> Dict[str, Any]:
        """The wrapped model and the mechanism's public parameters.

        Holds no seed and no random state (docs/checkpoints.md). A model
        compiled with a DP optimizer keeps its mechanism in the optimizer's
        config.
        """
        config = {
            'model': tf.keras.utils.serialize_keras_object(self.inner_model),
            'physical_batch_size': self.physical_batch_size,
            'name': self.name,
        }
        if self._own_aggregator is not None:
            config['config'] = self._own_aggregator.config.to_dict()
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Rebuilds a DPModel from ``get_config()``.

        The basis is not in the config (it can be GBs): for hybrid
        clipping pass it in as ``config['basis']``, e.g.
        ``DPModel.from_config({**config, 'basis': HybridBasis.load(path)})``.
        Without it (as Keras's loaders rebuild a hybrid DPModel) the model
        refuses to train until ``set_basis``: were this to raise instead,
        Keras 2's SavedModel loader would revive a generic model whose
        ``fit`` trains without DP.
        """
        config = dict(config)
        # Keras's own deserializer for layers and models: inside Keras 2's
        # SavedModel loader the generic one knows no Keras class
        # ('Unknown object: Sequential'), and the loader then revived a
        # generic model whose fit trains without DP.
        model = tf.keras.layers.deserialize(
            config.pop('model'), custom_objects=custom_objects)
        mechanism = config.pop('config', None)
        if mechanism is None:
            # Compiled with a tf_twice optimizer, which Keras's loaders look
            # up next; importing the module builds and registers it.
            importlib.import_module('tf_twice.optimizers')
            return cls(model, **config)
        mechanism = config_lib.TwiceSamplingConfig.from_dict(mechanism)
        if config.get('basis') is not None or mechanism.num_blocks == 1:
            return cls(model, mechanism, **config)
        seed = config.pop('seed', None)
        dp_model = cls(model, **config)
        dp_model._own_aggregator = aggregator_lib.PrivateAggregator(
            mechanism, seed=seed, awaiting_basis=True)
        return dp_model
