"""exporter.subgraph: walking nested If/Loop bodies, the names they use, and tidying after a rewrite."""

from __future__ import annotations

import numpy as np
from cim_int4.exporter.subgraph import all_graphs, defined_names, drop_unused, subgraphs, used_names, uses_domain
from onnx import TensorProto, helper, numpy_helper


def _model():  # noqa: ANN202
    inner = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w_outer"], ["t"]), helper.make_node("Custom", ["t"], ["u"], domain="my")],
        "then",
        [],
        [helper.make_tensor_value_info("u", TensorProto.FLOAT, None)],
    )
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["v"])], "else", [], [
        helper.make_tensor_value_info("v", TensorProto.FLOAT, None)
    ])
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=inner, else_branch=other)],
        "main",
        [helper.make_tensor_value_info(n, t, None) for n, t in (("c", TensorProto.BOOL), ("x", TensorProto.FLOAT))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.ones((2, 2), np.float32), n) for n in ("w_outer", "unused")],
    )
    return helper.make_model(graph)


def test_subgraphs_and_all_graphs_walk_outer_before_inner() -> None:
    model = _model()
    assert [label for label, _ in subgraphs(model.graph.node[0])] == ["else_branch", "then_branch"]
    names = [g.name for g in all_graphs(model.graph)]
    assert names[0] == "main" and sorted(names[1:]) == ["else", "then"]


def test_names_used_and_defined_include_the_bodies() -> None:
    model = _model()
    assert {"w_outer", "x", "t", "u", "v", "c"} <= used_names(model.graph)
    assert "unused" not in used_names(model.graph)
    assert {"t", "u", "v", "y", "unused"} <= defined_names(model.graph)


def test_uses_domain_looks_inside_bodies() -> None:
    assert uses_domain(_model(), "my") and not uses_domain(_model(), "other")


def test_drop_unused_removes_unread_initializers_only() -> None:
    model = _model()
    drop_unused(model.graph, folded=set(), folded_inputs=set())
    assert [t.name for t in model.graph.initializer] == ["w_outer"]
