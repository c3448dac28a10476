r"""Trains an image classifier with DP-SGD, twice sampling or hybrid clipping.

Modes (`--mode`):

* `nonprivate`: plain Keras `fit` on shuffled fixed-size batches. No
  privacy claim is made.
* `dpsgd`: standard DP-SGD with Poisson sampling: every step samples each
  training example with probability q1, clips its gradient to l2 norm
  `--l2_norm_clip` and adds Gaussian noise (`tf_twice.keras.DPModel` with
  coordinate sampling rate q2 = 1 and no l-infinity clip).
* `twice`: twice sampling: as `dpsgd`, plus an l-infinity clip of every
  coordinate (`--linf_norm_clip`, or `--d0` with c_inf = c2 / sqrt(d0)) and
  coordinate sampling: each coordinate of each sampled example's clipped
  gradient is kept with probability q2 (`--coordinate_sampling_rate`).
* `hybrid`: twice sampling with hybrid clipping: the gradient space is split
  into principal blocks of a basis learned from a held-out PUBLIC split of
  the training data (`--public_examples`, `--ranks`, `--parameter_groups`;
  relearned at the current weights every `--basis_refresh_steps` steps) plus
  the residual. Each block gets its own l2 budget (the global
  `--l2_norm_clip` split over blocks by `--budget_split`: the mean public
  projection norms by default, `variance_optimal` or a public norm
  quantile, `--budget_quantile`; always sum_j c2_j^2 = c2^2), l-infinity
  clip (the residual as in `twice`, principal blocks per `--principal_d0`)
  and noise multiplier (optimised for `--target_epsilon`).

Recipes (`examples.training.recipes`): the dataset and `--features` pick
the defaults of the mode, model, batch size, epochs, learning rate,
momentum, l2 clip, target epsilon and physical batch size, printed at the
start with any flag that overrides them (every flag does):

* digits: twice sampling with the small CNN, target epsilon 4, expected
  batch 128, q2 = 0.5, c2 = 1, d0 = 100, 40 epochs, SGD with learning rate
  0.5 (well under a minute on two CPU cores);
* fashion_mnist: Tramer & Boneh's end-to-end recipe (ICLR 2021): DP-SGD,
  tanh CNN, expected batch 2,048, learning rate 4, momentum 0.9, c2 = 0.1,
  40 epochs (1,160 steps), epsilon 3;
* fashion_mnist with `--features=scattering`: their ScatterNet + linear
  recipe: DP-SGD, linear model on the 81 x 7 x 7 scattering coefficients
  (normalised per example in 27 groups), expected batch 8,192, learning
  rate 16, momentum 0.9, c2 = 0.1, 40 epochs (280 steps), epsilon 3;
* every other dataset: the digits recipe.

Features: `--features=scattering` trains on ScatterNet coefficients
(`tf_twice.features`, kymatio's Scattering2D with J = 2: 81 x H/4 x W/4 per
channel) instead of the images. The transform is fixed, so applying it to
each private image costs no privacy; it is computed once (about 80 s for
Fashion-MNIST on two cores) and cached under ~/.cache/tf_twice/features
(or TF_TWICE_CACHE_DIR). Needs `pip install -e ".[features]"`.

Validation: `--validation_examples` holds out that many private training
examples (a fixed subset, the same for every seed) and reports their
accuracy: tune on it, never on the test split.

Privacy: the private modes feed Poisson-sampled logical batches
(`tf_twice.sampling.poisson_batches`) to the model, and a
`tf_twice.keras.PrivacyLedger` accounts for every step that runs. With
`--target_epsilon` the noise is calibrated (`tf_twice.accounting`) so that
the planned `--steps` (or `--epochs`) meet (epsilon, delta), and the ledger
stops training before the budget would be exceeded; `--noise_multiplier`
sets the noise directly instead. At the end the script prints the privacy
statement for the steps taken (`compute_twice_sampling_privacy_statement`)
next to the ledger's epsilon (they agree), and the test accuracy.

Seeds: `--seed` makes a run reproducible (weights, sampling, masks and
noise). A noise stream whose seed is known can be recomputed and subtracted,
so a seeded run is for experiments only; leave `--seed` unset (OS entropy)
for a release that relies on the guarantee.

Learning rate: `--learning_rate` (the recipe's) is constant unless
`--lr_schedule` is `cosine` (cosine decay to `--lr_min_fraction` of it,
default 0, over `--lr_decay_steps` steps, default the planned steps) or
`step` (multiplied by `--lr_decay_rate`, default 0.1, every
`--lr_decay_steps` steps). The schedule follows the optimizer's iteration
count, which the checkpoint holds, so a resumed run continues it.

Checkpoints: with `--checkpoint_dir` the model and its optimizer are saved
after every epoch (`ckpt.weights.h5`, the Keras weights format that Keras 2
and Keras 3 both read and write; written to a temporary file that then
replaces the previous checkpoint, so a crash mid-save keeps the last one
whole; it holds no random state, so the noise cannot be recomputed from
it; a resumed run draws fresh masks and noise, also with `--seed`, whose
stream depends on the restored weights), the ledger's state file
`privacy_ledger.json` is kept beside them (written before the checkpoint,
and ahead of the steps), and `run.json` records the run's kind, the
settings of its mechanism (and, for hybrid, its per-block clips and noise).
Running the same command again resumes: it restores the latest checkpoint,
continues the ledger (privacy already spent is never reset) and trains the
steps that remain of the plan (planned minus those the ledger charged).
Hybrid runs relearn the basis from the public split at the restored weights
(bases are not checkpointed). Refused, naming the flag: a directory of
another mode, dataset, model or public split, a checkpoint without its
ledger, and flags that change the mechanism of the steps already charged
(noise, sampling rates, clips; with `--target_epsilon` also `--steps`,
`--epochs` and `--delta`, from which the noise is calibrated), so that the
privacy statement, which describes one setting, covers every step. To train
longer at calibrated noise, resume with `--noise_multiplier` set to the
recorded one (the message gives it) instead of `--target_epsilon`.

Data: `--dataset=digits` (default) is scikit-learn's 8x8 digits, shipped with
scikit-learn (no download): 1,797 images scaled to [0, 1], a fixed split of
360 test images, the rest for training. `fashion_mnist` reads the idx files
of Debian's `dataset-fashion-mnist` package (`apt-get install
dataset-fashion-mnist`; another directory with `--data_dir`): 60,000
training and 10,000 test images. `npz` reads any image dataset saved with
`numpy.savez` as x_train, y_train, x_test, y_test (`--data_path`).
`cifar10`, `svhn_cropped` and `mnist` are read with tensorflow-datasets from
a copy prepared beforehand (`--data_dir`; nothing is downloaded, the error
says how to prepare one). Integer images are scaled to [0, 1] by the
constant 255 and a missing channel axis is added: preprocessing must not
depend on the private data. `--public_examples` examples of the training
split (a fixed random subset) are held out as public data and excluded from
the private set.

Console: TensorFlow's C++ log is hidden unless TF_CPP_MIN_LOG_LEVEL is set,
and a few known TensorFlow/Keras notes (KNOWN_NOISE) are dropped; every
other warning, the privacy ledger's included, is shown.

Run (the default: twice sampling on digits at epsilon 4):

  python examples/train.py
  python examples/train.py --dataset=fashion_mnist --features=scattering
  python examples/train.py --mode=dpsgd --target_epsilon=2 --epochs=20
  python examples/train.py --mode=hybrid --ranks=16 --public_examples=200
  python examples/train.py --lr_schedule=cosine --learning_rate=1
  python examples/train.py --dataset=fashion_mnist --target_epsilon=1
  python examples/train.py --dataset=npz --data_path=my_images.npz
  python examples/train.py --dataset=cifar10 --batch_size=500 \
      --coordinate_sampling_rate=0.5 --d0=100 --model=resnet22 --steps=2500

The flags and main are here; the parts are in `examples.training` (settings,
data, plan, modeling, resume, runner, console).
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

if __package__ in (None, ''):
    # Run as `python examples/train.py`: Python puts examples/ on the path,
    # not the repository root that holds the `examples` package.
    sys.path.insert(0, os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags

# examples.training before tf_twice: the package hides TensorFlow's C++ log,
# which must be set up before TensorFlow is imported.
from examples.training import console
from examples.training import runner
from examples.training import settings
from examples.training.data import DataUnavailableError
from examples.training.recipes import DIGITS
from examples.training.settings import BUDGET_SPLITS
from examples.training.settings import DEFAULT_BUDGET_QUANTILE
from examples.training.settings import DEFAULT_COORDINATE_SAMPLING_RATE
from examples.training.settings import DEFAULT_D0
from examples.training.settings import DEFAULT_LR_DECAY_RATE
from examples.training.settings import DEFAULT_PUBLIC_EXAMPLES
from examples.training.settings import DEFAULT_RANKS
from examples.training.settings import NOISE_OBJECTIVES
from examples.training.settings import TrainConfig
from tf_twice import datasets
from tf_twice import models
# pylint: enable=g-import-not-at-top,wrong-import-position


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Defines the command-line flags (one per `TrainConfig` field)."""
    defaults = TrainConfig()
    fv = dict(flag_values=flag_values)
    recipe = ' (default: the recipe\'s, printed at the start; digits: {})'
    flags.DEFINE_enum('mode', None, settings.MODES,
                      'What to train' + recipe.format(DIGITS.mode) + '.',
                      **fv)
    flags.DEFINE_enum('dataset', defaults.dataset, settings.DATASETS,
                      'Dataset; it selects the recipe (the defaults of the '
                      'flags marked "recipe").', **fv)
    flags.DEFINE_enum('features', defaults.features, settings.FEATURES,
                      'none: train on the images; scattering: on their '
                      'ScatterNet coefficients (tf_twice.features, cached '
                      'on disk; needs the features extra).', **fv)
    flags.DEFINE_integer('validation_examples', defaults.validation_examples,
                         'Private training examples held out as a '
                         'validation split (its accuracy is reported; tune '
                         'on it, not on the test split).', **fv)
    flags.DEFINE_string('data_dir', None, 'fashion_mnist: the directory of '
                        'its idx files (default: TF_TWICE_FASHION_MNIST_DIR, '
                        f'else {datasets.DEFAULT_FASHION_MNIST_DIR}); '
                        'tensorflow-datasets: its data directory.', **fv)
    flags.DEFINE_string('data_path', None, 'npz: the .npz file (arrays '
                        'x_train, y_train, x_test, y_test).', **fv)
    flags.DEFINE_enum('model', None, sorted(models.MODELS),
                      'Model (tf_twice.models)'
                      + recipe.format(DIGITS.model) + '.', **fv)
    flags.DEFINE_float('target_epsilon', None,
                       'Epsilon to calibrate the noise to for the planned '
                       'steps, unless --noise_multiplier is given'
                       + recipe.format(f'{DIGITS.target_epsilon:g}') + '.',
                       **fv)
    flags.DEFINE_float('noise_multiplier', None,
                       'Noise multiplier z (instead of --target_epsilon).',
                       **fv)
    flags.DEFINE_float('delta', None, 'Delta; default: 1/n rounded down to '
                       'a power of ten, at most 1e-5.', **fv)
    flags.DEFINE_float('example_sampling_rate', None, 'Poisson rate q1.', **fv)
    flags.DEFINE_float('batch_size', None, 'Expected batch size n * q1'
                       + recipe.format(f'{DIGITS.batch_size:g}') + '.', **fv)
    flags.DEFINE_float('coordinate_sampling_rate', None,
                       'Coordinate rate q2 (twice/hybrid; default '
                       f'{DEFAULT_COORDINATE_SAMPLING_RATE:g}).', **fv)
    flags.DEFINE_float('l2_norm_clip', None,
                       'l2 clip c2, hybrid: the global budget'
                       + recipe.format(f'{DIGITS.l2_norm_clip:g}') + '.',
                       **fv)
    flags.DEFINE_float('linf_norm_clip', None, 'l-infinity clip c_inf.', **fv)
    flags.DEFINE_float('d0', None, 'c_inf = l2_norm_clip / sqrt(d0) '
                       f'(default {DEFAULT_D0:g}).', **fv)
    flags.DEFINE_float('principal_d0', defaults.principal_d0,
                       'Hybrid: l-infinity clip c2_j / sqrt(principal_d0) '
                       'of the principal blocks (1: none).', **fv)
    flags.DEFINE_float('principal_coordinate_sampling_rate', None,
                       'Hybrid: the keep rate of the principal blocks\' '
                       'coefficients (default 1: unmasked; '
                       '--coordinate_sampling_rate\'s value: the paper\'s '
                       'masks on every block).',
                       **fv)
    flags.DEFINE_enum('budget_split', defaults.budget_split,
                      list(BUDGET_SPLITS),
                      'Hybrid: how the global l2 budget is split over blocks '
                      '(tf_twice.hybrid.plan_blocks), from public data.',
                      **fv)
    flags.DEFINE_float('budget_quantile', None, 'Hybrid, '
                       '--budget_split=quantile: the public norm quantile '
                       f'(default {DEFAULT_BUDGET_QUANTILE:g}).',
                       **fv)
    flags.DEFINE_boolean('replan_budgets', defaults.replan_budgets,
                         'Hybrid: re-split the l2 budget over the blocks from '
                         'the public gradients at every basis refresh, at the '
                         'same epsilon (tf_twice.hybrid.'
                         'replanned_block_scales).', **fv)
    flags.DEFINE_boolean('plan_by_progress', defaults.plan_by_progress,
                         'Hybrid: choose the principal blocks\' keep rate '
                         '(--coordinate_sampling_rate or 1) and '
                         '--noise_objective, noise calibrated, by the public '
                         'one-step loss decrease of each plan\'s update '
                         '(tf_twice.keras.plan_progress).', **fv)
    flags.DEFINE_enum('noise_objective', defaults.noise_objective,
                      list(NOISE_OBJECTIVES),
                      'Hybrid, noise optimised per block: what it minimises '
                      '(tf_twice.hybrid.plan_blocks).', **fv)
    flags.DEFINE_float('epochs', None, 'Epochs of round(1/q1) steps'
                       + recipe.format(f'{DIGITS.epochs:g}') + '.', **fv)
    flags.DEFINE_integer('steps', None, 'Steps (instead of --epochs).', **fv)
    flags.DEFINE_integer('physical_batch_size', None,
                         'Examples per vectorized chunk'
                         + recipe.format(DIGITS.physical_batch_size) + '.',
                         **fv)
    flags.DEFINE_float('learning_rate', None, 'Learning rate'
                       + recipe.format(f'{DIGITS.learning_rate:g}') + '.',
                       **fv)
    flags.DEFINE_enum('lr_schedule', defaults.lr_schedule,
                      settings.LR_SCHEDULES, 'Learning-rate schedule: '
                      'constant, cosine decay or step decay; it follows the '
                      "optimizer's iteration count (resumed runs go on).",
                      **fv)
    flags.DEFINE_integer('lr_decay_steps', None, 'cosine: steps of the decay '
                         '(default: the planned steps); step: steps between '
                         'decays (required).', **fv)
    flags.DEFINE_float('lr_decay_rate', None, 'step: factor per decay '
                       f'(default {DEFAULT_LR_DECAY_RATE:g}).', **fv)
    flags.DEFINE_float('lr_min_fraction', None, 'cosine: final learning rate '
                       'as a fraction of --learning_rate (default 0).', **fv)
    flags.DEFINE_float('momentum', None, 'SGD momentum'
                       + recipe.format(f'{DIGITS.momentum:g}') + '.', **fv)
    flags.DEFINE_float('ema_momentum', None, 'Keep an exponential moving '
                       'average of the weights with this momentum and end '
                       'with it (post-processing: no privacy cost); unset: '
                       'none.', **fv)
    flags.DEFINE_enum('optimizer', defaults.optimizer, settings.OPTIMIZERS,
                      'Keras optimizer.', **fv)
    flags.DEFINE_integer('public_examples', None,
                         'Training examples held out as public data '
                         f'(default {DEFAULT_PUBLIC_EXAMPLES} for hybrid, '
                         'else 0).', **fv)
    flags.DEFINE_list('ranks', None, 'Hybrid: ranks of the principal blocks '
                      f'(default {",".join(map(str, DEFAULT_RANKS))}).', **fv)
    flags.DEFINE_integer('parameter_groups', defaults.parameter_groups,
                         'Hybrid: parameter groups of the basis.', **fv)
    flags.DEFINE_integer('basis_refresh_steps', defaults.basis_refresh_steps,
                         'Hybrid: re-learn the basis every K steps (0: '
                         'learn it once).', **fv)
    flags.DEFINE_string('checkpoint_dir', None,
                        'Checkpoints and the privacy ledger; resumable.', **fv)
    flags.DEFINE_string('tensorboard_dir', None, 'TensorBoard logs.', **fv)
    flags.DEFINE_integer('seed', None, 'Seed (experiments only; default: '
                         'OS entropy).', **fv)
    flags.DEFINE_integer('verbose', defaults.verbose,
                         'Keras progress output (0, 1, 2).', **fv)


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    console.quiet_known_noise()
    print(console.device_summary())
    try:
        results = runner.train(flags.FLAGS)
    except (DataUnavailableError, FileNotFoundError) as e:
        # Not a usage error: the message alone, without the flags' help.
        raise SystemExit(f'Error: {e}') from e
    except ValueError as e:
        raise app.UsageError(str(e)) from e
    runner.print_results(results)


if __name__ == '__main__':
    define_flags()
    app.run(main)
