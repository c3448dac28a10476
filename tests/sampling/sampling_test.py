"""Tests of Poisson-sampled logical batches (tf_twice.sampling)."""

import math

import numpy as np
import pytest
import tensorflow as tf

from tf_twice import sampling

pytestmark = pytest.mark.keras_free  # Once per TensorFlow (conftest).


def _index_matrix(n, q1, steps, seed, physical_batch_size=8):
    """[steps, n] 0/1 inclusion matrix read back from the dataset."""
    x = np.arange(n, dtype=np.int64)
    ds = sampling.poisson_batches(
        x, x.copy(), physical_batch_size=physical_batch_size,
        example_sampling_rate=q1, steps=steps, seed=seed)
    included = np.zeros([steps, n], dtype=np.float64)
    count = 0
    for t, (xb, yb, w) in enumerate(ds.as_numpy_iterator()):
        k = int(w.sum())
        assert np.array_equal(xb[:k], yb[:k])
        assert len(set(xb[:k].tolist())) == k  # Without replacement.
        included[t, xb[:k]] = 1.0
        count += 1
    assert count == steps
    return included


@pytest.fixture(scope='module')
def low_rate():
    return 60, 0.25, _index_matrix(60, 0.25, 3000, seed=11)


@pytest.fixture(scope='module')
def high_rate():
    # q1 > 1/2 takes the complement branch of the subset sampler.
    return 16, 0.8, _index_matrix(16, 0.8, 3000, seed=12)


def _binomial_fourth_central_moment(n, q):
    v = n * q * (1 - q)
    return v * (1 + 3 * (n - 2) * q * (1 - q))


@pytest.mark.parametrize('case', ['low_rate', 'high_rate'])
def test_batch_size_is_binomial(case, request):
    n, q, included = request.getfixturevalue(case)
    sizes = included.sum(axis=1)
    t = len(sizes)
    mean, var = n * q, n * q * (1 - q)
    assert abs(sizes.mean() - mean) < 5 * math.sqrt(var / t)
    se_var = math.sqrt(
        (_binomial_fourth_central_moment(n, q) - var**2 * (t - 3) / (t - 1))
        / t)
    assert abs(sizes.var(ddof=1) - var) < 5 * se_var


@pytest.mark.parametrize('case', ['low_rate', 'high_rate'])
def test_each_example_included_with_rate_q1(case, request):
    n, q, included = request.getfixturevalue(case)
    t = included.shape[0]
    freq = included.mean(axis=0)
    assert np.all(np.abs(freq - q) < 5 * math.sqrt(q * (1 - q) / t))


@pytest.mark.parametrize('case', ['low_rate', 'high_rate'])
def test_pairs_included_independently(case, request):
    n, q, included = request.getfixturevalue(case)
    t = included.shape[0]
    co = included.T @ included / t
    pairs = co[~np.eye(n, dtype=bool)]
    q2 = q * q
    assert np.all(np.abs(pairs - q2) < 5 * math.sqrt(q2 * (1 - q2) / t))


@pytest.mark.parametrize('case', ['low_rate', 'high_rate'])
def test_steps_are_independent(case, request):
    n, q, included = request.getfixturevalue(case)
    t = included.shape[0]
    # Example i in step s and in step s + 1: probability q1^2 if independent.
    both = (included[:-1] * included[1:]).mean()
    q2 = q * q
    assert abs(both - q2) < 5 * math.sqrt(q2 * (1 - q2) / ((t - 1) * n))
    sizes = included.sum(axis=1)
    lag1 = np.corrcoef(sizes[:-1], sizes[1:])[0, 1]
    assert abs(lag1) < 5 / math.sqrt(t)


def test_padding_weights_and_shapes():
    n, p = 37, 5
    x = np.arange(n, dtype=np.float32)[:, None] + 1.0  # No real row is zero.
    y = np.arange(n, dtype=np.int32)
    ds = sampling.poisson_batches(x, y, physical_batch_size=p,
                                  example_sampling_rate=0.3, steps=50, seed=3)
    assert ds.element_spec[0].shape.as_list() == [None, 1]
    assert ds.element_spec[2].dtype == tf.float32
    for xb, yb, w in ds.as_numpy_iterator():
        k = int(w.sum())
        assert len(w) % p == 0 and len(w) - k < p
        assert xb.shape == (len(w), 1) and yb.shape == (len(w),)
        np.testing.assert_array_equal(w, [1.0] * k + [0.0] * (len(w) - k))
        np.testing.assert_array_equal(xb[k:], 0.0)
        np.testing.assert_array_equal(yb[k:], 0)
        np.testing.assert_array_equal(xb[:k, 0] - 1.0, yb[:k])


def test_batches_are_not_padded_unless_asked():
    n = 37
    x = np.arange(n, dtype=np.float32)[:, None] + 1.0
    y = np.arange(n, dtype=np.int32)
    ds = sampling.poisson_batches(x, y, example_sampling_rate=0.3, steps=50,
                                  seed=3)
    assert sampling.get_poisson_sampling_info(ds).physical_batch_size is None
    sizes = []
    for xb, yb, w in ds.as_numpy_iterator():
        np.testing.assert_array_equal(w, np.ones(len(yb)))
        np.testing.assert_array_equal(xb[:, 0] - 1.0, yb)
        sizes.append(len(yb))
    # The same steps as with padding, only without the zero rows.
    padded = sampling.poisson_batches(x, y, physical_batch_size=5,
                                      example_sampling_rate=0.3, steps=50,
                                      seed=3)
    assert sizes == [int(w.sum()) for _, _, w in padded.as_numpy_iterator()]
    assert len(set(sizes)) > 3


def test_empty_batches_are_emitted():
    x = np.ones([5, 3], np.float32)
    ds = sampling.poisson_batches(x, np.zeros(5), physical_batch_size=4,
                                  example_sampling_rate=0.05, steps=200,
                                  seed=0)
    shapes = [e[0].shape for e in ds.as_numpy_iterator()]
    assert len(shapes) == 200
    empty = [s for s in shapes if s[0] == 0]
    # P(empty) = 0.95^5 = 0.77; all 200 steps are there, empty ones too.
    assert 100 < len(empty) < 200
    assert all(s == (0, 3) for s in empty)


def test_q1_one_takes_every_example():
    ds = sampling.poisson_batches(np.arange(7), np.arange(7),
                                  physical_batch_size=4,
                                  example_sampling_rate=1.0, steps=3, seed=1)
    for xb, _, w in ds.as_numpy_iterator():
        assert sorted(xb[:7].tolist()) == list(range(7))
        np.testing.assert_array_equal(w, [1.0] * 7 + [0.0])


def _batches(ds):
    return [e[0][:int(e[2].sum())].tolist() for e in ds.as_numpy_iterator()]


def test_reproducible_from_seed_and_fresh_on_reiteration():
    x = np.arange(40)

    def make(seed, start_step=0):
        return sampling.poisson_batches(
            x, x, physical_batch_size=4, expected_batch_size=10.0, steps=6,
            seed=seed, start_step=start_step)

    ds = make(5)
    first = _batches(ds)
    assert first == _batches(make(5))
    assert first != _batches(make(6))
    # A second pass (e.g. the next epoch of fit) continues with fresh steps.
    second = _batches(ds)
    assert second != first
    assert second == _batches(make(5, start_step=6))
    for step, batch in enumerate(first + second):
        expected = sampling.sample_logical_batch_indices(
            40, example_sampling_rate=0.25, seed=5, step=step)
        assert batch == expected.tolist()


def test_default_steps_is_one_epoch_and_repeat_is_infinite():
    x = np.arange(100)
    ds = sampling.poisson_batches(x, x, physical_batch_size=8,
                                  example_sampling_rate=0.3, seed=1)
    assert int(ds.cardinality()) == 3  # round(1 / 0.3)
    infinite = sampling.poisson_batches(x, x, physical_batch_size=8,
                                        example_sampling_rate=0.3, seed=1,
                                        repeat=True)
    assert int(infinite.cardinality()) == tf.data.INFINITE_CARDINALITY
    assert _batches(infinite.take(3)) == _batches(ds)
    info = sampling.get_poisson_sampling_info(infinite)
    assert info.steps is None and info.seed == 1


def test_seed_is_drawn_and_recorded_when_not_given():
    x = np.arange(30)
    ds = sampling.poisson_batches(x, x, physical_batch_size=2,
                                  example_sampling_rate=0.5, steps=3)
    seed = sampling.get_poisson_sampling_info(ds).seed
    again = sampling.poisson_batches(x, x, physical_batch_size=2,
                                     example_sampling_rate=0.5, steps=3,
                                     seed=seed)
    assert _batches(ds) == _batches(again)


def test_nested_inputs_and_preprocess_fn():
    n = 20
    x = {'a': np.arange(n, dtype=np.float32), 'b': np.ones([n, 2], np.uint8)}

    def preprocess(xb, yb):
        return {'a': xb['a'] * 2.0 + 1.0, 'b': xb['b']}, yb

    ds = sampling.poisson_batches(x, np.arange(n), physical_batch_size=3,
                                  example_sampling_rate=0.5, steps=5, seed=2,
                                  preprocess_fn=preprocess)
    for xb, yb, w in ds.as_numpy_iterator():
        k = int(w.sum())
        np.testing.assert_array_equal(xb['a'][:k], yb[:k] * 2.0 + 1.0)
        np.testing.assert_array_equal(xb['a'][k:], 0.0)  # Padding stays 0.
        assert xb['b'].shape == (len(w), 2)


def test_schedule():
    s = sampling.poisson_schedule(1000, expected_batch_size=64)
    assert s.example_sampling_rate == pytest.approx(0.064)
    assert s.expected_batch_size == pytest.approx(64.0)
    assert s.steps_per_epoch == 16  # round(15.625)
    assert sampling.poisson_schedule(
        10, example_sampling_rate=0.4).steps_per_epoch == 3  # 2.5 -> 3
    assert sampling.poisson_schedule(
        10, example_sampling_rate=1.0).steps_per_epoch == 1


@pytest.mark.parametrize('kwargs, match', [
    (dict(example_sampling_rate=0.0), 'example_sampling_rate'),
    (dict(example_sampling_rate=1.5), 'example_sampling_rate'),
    (dict(example_sampling_rate=float('nan')), 'example_sampling_rate'),
    (dict(expected_batch_size=11), 'expected_batch_size'),
    (dict(example_sampling_rate=0.1, expected_batch_size=1), 'exactly one'),
    (dict(), 'exactly one'),
    (dict(example_sampling_rate=0.5, physical_batch_size=0),
     'physical_batch_size'),
    (dict(example_sampling_rate=0.5, physical_batch_size=2.0),
     'physical_batch_size'),
    (dict(example_sampling_rate=0.5, steps=0), 'steps'),
    (dict(example_sampling_rate=0.5, steps=3, repeat=True),
     r'steps must be None when repeat=True .*got steps=3\.'),
    (dict(example_sampling_rate=0.5, seed=-1), 'seed'),
    (dict(example_sampling_rate=0.5, seed=2**63), 'seed'),
    (dict(example_sampling_rate=0.5, start_step=-1), 'start_step'),
    (dict(example_sampling_rate=0.5, preprocess_fn=3), 'preprocess_fn'),
])
def test_bad_arguments(kwargs, match):
    kwargs.setdefault('physical_batch_size', 2)
    with pytest.raises(ValueError, match=match):
        sampling.poisson_batches(np.arange(10), np.arange(10), **kwargs)


def test_mismatched_lengths():
    with pytest.raises(ValueError, match='same number of examples'):
        sampling.poisson_batches(np.arange(10), np.arange(9),
                                 physical_batch_size=2,
                                 example_sampling_rate=0.5)


def test_from_dataset_matches_arrays():
    x = np.random.default_rng(0).normal(size=[30, 2]).astype(np.float32)
    y = np.arange(30)
    source = tf.data.Dataset.from_tensor_slices((x, y))
    kwargs = dict(physical_batch_size=4, example_sampling_rate=0.2, steps=5,
                  seed=9)
    a = list(sampling.poisson_batches_from_dataset(source, **kwargs)
             .as_numpy_iterator())
    b = list(sampling.poisson_batches(x, y, **kwargs).as_numpy_iterator())
    for ea, eb in zip(a, b):
        for ta, tb in zip(ea, eb):
            np.testing.assert_array_equal(ta, tb)


def test_from_dataset_refuses_what_it_cannot_sample():
    pairs = tf.data.Dataset.from_tensor_slices(
        (np.zeros([10, 4], np.float32), np.zeros(10)))
    kwargs = dict(physical_batch_size=2, example_sampling_rate=0.5)
    with pytest.raises(ValueError, match='infinite'):
        sampling.poisson_batches_from_dataset(pairs.repeat(), **kwargs)
    with pytest.raises(ValueError, match='max_bytes'):
        sampling.poisson_batches_from_dataset(pairs, max_bytes=100, **kwargs)
    with pytest.raises(ValueError, match='max_bytes'):  # Unknown size.
        sampling.poisson_batches_from_dataset(
            pairs.filter(lambda a, b: True), max_bytes=100, **kwargs)
    with pytest.raises(ValueError, match='pairs'):
        sampling.poisson_batches_from_dataset(
            pairs.map(lambda a, b: {'x': a, 'y': b}), **kwargs)
    with pytest.raises(ValueError, match='fixed shape'):
        sampling.poisson_batches_from_dataset(
            pairs.map(lambda a, b: (a[:tf.cast(b, tf.int32) + 1], b)),
            **kwargs)
    with pytest.raises(ValueError, match='at least one'):
        sampling.poisson_batches_from_dataset(pairs.take(0), **kwargs)
    with pytest.raises(ValueError, match='tf.data.Dataset'):
        sampling.poisson_batches_from_dataset(np.zeros(3), **kwargs)


def test_from_tfds_source():
    tfds = pytest.importorskip('tensorflow_datasets')
    with tfds.testing.mock_data(num_examples=24):
        source = tfds.load('mnist', split='train', as_supervised=True)
        ds = sampling.poisson_batches_from_dataset(
            source, physical_batch_size=4, example_sampling_rate=0.25,
            steps=3, seed=1)
    info = sampling.get_poisson_sampling_info(ds)
    assert info.num_examples == 24
    for xb, yb, w in ds.as_numpy_iterator():
        assert xb.shape[1:] == (28, 28, 1) and len(xb) % 4 == 0
        assert len(yb) == len(w)


def test_marker_survives_only_safe_transformations():
    x = np.arange(20)
    ds = sampling.poisson_batches(x, x, physical_batch_size=2,
                                  example_sampling_rate=0.5, steps=4, seed=0)
    info = sampling.get_poisson_sampling_info(ds)
    assert info.example_sampling_rate == 0.5 and info.num_examples == 20
    for safe in (ds.prefetch(2), ds.take(2).repeat(3), ds.skip(1),
                 ds.with_options(tf.data.Options())):
        assert sampling.get_poisson_sampling_info(safe) == info
    for unsafe in (ds.map(lambda a, b, c: (a, b, c)), ds.unbatch().batch(4),
                   ds.cache(), ds.shuffle(4),
                   tf.data.Dataset.from_tensor_slices((x, x)).shuffle(20)
                   .batch(10), x, None):
        assert sampling.get_poisson_sampling_info(unsafe) is None
