"""The experiment scripts of tf_twice, importable as `examples.<script>`.

Each script runs as `python examples/<script>.py`; tests and other scripts
import it (`from examples import accuracy_study`). The training script's
parts live in `examples.training`.
"""
