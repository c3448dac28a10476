"""Settings for every test process (and the processes the tests start)."""

import os

# GPUs multiply float32 tensors in TensorFloat-32 by default (10-bit
# mantissas): on an NVIDIA H200 per-example conv kernel gradients then
# differed from each example's own by up to 1.9e-3 on values of order 1,
# where the tests allow 2e-5 relative; with this variable, which cuBLAS and
# cuDNN read, the same tests passed. No effect on CPUs.
os.environ.setdefault('NVIDIA_TF32_OVERRIDE', '0')


def pytest_collection_modifyitems(config, items):
    """With TF_TWICE_TF_FREE_TESTS=skip, deselects the modules marked
    ``pytestmark = pytest.mark.tf_free``: they import no TensorFlow
    (tests/tf_free_test.py checks), so their results do not depend on the
    stack, and CI runs them in one environment only, the oldest (.ci/run
    sets the variable for the newest ones)."""
    if os.environ.get('TF_TWICE_TF_FREE_TESTS') != 'skip':
        return
    skipped = [item for item in items if item.get_closest_marker('tf_free')]
    if skipped:
        config.hook.pytest_deselected(items=skipped)
        items[:] = [item for item in items
                    if not item.get_closest_marker('tf_free')]
