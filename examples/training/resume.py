"""The training script's checkpoint directory and its resume protocol.

`--checkpoint_dir` holds three files:

* `ckpt.weights.h5`: weights and optimizer state (its iteration count
  included), after every epoch, in the Keras weights format that Keras 2 and
  Keras 3 both read and write; written to a temporary file that then
  replaces the previous one, so a crash mid-save keeps the last checkpoint
  whole. It holds no random state, so the noise cannot be recomputed from
  it.
* `privacy_ledger.json`: the `PrivacyLedger`'s state, written ahead of the
  steps it covers (before the checkpoint).
* `run.json`: the run's kind (`RESUME_KEYS`), the settings that shape its
  mechanism (`mechanism_settings`) and, for hybrid clipping, the per-block
  clips and noise; replaced atomically.

Running the same command again resumes the run. It is refused, with the
flag to fix named, when the directory holds a run of another kind, a
checkpoint without its ledger, a TensorFlow-format checkpoint, or steps
of another mechanism than the flags now give (`check_mechanism`): the
privacy statement describes one setting, so every step of a run must use
it. To train longer at calibrated noise, give the recorded noise
multiplier with --noise_multiplier instead of --target_epsilon.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Mapping, Optional, Tuple

import tensorflow as tf

from tf_twice import _files
from tf_twice.keras import PrivacyLedger

from examples.training.settings import PRIVATE_MODES
from examples.training.settings import budget_split_settings
from examples.training.settings import TrainConfig

LEDGER_FILENAME = 'privacy_ledger.json'
# Keras's weights format (optimizer state included) on Keras 2 and 3.
CHECKPOINT_NAME = 'ckpt.weights.h5'
_CHECKPOINT_TEMPORARY = 'ckpt.saving.weights.h5'
RUN_FILENAME = 'run.json'
# Flags that must not change when a run is resumed from --checkpoint_dir.
RESUME_KEYS = ('mode', 'dataset', 'data_path', 'features', 'model',
               'public_examples', 'validation_examples')
# What a run.json written before a key existed means by its absence.
_RESUME_KEY_DEFAULTS = {'features': 'none', 'validation_examples': 0}
# The flags behind each field of a step's DpEvent, for error messages.
_EVENT_FLAGS = {
    'example_sampling_rate': '--batch_size (or --example_sampling_rate)',
    'coordinate_sampling_rate': '--coordinate_sampling_rate',
    'noise_multiplier': '--noise_multiplier (or, when calibrated, '
                        '--target_epsilon, --delta and --steps/--epochs)',
    'l2_norm_clip': '--l2_norm_clip (hybrid: and --budget_split)',
    'linf_norm_clip': '--linf_norm_clip (or --d0, --principal_d0)',
    'block_dimensions': '--ranks (or --parameter_groups)',
}


def mechanism_settings(config: TrainConfig, plan: Any) -> Dict[str, Any]:
    """The flags (resolved: defaults filled in) that shape the mechanism.

    Recorded in run.json so that a refused resume can name the flags that
    changed. `plan` is the run's `examples.training.plan.Plan`.
    """
    settings = dict(
        batch_size=plan.mechanism.expected_batch_size,
        coordinate_sampling_rate=plan.mechanism.coordinate_sampling_rate,
        l2_norm_clip=float(config.l2_norm_clip),
        linf_norm_clip=config.linf_norm_clip, d0=plan.d0,
        noise_multiplier=config.noise_multiplier,
        target_epsilon=plan.target_epsilon, delta=plan.delta,
        steps=plan.planned_steps)
    if config.mode == 'hybrid':
        # Never the seed: run.json lies beside the checkpoints, and the seed
        # would recompute the sampling, the masks and the noise. A resumed
        # hybrid run keeps its recorded per-block clips and noise (set from
        # public data, so any seed keeps the guarantee).
        settings.update(principal_d0=float(config.principal_d0),
                        ranks=list(plan.ranks),
                        parameter_groups=config.parameter_groups)
        # Only when not the defaults, so that run.json files written before
        # --budget_split existed still match a default run.
        settings.update(budget_split_settings(config))
    return json.loads(json.dumps(settings))


def read_run_file(checkpoint_dir: str) -> Optional[Dict[str, Any]]:
    path = os.path.join(checkpoint_dir, RUN_FILENAME)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def write_run_file(config: TrainConfig, plan: Any,
                   checkpoint_dir: str,
                   hybrid: Optional[Mapping[str, Any]] = None) -> None:
    """Replaces run.json atomically (a crash leaves the old or the new)."""
    record: Dict[str, Any] = {key: getattr(config, key)
                              for key in RESUME_KEYS}
    record['planned_steps'] = plan.planned_steps
    if config.mode in PRIVATE_MODES:
        record['mechanism_settings'] = mechanism_settings(config, plan)
    if hybrid is not None:
        record['hybrid'] = dict(hybrid)
    _files.atomic_write_json(os.path.join(checkpoint_dir, RUN_FILENAME),
                             record)


def check_resume(config: TrainConfig, checkpoint_dir: str,
                 has_checkpoint: bool, has_ledger: bool) -> None:
    """Refuses to resume a run of another kind, or one without a ledger."""
    previous = read_run_file(checkpoint_dir)
    if previous is not None:
        for key in RESUME_KEYS:
            recorded = previous.get(key, _RESUME_KEY_DEFAULTS.get(key))
            if recorded != getattr(config, key):
                raise ValueError(
                    f'--checkpoint_dir={checkpoint_dir!r} holds a run with '
                    f'--{key}={recorded!r}; resuming it needs the '
                    f'same value (got {getattr(config, key)!r}), or use a new '
                    '--checkpoint_dir.')
    if not has_checkpoint and tf.train.latest_checkpoint(checkpoint_dir):
        raise ValueError(
            f'--checkpoint_dir={checkpoint_dir!r} holds a TensorFlow-format '
            f'checkpoint; this version saves and resumes {CHECKPOINT_NAME} '
            '(Keras 3 cannot read the older format). Resume it with the '
            'version that wrote it, or use a new --checkpoint_dir.')
    if (config.mode in PRIVATE_MODES and has_checkpoint and not has_ledger):
        raise ValueError(
            f'--checkpoint_dir={checkpoint_dir!r} holds a checkpoint but no '
            f'{LEDGER_FILENAME}: the privacy spent on its steps is unknown, '
            'so it cannot be resumed as a private run. Use a new '
            '--checkpoint_dir.')


def _event_json(ledger: PrivacyLedger) -> Dict[str, Any]:
    """`ledger.event` in the state file's JSON form (public API only)."""
    scratch = PrivacyLedger(ledger.event, ledger.delta, verbose=0)
    scratch.record_steps(1)
    return scratch.get_state()['segments'][0]['event']


def _changed_fields(past: Mapping[str, Any], now: Mapping[str, Any]
                    ) -> List[Tuple[str, Any, Any]]:
    if past.get('class_name') != now.get('class_name'):
        return [('event', past.get('class_name'), now.get('class_name'))]
    before, after = past.get('arguments', {}), now.get('arguments', {})
    return [(field, before.get(field), after.get(field))
            for field in sorted(set(before) | set(after))
            if before.get(field) != after.get(field)]


def check_mechanism(checkpoint_dir: str, ledger: PrivacyLedger,
                    recorded: Optional[Mapping[str, Any]],
                    settings_now: Mapping[str, Any]) -> None:
    """Refuses to resume when the steps charged used another mechanism.

    Args:
      checkpoint_dir: the run's directory (for the message).
      ledger: the run's ledger, loaded from its state file.
      recorded: run.json's `mechanism_settings` (None if absent).
      settings_now: `mechanism_settings` of the flags given now.

    Raises:
      ValueError: naming the fields of the step that differ and the flags
        whose values differ from the recorded run.
    """
    now = _event_json(ledger)
    changes: List[Tuple[str, Any, Any]] = []
    for segment in ledger.get_state()['segments']:
        if segment['count']:
            changes.extend(c for c in _changed_fields(segment['event'], now)
                           if c not in changes)
    if not changes:
        return
    step = '; '.join(f'{field} {before} (charged) != {after} (now)'
                     for field, before, after in changes)
    message = (f'--checkpoint_dir={checkpoint_dir!r} holds steps of another '
               f'mechanism than these flags give: {step}. ')
    differing = [
        f'--{key}={recorded.get(key)!r} (now {settings_now.get(key)!r})'
        # Either side may lack a flag recorded only when not its default.
        for key in sorted(set(settings_now) | set(recorded or {}))
        if recorded is not None and recorded.get(key) != settings_now.get(key)]
    if differing:
        message += 'The run was recorded with ' + ', '.join(differing) + '. '
    else:
        behind = {_EVENT_FLAGS.get(field, field) for field, _, _ in changes}
        message += 'Flags behind it: ' + ', '.join(sorted(behind)) + '. '
    message += ('The privacy statement describes one setting, so a run '
                'resumes only with the mechanism its steps used: give the '
                'recorded values, or use a new --checkpoint_dir.')
    noise = [before for field, before, _ in changes
             if field == 'noise_multiplier']
    if (noise and isinstance(noise[0], (int, float))
        and settings_now.get('noise_multiplier') is None):
        # The noise was calibrated for the planned steps; fixing it lets the
        # run go on past them (the ledger reports the epsilon of all steps).
        message += (' To train more steps with the same noise, pass '
                    f'--noise_multiplier={noise[0]!r} instead of '
                    '--target_epsilon.')
    raise ValueError(message)


class EpochCheckpoint(tf.keras.callbacks.Callback):
    """Saves the weights and optimizer state after every epoch, atomically.

    Keras writes a temporary file in the same directory, which is synced
    and then replaces the checkpoint (``os.replace``): a crash mid-save
    leaves the previous checkpoint whole. List it after the ledger, which
    writes its state first.
    """

    def __init__(self, path: str):
        super().__init__()
        self._path = path
        self._temporary = os.path.join(os.path.dirname(path),
                                       _CHECKPOINT_TEMPORARY)

    def on_epoch_end(self, epoch, logs=None):
        self.model.save_weights(self._temporary)
        with open(self._temporary, 'rb+') as f:
            os.fsync(f.fileno())
        os.replace(self._temporary, self._path)
