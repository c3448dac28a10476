"""The GPU benchmark command's smoke run on a CPU: every row it times, XLA's
DP step included, runs and prints its ratio (benchmarks/device_suite.sh).
On Keras 3 only, the stack the GPU runs use: one run per CI."""

import subprocess

from tests import markers
from tests.paths import ROOT


@markers.needs_keras_3
def test_the_device_suite_runs_every_row_on_a_cpu():
    done = subprocess.run(
        ['bash', str(ROOT / 'benchmarks' / 'device_suite.sh'), '--smoke'],
        capture_output=True, text=True, timeout=600, check=False)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    for row in ('non-private fit XLA', 'fast path q2=1 XLA',
                'fast path q2=0.5 linf=0.1 XLA',
                'fast path q2=0.5 linf=0.1 physical=8'):
        assert f'  {row} ' in out, out[-3000:]
    assert ('fast path q2=0.5 linf=0.1 XLA / non-private fit XLA: wall'
            in out), out[-3000:]
    assert 'TensorFlow sees no GPU (GPU busy is 0)' in out
    assert 'fast path q2=0.5 linf=0.1 XLA: wall ' in out, out[-3000:]
