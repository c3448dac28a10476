"""Refuses a loss that writes a variable (state kept across examples).

A per-example loss must depend on its own example alone. A loss that keeps
state in a variable written in ``call`` (a running maximum of the losses,
an adaptive temperature, a count of classes seen) carries one example's
data into the losses, and so the gradients, of other examples and later
steps: a record changed another step's sum by 38.6x the clip, far beyond
the bound the accountant assumes. The state itself is a noise-free
statistic of private data. ``layer_state`` catches such writes in the
model's layers by behaviour; a loss is checked from its graph: its
``call`` is traced on the shapes it first receives, and any op that writes
a variable or a table, at top level or inside its control flow, is refused
(a write that does not depend on the data, such as a counter, too: a loss
has no need for state). A loss that writes state from Python (a
``tf.py_function``, a numpy array) is not seen and must not be trained
privately.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List

import tensorflow as tf

__all__ = ['check_no_state_writes']

# Op types that write a resource: variables, then lookup tables.
_WRITE_OPS = frozenset({
    'Assign', 'AssignAdd', 'AssignSub', 'AssignVariableOp',
    'AssignAddVariableOp', 'AssignSubVariableOp',
    'ResourceStridedSliceAssign'})
_WRITE_PREFIXES = ('ResourceScatter', 'ResourceApply', 'ResourceSparseApply',
                   'LookupTableInsert', 'LookupTableRemove',
                   'LookupTableImport')


def _writes(op_type: str) -> bool:
    return op_type in _WRITE_OPS or op_type.startswith(_WRITE_PREFIXES)


def _written_variables(graph: Any) -> List[str]:
    """Names of the variables that top-level write ops of ``graph`` write
    (those inside control flow are reached through function arguments)."""
    captured: Dict[int, Any] = {id(internal): external
                                for external, internal in graph.captures}
    by_handle = {id(v.handle): v for v in graph.variables}
    names = []
    for op in graph.get_operations():
        if _writes(op.type) and op.inputs:
            variable = by_handle.get(id(captured.get(id(op.inputs[0]))))
            if variable is not None:
                names.append(getattr(variable, 'path', None) or variable.name)
    return names


def check_no_state_writes(fn: Callable[[Any, Any], Any], name: str,
                          y_true: tf.Tensor, y_pred: tf.Tensor) -> None:
    """Refuses the loss ``fn`` if its graph on ``y_true``'s and ``y_pred``'s
    shapes writes a variable or a table (see the module docstring).

    Raises:
      ValueError: naming the loss, the op and the variable where known.
    """
    specs = [tf.TensorSpec.from_tensor(t) for t in (y_true, y_pred)]
    graph = tf.function(fn).get_concrete_function(*specs).graph
    definition = graph.as_graph_def()
    nodes = list(definition.node) + [
        node for function in definition.library.function
        for node in function.node_def]
    writes = sorted({node.op for node in nodes if _writes(node.op)})
    if not writes:
        return
    variables = _written_variables(graph)
    target = (f'variable(s) {variables}' if variables else
              'a variable or table')
    raise ValueError(
        f'Loss {name} writes state in its call ({", ".join(writes)} into '
        f'{target}): state written from the data carries one example into '
        'the losses and gradients of others and of later steps, beyond the '
        'clipping bound, and is itself a noise-free statistic of private '
        'data. A per-example loss must depend on its own example only: '
        'compute such a statistic from PUBLIC data and give it as a '
        'constant, or do not update it in call().')
