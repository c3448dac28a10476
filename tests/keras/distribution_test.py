"""Training under tf.distribute is exact: the update does not depend on R.

Under ``MirroredStrategy`` with R = 1 and 4 logical CPU devices (and with
no strategy), and under ``MultiWorkerMirroredStrategy`` with two workers on
loopback (Keras 2: Keras 3's own fit fails under multi-worker strategies,
so there only the refusals of unsharded and differently seeded input are
checked), on both training paths: each replica clips and masks its share
of a logical batch with masks keyed by global position, and noise is added
once per logical batch. So the noiseless update with coordinate sampling is
the same for every R, the noise std is the calibrated one (not sqrt(R)
times it), the ledger charges one step per logical batch, optimizer
clipping acts on the summed noisy update, a dataset the caller distributed
is refused, and saved weights load back into a model built under the
strategy. The runs are
separate processes (``distribution_worker``): logical devices must be set
before TensorFlow initialises.
"""

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests import markers
from tests.paths import ROOT

# One MirroredStrategy per process; the processes run side by side. R = 4
# replicas of logical batches of about 6 examples (physical chunks of 3)
# get uneven and empty shares; R = 1 is the strategy's code path with one
# replica. (R = 2, in a process of its own, was dropped for its CPU time:
# R = 4 splits each batch more finely.)
_GROUPS = ['0,1', '4']
REPLICAS = ('1', '4')
PATHS = ['model', pytest.param('optimizer',
                               marks=markers.needs_tf_privacy_optimizers)]


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(('localhost', 0))
    ports = [str(s.getsockname()[1]) for s in sockets]
    for s in sockets:
        s.close()
    return ports


# A guard against a hung process, not a speed limit: on a loaded 2-core
# machine (load 6-12) the module's set-up took 578 s and workers timed out
# at the 300 and 600 s limits this replaced.
_TIMEOUT_S = 1800


def _result(run, timeout=_TIMEOUT_S):
    out, err = run.communicate(timeout=timeout)
    assert run.returncode == 0, err[-3000:]
    line = [l for l in out.splitlines() if l.startswith('RESULT ')][-1]
    return json.loads(line[len('RESULT '):])


def _start(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL='2')
    env.pop('TF_CONFIG', None)
    return subprocess.Popen(
        [sys.executable, '-m', 'tests.keras.distribution_worker', *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)


def _run_all():
    runs = [_start(group) for group in _GROUPS]
    merged = {}
    for run in runs:
        merged.update(_result(run))
    # Two workers of a MultiWorkerMirroredStrategy on loopback.
    ports = _free_ports(2)
    workers = [_start('multi_worker', str(i), *ports) for i in range(2)]
    merged['workers'] = [_result(run) for run in workers]
    return merged


@pytest.fixture(scope='module')
def results(tmp_path_factory):
    """The processes' results, run once per test session: pytest-xdist
    sets a module's fixture up in every worker, and each set of processes
    costs minutes of CPU, so the first worker runs them and the others read
    its file (in the session's base directory, shared by its workers)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get('PYTEST_XDIST_WORKER'):
        base = base.parent
    path, lock = base / 'distribution.json', base / 'distribution.lock'
    try:
        os.close(os.open(lock, os.O_CREAT | os.O_EXCL))
    except FileExistsError:  # Another worker runs them.
        deadline = time.monotonic() + 3 * _TIMEOUT_S
        while not path.exists():
            assert time.monotonic() < deadline, 'the other worker hung'
            time.sleep(1)
        shared = json.loads(path.read_text())
        assert 'error' not in shared, shared.get('error')
        return shared
    try:
        merged = _run_all()
    except BaseException as e:
        _write_atomically(path, {'error': f'{type(e).__name__}: {e}'})
        raise
    _write_atomically(path, merged)
    return merged


def _write_atomically(path, value):
    partial = path.with_suffix('.partial')
    partial.write_text(json.dumps(value))
    os.replace(partial, path)


# The worker runs these on the model's path only (its MODEL_PATH_ONLY):
# both paths share the aggregator they check.
MODEL_PATH_ONLY = ('noiseless_conv', 'noiseless_one_row')


def _paths_of(tasks):
    """(path, task) parameters: every task on the model's path, those not
    in MODEL_PATH_ONLY on the optimizer path too."""
    return [pytest.param('model', task, id=f'model-{task}')
            for task in tasks] + [
                pytest.param('optimizer', task, id=f'optimizer-{task}',
                             marks=markers.needs_tf_privacy_optimizers)
                for task in tasks if task not in MODEL_PATH_ONLY]


@pytest.mark.parametrize('path, task', _paths_of([
    'noiseless', 'noiseless_mixed_float16', 'noiseless_float16',
    'noiseless_one_row']))
def test_update_does_not_depend_on_the_number_of_replicas(results, path,
                                                          task):
    # Also under 'mixed_float16' (float16 arithmetic, float32 variables),
    # and with float16 variables: the replicas' sums are added in float64,
    # and only replica 0's update (the whole sum's) is rounded to them.
    # When every replica's share was rounded to float16 before the sum,
    # 16-bit variables were refused under several replicas.
    single = np.array(results['0'][task][path])
    assert np.abs(single).max() > 1e-3  # The step moved the weights.
    for replicas in REPLICAS:
        np.testing.assert_allclose(
            results[replicas][task][path], single, rtol=1e-5,
            atol=1e-6, err_msg=f'R={replicas}')


@pytest.mark.parametrize('path', PATHS)
def test_only_replica_0_returns_a_nonzero_update(results, path):
    # Replica 0 returns the noisy update, every other replica exactly
    # zeros. A replica returning its own noise-free share (replica 0
    # holding the rest and the noise) gives the same sum, which the update
    # comparisons alone do not see, but an optimizer that transforms each
    # replica's update before the sum (Keras 3's clipping) would.
    assert results['0']['noise'][path]['per_replica'][0] > 1e-3
    for replicas in REPLICAS:
        got = results[replicas]['noise'][path]['per_replica']
        assert len(got) == int(replicas), (replicas, got)
        assert got[0] > 1e-3, (replicas, got)
        assert got[1:] == [0.0] * (int(replicas) - 1), (replicas, got)


def test_conv_update_with_extreme_records_does_not_depend_on_replicas(
        results):
    path = 'model'  # MODEL_PATH_ONLY
    single = np.array(results['0']['noiseless_conv'][path])
    assert np.isfinite(single).all()  # The NaN and 1e38 rows are dropped.
    assert np.abs(single).max() > 1e-3
    for replicas in REPLICAS:
        got = np.array(results[replicas]['noiseless_conv'][path])
        assert np.isfinite(got).all(), f'R={replicas}'
        np.testing.assert_allclose(got, single, rtol=1e-5, atol=1e-6,
                                   err_msg=f'R={replicas}')


def test_a_basis_refresh_runs_under_the_strategy(results):
    # The refresh read the model's distributed variables in the
    # cross-replica context of fit's callbacks and failed ("handle is not
    # available outside the replica context").
    single = results['0']['basis_refresh']
    assert single['refreshes'] == 2
    assert np.abs(single['update']).max() > 1e-3
    for replicas in REPLICAS:
        got = results[replicas]['basis_refresh']
        assert got['refreshes'] == 2, replicas
        np.testing.assert_allclose(got['basis'], single['basis'], rtol=1e-4,
                                   atol=1e-5, err_msg=f'R={replicas}')
        np.testing.assert_allclose(got['update'], single['update'],
                                   rtol=1e-5, atol=1e-6,
                                   err_msg=f'R={replicas}')


def test_optimizer_clipping_acts_on_the_summed_noisy_update(results):
    # Keras 3 clips each replica's update before the sum: replica 0's is
    # the whole noisy update and the others' are zeros, so it clips the
    # noisy update (post-processing), as on one device. When each replica
    # held a noise-free share it would have clipped those, and Keras 3
    # clipping was refused under several replicas.
    single = results['0']['clipping']
    for replicas in REPLICAS:
        for want, got in zip(single, results[replicas]['clipping']):
            assert 'update' in got, (replicas, got)
            assert np.abs(want['update']).max() > 1e-3
            np.testing.assert_allclose(got['update'], want['update'],
                                       rtol=0, atol=1e-6,
                                       err_msg=f'R={replicas}')


def test_a_dataset_distributed_by_the_caller_is_refused(results):
    got = results['4']['distributed_dataset']
    assert 'not recognised as Poisson' in got['message']
    assert got['iterations'] == 0


@pytest.mark.parametrize('path', PATHS)
def test_saved_weights_load_under_the_strategy(results, path):
    # Keras 2 assigned the file's values as they were, which the loss
    # metric's variables (summed over replicas on read) refused.
    for replicas in ('0',) + REPLICAS:
        got = results[replicas]['noise'][path]['reloads']
        assert got == {'model.weights.h5': True, 'model.keras': True}, (
            replicas, got)


@pytest.mark.parametrize('path', PATHS)
def test_noise_is_added_once_per_logical_batch(results, path):
    for replicas in ('0',) + REPLICAS:
        got = results[replicas]['noise'][path]
        # 1,600 pure-noise entries: the std is within a few percent; noise
        # per replica would make it sqrt(R) times too large.
        ratio = got['std'] / got['expected_std']
        assert abs(ratio - 1) < 5 / np.sqrt(2 * got['num_values']), (
            replicas, ratio)
        assert got['steps'] == got['iterations'] == 3, replicas


@markers.needs_keras_2  # Keras 3's fit fails under multi-worker strategies.
@pytest.mark.parametrize('path', PATHS)
def test_two_workers_give_the_single_device_update(results, path):
    for worker in results['workers']:
        np.testing.assert_allclose(worker[path],
                                   results['0']['noiseless'][path],
                                   rtol=1e-5, atol=1e-6)


def test_unsharded_multi_worker_input_is_refused(results):
    # Each worker would clip and sum every example: counted twice.
    for worker in results['workers']:
        assert 'auto_shard_policy OFF' in worker['unsharded']


def test_workers_must_sample_the_same_logical_batches(results):
    # seed=None draws a seed per worker: each would slice another batch.
    for worker in results['workers']:
        assert 'different seeds' in worker['own_seeds']
        if markers.KERAS_MAJOR == 2:  # Keras 3 cannot fit multi-worker.
            assert worker['shared_seed_steps'] == 2


if __name__ == '__main__':
    raise SystemExit(pytest.main([__file__]))
