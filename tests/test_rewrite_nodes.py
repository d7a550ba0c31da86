"""Nodes the exporter rewrites into more than one node, or finds in subgraphs.

MatMuls in If/Loop/Scan bodies (nested), Gemm biases that stay an Add (scaled by beta),
fp16/bf16 models behind Casts, a stray opset import of our domain, and scale rules, the
compute attribute and mixed precision on all of these.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cim_int4.exporter import export_with_summary, quantize_weight
from cim_int4.exporter.subgraph import all_graphs
from conftest import attribute_scales, check, dequantized_model, init, model_of, w
from onnx import TensorProto, helper, numpy_helper

from cim_int4 import from_matmulnbits, make_session
from cim_int4.bench import quantize_nbits
from cim_int4.contract import OP_DOMAIN, OP_TYPE, OP_VERSION
from cim_int4.validate import compare

K, N, M = 64, 48, 3
F32, F16, BF16 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16


def x(seed: int = 9, *shape: int, dtype=np.float32) -> np.ndarray:  # noqa: ANN001
    return w(seed, *(shape or (M, K)), dtype=dtype)


# ---------------------------------------------------------------- 2. subgraphs


def vi(name: str, elem: int, shape: list | None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def subgraph_model() -> onnx.ModelProto:
    """If(then: MatMul on an outer weight; else: Loop whose body has its own weight) and a Scan on the outer one."""
    then_branch = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w_outer"], ["then_y"], name="mm")], "then", [], [vi("then_y", F32, None)]
    )
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("MatMul", ["state", "w_body"], ["state_out"], name="body_mm"),
        ],
        "body",
        [vi("i", TensorProto.INT64, []), vi("cond_in", TensorProto.BOOL, []), vi("state", F32, None)],
        [vi("cond_out", TensorProto.BOOL, []), vi("state_out", F32, None)],
        [init("w_body", w(2, K, K) / 8)],
    )
    loop = helper.make_node("Loop", ["trips", "", "x"], ["else_y"], name="loop", body=body)
    else_branch = helper.make_graph([loop], "else", [], [vi("else_y", F32, None)])
    scan_body = helper.make_graph(
        [helper.make_node("MatMul", ["row", "w_outer"], ["row_y"], name="scan_mm")],
        "scan_body",
        [vi("row", F32, [M, K])],
        [vi("row_y", F32, [M, K])],
    )
    nodes = [
        helper.make_node("If", ["cond"], ["y"], name="cond_1", then_branch=then_branch, else_branch=else_branch),
        helper.make_node("Scan", ["xs"], ["z"], name="scan", body=scan_body, num_scan_inputs=1),
    ]
    graph = helper.make_graph(
        nodes,
        "subgraphs",
        [vi("x", F32, [M, K]), vi("cond", TensorProto.BOOL, []), vi("xs", F32, [2, M, K])],
        [vi("y", F32, [M, K]), vi("z", F32, [2, M, K])],
        [init("w_outer", w(1, K, K)), init("trips", np.array(2, np.int64))],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_matmuls_in_if_loop_and_scan_bodies_are_quantized() -> None:
    model = subgraph_model()
    q, summary = export_with_summary(model)
    lines = summary.format().splitlines()
    for where in (
        "If 'cond_1'/then_branch/MatMul 'mm'",
        "If 'cond_1'/else_branch/Loop 'loop'/body/MatMul 'body_mm'",
        "Scan 'scan'/body/MatMul 'scan_mm'",
    ):
        assert any(line.startswith(f"  quantized {where}: K=64 N=64") for line in lines), summary.format()
    assert len(summary.rewritten) == 3 and not summary.skipped
    assert [(o.domain, o.version) for o in q.opset_import] == [("", 17), (OP_DOMAIN, OP_VERSION)]
    assert [t.name for t in q.graph.initializer] == ["trips"], "the outer weight is unused now"
    for cond in (True, False):
        check(model, q, {"x": x(), "cond": np.array(cond), "xs": x(4, 2, M, K)})


def test_subgraph_matmul_on_a_computed_operand_is_listed_as_skipped() -> None:
    model = subgraph_model()
    scan_mm = model.graph.node[1].attribute[0].g.node[0]
    scan_mm.input[1] = "row"  # row x row: activation x activation, inside a body
    _, summary = export_with_summary(model)
    (skipped,) = summary.skipped
    assert skipped.path == "Scan 'scan'/body/" and skipped.name == "scan_mm"
    assert skipped.reason == "both operands are computed (activation x activation)"


# ---------------------------------------------------------------- 3. Gemm biases that stay an Add


def gemm_model(c_source: str, beta: float, elem: int = F32) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Gemm(x, B, C) with C from ``c_source``: 'input' [M, N], 'constant' [M, N], 'identity' [N], 'relu' of [N]."""
    dtype = helper.tensor_dtype_to_np_dtype(elem)
    nodes, inits = [], [init("B", w(0, N, K, dtype=dtype))]
    inputs, feeds = [("x", [M, K])], {"x": x(dtype=dtype)}
    c = "C"
    if c_source == "input":
        inputs.append(("C", [M, N]))
        feeds["C"] = w(5, M, N, dtype=dtype)
    elif c_source == "constant":
        inits.append(init("C", w(5, M, N, dtype=dtype)))
    else:
        inits.append(init("c0", w(5, N, dtype=dtype)))
        nodes.append(helper.make_node("Identity" if c_source == "identity" else "Relu", ["c0"], ["C"], name="c"))
    nodes.append(helper.make_node("Gemm", ["x", "B", c], ["y"], name="g", transB=1, alpha=0.5, beta=beta))
    return model_of(nodes, inputs, [("y", [M, N])], inits, elem=elem), feeds


@pytest.mark.parametrize(
    ("c_source", "beta", "ops"),
    [
        ("input", 1.0, [OP_TYPE, "Add"]),
        ("input", 0.5, ["Mul", OP_TYPE, "Add"]),
        ("constant", 2.0, [OP_TYPE, "Add"]),
        ("relu", 1.0, ["Relu", OP_TYPE, "Add"]),
        ("identity", 2.0, [OP_TYPE]),  # folds into the op's bias attribute
    ],
)
def test_gemm_bias_stays_an_add_when_it_cannot_fold(c_source: str, beta: float, ops: list[str]) -> None:
    model, feeds = gemm_model(c_source, beta)
    q, summary = export_with_summary(model)
    (r,) = summary.rewritten
    assert [n.op_type for n in q.graph.node] == ops
    assert ("kept as an Add" in r.notes) == ("Add" in ops)
    check(model, q, feeds)


def test_fp16_gemm_with_an_input_bias() -> None:
    model, feeds = gemm_model("input", 0.5, elem=F16)
    q, _ = export_with_summary(model)
    assert [n.op_type for n in q.graph.node] == ["Cast", "Mul", OP_TYPE, "Cast", "Add"]
    check(model, q, feeds, rtol=2e-3)


# ---------------------------------------------------------------- 4. fp16 and bf16 behind Casts


def test_fp16_matmuls_share_one_cast_of_their_input() -> None:
    nodes = [
        helper.make_node("MatMul", ["x", "wq"], ["q"], name="q_proj"),
        helper.make_node("MatMul", ["x", "wk"], ["k"], name="k_proj"),
    ]
    inits = [init("wq", w(0, K, N, dtype=np.float16)), init("wk", w(1, K, N, dtype=np.float16))]
    model = model_of(nodes, [("x", ["M", K])], [("q", ["M", N]), ("k", ["M", N])], inits, elem=F16)
    q, summary = export_with_summary(model)
    assert [n.op_type for n in q.graph.node] == ["Cast", OP_TYPE, "Cast", OP_TYPE, "Cast"]
    assert all("FLOAT16, Cast to FLOAT around the op" in r.notes for r in summary.rewritten)
    assert summary.bytes_before == 2 * K * N * 2, "the weight bytes before are the fp16 bytes"
    check(model, q, {"x": x(dtype=np.float16)}, rtol=2e-3)


@pytest.mark.parametrize("elem", [F16, F32])
def test_validate_sees_through_the_exporters_casts_transpose_and_add(elem: int) -> None:
    model, feeds = gemm_model("input", 0.5, elem=elem)
    gemm = model.graph.node[0]
    if elem == F32:  # transA=1: the op reads a Transpose of x
        gemm.attribute.append(helper.make_attribute("transA", 1))
        model.graph.input[0].CopyFrom(helper.make_tensor_value_info("x", F32, [K, M]))
        feeds["x"] = np.ascontiguousarray(feeds["x"].T)
    model.graph.node.append(helper.make_node("Relu", ["y"], ["r"], name="relu"))
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("r", elem, [M, N]))
    q, _ = export_with_summary(model)
    report = compare(model, q, feeds, threads=1)
    assert [r.name for r in report.rows] == ["y", "r"], "the op's own output is internal; y follows the Cast and Add"
    assert report.first_divergent is None and len(report.layers) == 1
    assert report.layers[0].code_steps is not None and report.layers[0].code_steps <= 0.5 + 1e-6
    assert all(r.cosine > 0.98 for r in report.rows)


def test_bf16_weight_is_quantized_from_its_values() -> None:
    bf16 = helper.tensor_dtype_to_np_dtype(BF16)
    weight = w(0, K, N).astype(bf16)
    nodes = [
        helper.make_node("Cast", ["x"], ["xb"], to=BF16),
        helper.make_node("MatMul", ["xb", "wb"], ["yb"], name="mm"),
        helper.make_node("Cast", ["yb"], ["y"], to=F32),
    ]
    model = model_of(nodes, [("x", [M, K])], [("y", [M, N])], [init("wb", weight)])
    q, _ = export_with_summary(model)
    assert [n.op_type for n in q.graph.node] == ["Cast", "Cast", OP_TYPE, "Cast", "Cast"]
    feeds = {"x": x()}
    got = make_session(q, threads=1).run(["y"], feeds)[0]
    twin = ort.InferenceSession(dequantized_model(q).SerializeToString()).run(["y"], feeds)[0]
    np.testing.assert_array_equal(got, twin)  # both round the float32 product to bf16 the same way
    exact = feeds["x"].astype(bf16).astype(np.float64) @ weight.astype(np.float64)
    assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < 0.2


def test_float64_weight_is_skipped_with_its_type() -> None:
    model = model_of(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        [("x", [M, K])],
        [("y", [M, N])],
        [init("w", w(0, K, N, dtype=np.float64))],
        elem=TensorProto.DOUBLE,
    )
    with pytest.raises(Exception, match="DOUBLE; only FLOAT, FLOAT16 and BFLOAT16"):
        export_with_summary(model)


# ---------------------------------------------------------------- 5. a stray opset import of our domain


def plain_model() -> onnx.ModelProto:
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
    return model_of(nodes, [("x", [M, K])], [("y", [M, N])], [init("w", w(0, K, N))])


def test_stray_opset_import_without_nodes_is_dropped() -> None:
    model = plain_model()
    model.opset_import.append(helper.make_opsetid(OP_DOMAIN, 1000))  # as ORT's transformers optimizer leaves it
    q, summary = export_with_summary(model)
    assert [(o.domain, o.version) for o in q.opset_import] == [("", 17), (OP_DOMAIN, OP_VERSION)]
    assert summary.warnings == [f"ignored opset import {OP_DOMAIN!r} v1000: no node uses it (dropped)"]
    check(model, q, {"x": x()})


def test_opset_import_of_another_version_with_nodes_is_an_error() -> None:
    model = plain_model()
    model.opset_import.append(helper.make_opsetid(OP_DOMAIN, 1000))
    model.graph.node.append(helper.make_node(OP_TYPE, ["x"], ["z"], name="old", domain=OP_DOMAIN))
    with pytest.raises(ValueError, match="at version 1000 and has nodes in it"):
        export_with_summary(model)


def test_opset_import_of_our_version_with_nodes_stays() -> None:
    once, _ = export_with_summary(plain_model())
    once.graph.node.append(helper.make_node("MatMul", ["y", "w2"], ["y2"], name="mm2"))
    once.graph.initializer.append(init("w2", w(3, N, N)))
    once.graph.output.append(helper.make_tensor_value_info("y2", F32, [M, N]))
    twice, summary = export_with_summary(once)
    assert [r.name for r in summary.rewritten] == ["mm2"] and not summary.warnings
    assert [(o.domain, o.version) for o in twice.opset_import] == [("", 17), (OP_DOMAIN, OP_VERSION)]
    packed = next(a.t for a in twice.graph.node[0].attribute if a.name == "packed")
    assert numpy_helper.to_array(packed).shape == (N, K // 2)


def test_convert_drops_a_stray_opset_import_too() -> None:
    nbits = quantize_nbits(plain_model(), accuracy_level=0)
    nbits.opset_import.append(helper.make_opsetid(OP_DOMAIN, 1000))
    converted = from_matmulnbits(nbits)
    assert [o.version for o in converted.opset_import if o.domain == OP_DOMAIN] == [OP_VERSION]
    assert [n.op_type for n in converted.graph.node] == [OP_TYPE]


# ---------------------------------------------------------------- 6. scale rules, compute and mixed precision


def op_nodes(model: onnx.ModelProto) -> dict[str, dict]:
    """Each CimInt4MatMul of every graph, by name: its attributes as Python values."""
    return {
        n.name: {a.name: helper.get_attribute_value(a) for a in n.attribute}
        for g in all_graphs(model.graph)
        for n in g.node
        if n.op_type == OP_TYPE
    }


@pytest.mark.parametrize("rule", ["amax8", "mse"])
def test_subgraph_and_fp16_weights_use_the_scale_rule_and_compute(rule: str) -> None:
    q, summary = export_with_summary(subgraph_model(), scale_rule=rule, compute="int8")
    weights = {"mm": w(1, K, K), "scan_mm": w(1, K, K), "body_mm": w(2, K, K) / 8}
    nodes = op_nodes(q)
    assert sorted(nodes) == sorted(weights) and f"scale rule {rule}, compute int8" in summary.format()
    for name, weight in weights.items():
        want = quantize_weight(weight, 32, rule).scales
        np.testing.assert_array_equal(attribute_scales(nodes[name]), want)
        assert nodes[name]["compute"] == b"int8"
    wq = w(0, K, N, dtype=np.float16)
    nodes_fp16 = [helper.make_node("MatMul", ["x", "wq"], ["q"], name="q_proj")]
    fp16 = model_of(nodes_fp16, [("x", ["M", K])], [("q", ["M", N])], [init("wq", wq)], elem=F16)
    q16, _ = export_with_summary(fp16, scale_rule=rule)
    want = quantize_weight(wq.astype(np.float32), 32, rule).scales
    np.testing.assert_array_equal(attribute_scales(op_nodes(q16)["q_proj"]), want)


def test_mixed_precision_sees_subgraph_layers() -> None:
    model = subgraph_model()
    feeds = {"x": x(), "cond": np.array(True), "xs": x(4, 2, M, K)}
    q, summary = export_with_summary(model, feeds=feeds, target_cosine=0.9999)
    report = summary.mixed_precision
    keys = {
        "If 'cond_1'/then_branch/mm",
        "If 'cond_1'/else_branch/Loop 'loop'/body/body_mm",
        "Scan 'scan'/body/scan_mm",
    }
    assert {layer.name for layer in report.layers} == keys
    body = next(layer for layer in report.layers if layer.name.endswith("body_mm"))
    assert body.cosine_alone == pytest.approx(1.0, abs=1e-12) and not body.kept, "the else branch does not run"
    kept = {s.path + s.name for s in summary.skipped}
    assert kept == {layer.name for layer in report.layers if layer.kept} and kept
    assert len(summary.rewritten) == 3 - len(kept)
    assert report.cosine_exported == pytest.approx(report.cosine_probe, abs=1e-5) and report.cosine_probe >= 0.9999


def test_mixed_precision_probe_runs_fp16_layers_behind_their_casts() -> None:
    nodes = [
        helper.make_node("MatMul", ["x", "wq"], ["q"], name="q_proj"),
        helper.make_node("Gemm", ["q", "wk"], ["k"], name="k_proj", transB=1),
    ]
    inits = [init("wq", w(0, K, N, dtype=np.float16)), init("wk", w(1, N, N, dtype=np.float16))]
    model = model_of(nodes, [("x", ["M", K])], [("k", ["M", N])], inits, elem=F16)
    feeds = {"x": x(dtype=np.float16)}
    _, summary = export_with_summary(model, feeds=feeds, target_cosine=0.5)
    report = summary.mixed_precision
    assert len(summary.rewritten) == 2 and report.cosine_all_int4 == report.cosine_probe
    assert report.cosine_exported == pytest.approx(report.cosine_probe, abs=1e-3)
