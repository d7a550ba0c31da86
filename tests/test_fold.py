"""exporter.fold: which names are export-time constants, and their values read through foldable producers."""

from __future__ import annotations

import numpy as np
import pytest
from cim_int4.exporter.fold import NotFoldable, Scope
from onnx import TensorProto, helper, numpy_helper

W = np.arange(6, dtype=np.float32).reshape(2, 3)


def _graph(nodes: list, inputs: tuple[str, ...] = ("x",), initializers: tuple[str, ...] = ("w",)):  # noqa: ANN202
    return helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(i, TensorProto.FLOAT, None) for i in inputs],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(W, name) for name in initializers],
    )


def test_initializer_behind_transpose_and_identity_folds_with_its_names() -> None:
    nodes = [
        helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
        helper.make_node("Identity", ["wt"], ["wi"]),
        helper.make_node("MatMul", ["x", "wi"], ["y"]),
    ]
    folded = Scope(_graph(nodes)).resolve("wi")
    np.testing.assert_array_equal(folded.value, W.T)
    assert folded.elem_type == TensorProto.FLOAT and set(folded.names) == {"w", "wt", "wi"}


def test_a_graph_input_is_not_constant_and_says_why() -> None:
    scope = Scope(_graph([helper.make_node("MatMul", ["x", "x"], ["y"])]))
    assert not scope.is_constant("x")
    with pytest.raises(NotFoldable):
        scope.resolve("x")
    with pytest.raises(NotFoldable, match="not defined"):
        scope.resolve("nowhere")


def test_overridable_initializer_folds_only_when_asked() -> None:
    graph = _graph([helper.make_node("MatMul", ["x", "w"], ["y"])], inputs=("x", "w"))
    assert Scope(graph, fold_inputs=True).is_constant("w")
    with pytest.raises(NotFoldable, match="also listed as a graph input"):
        Scope(graph, fold_inputs=False).resolve("w")


def test_subgraph_reads_its_parents_constants() -> None:
    parent = Scope(_graph([helper.make_node("MatMul", ["x", "w"], ["y"])]))
    body = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["z"])], "body", [], [])
    child = Scope(body, parent)
    assert child.owner("w") is parent and child.is_constant("w")
    np.testing.assert_array_equal(child.resolve("w").value, W)
