#!/usr/bin/env bash
# The GPU benchmarks in one command, each part bounded in time.
#
#   bash benchmarks/device_suite.sh           # on a machine with a GPU
#   bash benchmarks/device_suite.sh --smoke   # on a CPU: about 2.5 minutes
#
# 1. The reference CNN and ResNet22 (training_benchmark.py): non-private fit
#    with and without XLA; DPModel at q2 = 1 and at q2 = 0.5 with an
#    l-infinity clip, with and without XLA compiling the whole DP step; the
#    twice-sampling row at physical batch 64 beside 256 (the CNN; ResNet22 at
#    128, its default on a GPU, beside 64). Paired rounds: ratios are medians
#    of within-round ratios.
# 2. A GPU-side profile of the twice-sampling step with and without XLA
#    (step_profile.py --device-profile): wall time against the time the
#    GPU's streams were busy, and the costliest kernels.
#
# TensorFlow must be importable. Where it cannot be installed from an index
# (a machine without a network), put its wheels in .whl/ at the repository
# root: they are installed from there first. --smoke runs the same code on
# tiny sizes, to check that every row runs (tests/benchmarks_test.py).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$(pwd)${PYTHONPATH:+:${PYTHONPATH}}"
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2

SMOKE=0
case "${1:-}" in
  --smoke) SMOKE=1 ;;
  '') ;;
  *) echo "usage: bash benchmarks/device_suite.sh [--smoke]" >&2; exit 2 ;;
esac

if [[ -d .whl ]] && ! python3 -c 'import tensorflow' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile \
    --target /tmp/device_suite_site .whl/*.whl
  export PYTHONPATH="/tmp/device_suite_site:${PYTHONPATH}"
fi
python3 -c 'import tensorflow as tf; print("TensorFlow", tf.__version__,
  "GPUs:", tf.config.list_physical_devices("GPU"))'

# run SECONDS COMMAND...: one part, stopped (and said so) at its bound; on a
# GPU the next part runs anyway, a smoke run fails.
run() {
  local bound="$1" status=0 start=${SECONDS}; shift
  echo "== $* (bound ${bound} s)"
  timeout --kill-after=10 "${bound}" "$@" || status=$?
  if (( status )); then
    echo "== stopped or failed (exit ${status}) after $((SECONDS - start)) s"
    if (( SMOKE )); then exit "${status}"; fi
  fi
}

COMMON=(--compare-xla --compare-dp-xla --skip-slow --skip-memory)
if (( SMOKE )); then
  # Bounds for a CPU shared with a parallel test suite: compiling the XLA
  # steps alone takes about 100 s of a quiet 2-core machine.
  run 360 python3 benchmarks/training_benchmark.py "${COMMON[@]}" \
    --batch-size 16 --physical-batch-size 16 --compare-physical 8 \
    --steps 1 --rounds 1
  run 180 python3 benchmarks/step_profile.py --device-profile --batch-size 16 \
    --steps 1
  exit 0
fi
run 170 python3 benchmarks/training_benchmark.py "${COMMON[@]}" \
  --batch-size 256 --physical-batch-size 256 --compare-physical 64 \
  --steps 30 --rounds 4
run 200 python3 benchmarks/training_benchmark.py "${COMMON[@]}" \
  --model resnet22 --batch-size 128 --physical-batch-size 128 \
  --compare-physical 64 --steps 10 --rounds 3
run 60 python3 benchmarks/step_profile.py --device-profile --batch-size 256 \
  --steps 5
