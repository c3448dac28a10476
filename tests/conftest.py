"""Settings for every test process (and the processes the tests start)."""

import os

# GPUs multiply float32 tensors in TensorFloat-32 by default (10-bit
# mantissas): on an NVIDIA H200 per-example conv kernel gradients then
# differed from each example's own by up to 1.9e-3 on values of order 1,
# where the tests allow 2e-5 relative; with this variable, which cuBLAS and
# cuDNN read, the same tests passed. No effect on CPUs.
os.environ.setdefault('NVIDIA_TF32_OVERRIDE', '0')


_SCRIPTS = os.path.join('tests', 'examples') + os.sep


def _is_script_test(item) -> bool:
    return (_SCRIPTS in str(item.fspath)
            and not item.get_closest_marker('every_stack'))


def pytest_collection_modifyitems(config, items):
    """Deselects, for CI's environments that do not need them:

    * with TF_TWICE_TF_FREE_TESTS=skip, the modules marked ``pytestmark =
      pytest.mark.tf_free``: they import no TensorFlow
      (tests/stack_markers_test.py checks), so their results do not depend
      on the stack; CI runs them in the oldest environment only;
    * with TF_TWICE_SCRIPT_TESTS=skip, the tests of the example scripts
      (tests/examples/): real training runs whose own logic is host-side;
      CI runs them in the newest environment (Keras 3), and the library
      they drive in every environment; those marked ``every_stack`` (the
      script end to end) run everywhere;
    * with TF_TWICE_KERAS_FREE_TESTS=skip, the modules marked ``pytestmark
      = pytest.mark.keras_free``: they build and call no Keras object (the
      kernels, the random streams, the samplers; tests/stack_markers_test.py
      checks their sources), so their results depend on TensorFlow alone;
      CI skips them in the environment whose TensorFlow another one
      already tests with the other Keras.

    .ci/run sets the variables."""
    rules = [(os.environ.get('TF_TWICE_TF_FREE_TESTS') == 'skip',
              lambda item: item.get_closest_marker('tf_free')),
             (os.environ.get('TF_TWICE_SCRIPT_TESTS') == 'skip',
              _is_script_test),
             (os.environ.get('TF_TWICE_KERAS_FREE_TESTS') == 'skip',
              lambda item: item.get_closest_marker('keras_free'))]
    for active, deselect in rules:
        skipped = [item for item in items if active and deselect(item)]
        if skipped:
            config.hook.pytest_deselected(items=skipped)
            items[:] = [item for item in items if not deselect(item)]
