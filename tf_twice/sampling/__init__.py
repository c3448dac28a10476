"""Poisson-sampled logical batches for DP-SGD (SPEC section 5).

The accountant (`tf_twice.accounting`) proves its bound for *Poisson
sampling*: at every step each of the n training examples joins the logical
batch independently with probability q1 (`example_sampling_rate`), and the
randomness of different steps is independent. This package produces exactly
that, as a `tf.data.Dataset` whose every element is ONE logical batch, i.e.
one DP step:

    (x, y, sample_weight)

* the batch size is k ~ Binomial(n, q1) and the examples are a uniformly
  random k-subset drawn without replacement. This is the same distribution as
  n independent coin flips, at O(k) cost per step instead of O(n);
* the leading size is k: `DPModel` cuts a batch of any size into its own
  microbatches, so no padding rows are computed. Only on request
  (`physical_batch_size`, for fixed shapes) is it zero-padded up to a
  multiple; `sample_weight` is 1.0 for the k real examples and 0.0 for the
  padding. k = 0 gives an empty element: an empty logical batch is a legal DP
  step (the released sum is pure noise) and is emitted, never skipped;
* the randomness of step g is a stateless function of (seed, g), so a run is
  reproducible from its seed, and steps use independent streams.

Why `ds.shuffle(n).batch(B)` is NOT Poisson sampling: fixed-size batches that
partition a shuffled epoch make the steps dependent (an example used in one
batch cannot appear in another batch of the same epoch) and reveal the batch
size, which is not what the accountant analyses. Its epsilon is then not a
valid bound. Training code can tell the two apart with
`get_poisson_sampling_info(dataset)`, which recognises datasets built here
(also through `prefetch`, `take`, `skip`, `repeat`, `with_options`), and
`tf_twice.keras.guards.check_poisson_input` refuses everything else.

Re-iterating a dataset never replays batches: every new iterator (each Keras
epoch over a finite dataset, a second `fit` call, `repeat()`) draws fresh
step indices. Reusing a seed *across processes* does replay them, so a run
resumed after a crash must use a new seed (the default `seed=None` draws one)
or a `start_step` past every step index the earlier run produced; training
twice on the same subsample is not what the accountant composes.

Modules: `schedule` (q1, the expected batch size, steps per epoch; the
argument checks), `indices` (the sampling random stream: which examples join
step g), `pipelines` (the tf.data datasets built on it) and `markers` (the
`PoissonSamplingInfo` a dataset carries and its recognition).
"""

# First: refuses, naming the fix, a tf.keras that tf_twice cannot use.
from tf_twice import _keras  # noqa: F401  pylint: disable=unused-import
from tf_twice.sampling.indices import sample_logical_batch_indices
from tf_twice.sampling.markers import PoissonSamplingInfo
from tf_twice.sampling.markers import get_poisson_sampling_info
from tf_twice.sampling.pipelines import DEFAULT_MAX_BYTES
from tf_twice.sampling.pipelines import poisson_batches
from tf_twice.sampling.pipelines import poisson_batches_from_dataset
from tf_twice.sampling.schedule import PoissonSchedule
from tf_twice.sampling.schedule import poisson_schedule

__all__ = [
    'DEFAULT_MAX_BYTES',
    'PoissonSamplingInfo',
    'PoissonSchedule',
    'get_poisson_sampling_info',
    'poisson_batches',
    'poisson_batches_from_dataset',
    'poisson_schedule',
    'sample_logical_batch_indices',
]
