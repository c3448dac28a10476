"""The training script's parts (examples/train.py is flags and main only).

* `settings`: `TrainConfig` (one field per flag) and `check_config`.
* `data`: the datasets, their fixed splits and the [0, 1] scaling.
* `plan`: a run's mechanism, one `TwiceSamplingConfig` (sampling rates,
  clips, calibrated noise, the hybrid blocks), its schedule, and its
  privacy statement.
* `modeling`: the model, the loss, the optimizer and its learning-rate
  schedule.
* `resume`: the checkpoint directory (checkpoint, ledger, run.json) and the
  rules for resuming a run from it.
* `runner`: `build_run` and `train`, which put the parts together, and the
  console report.
* `console`: a quiet TensorFlow console.
"""

import os

# TensorFlow's C++ start-up log (CUDA plug-in registration, CPU features,
# TensorRT, XLA stream notes) tells a user of the scripts nothing. The level
# must be set before TensorFlow is imported, which every module of this
# package does; a level the user has set is kept (TF_CPP_MIN_LOG_LEVEL=0
# shows everything, e.g. to diagnose a GPU set-up).
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
