"""int8 group scales with float16 super-scales: the contract's encoding byte for byte, exports that
write it (plain, gated, tied tables), and the one-line errors. The op on every kernel path:
tests/test_widths_op.py (scale dtype ``i8``) and kernel_test."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from cim_int4.exporter import export_with_summary, quantize_weight
from cim_int4.exporter.gptq import gptq_quantize, weighted_error
from cim_int4.exporter.widths import bits_per_weight
from conftest import check, init, model_of, w
from onnx import TensorProto, helper, numpy_helper

from cim_int4 import make_session
from cim_int4.contract import (
    GATHER_OP_TYPE,
    INT8_SCALE_ONE,
    OP_DOMAIN,
    OP_TYPE,
    SUPER_GROUPS,
    Int4Node,
    encode_int8_scales,
    int8_scales,
    scale_values,
)


def test_scale_values_are_q_times_the_super_scale_over_128_pinned() -> None:
    # Nine groups: two super-blocks (8 + 1); d = 2.0 and -0.5 in float16.
    q = np.array([[127, -128, 0, 1, 64, -1, 2, 3, 5]], np.int8)
    d = np.array([[2.0, -0.5]], np.float16)
    values = scale_values(q, d)
    assert values.dtype == np.float32
    np.testing.assert_array_equal(values[0, :8], q[0, :8].astype(np.float32) * 2.0 / 128)
    assert values[0, 8] == np.float32(5 * -0.5 / 128)
    assert SUPER_GROUPS == 8 and INT8_SCALE_ONE == 128


def test_int8_scales_round_scales_to_a_fraction_of_their_super_block_largest() -> None:
    rng = np.random.default_rng(0)
    s = (rng.standard_normal((6, 19)) * 0.01).astype(np.float32)
    s[2, 8:16] = 0  # an all-zero super-block: d = 0, q = 0
    q, d = int8_scales(s)
    assert q.dtype == np.int8 and d.dtype == np.float16 and d.shape == (6, 3)
    assert np.abs(q).max() <= 127 and np.abs(q).max() >= 126  # the largest of a block is about 127 / 128 of d
    assert d[2, 1] == 0 and not q[2, 8:16].any()
    values = scale_values(q, d)
    # Half a step of d / 128 at most, i.e. 0.4% of the block's largest scale.
    step = np.repeat(np.abs(d.astype(np.float32)), SUPER_GROUPS, axis=1)[:, :19] / 128
    assert (np.abs(values - s) <= 0.5 * step * (1 + 1e-3) + 1e-12).all()
    np.testing.assert_array_equal(encode_int8_scales(values, d), q)


def test_int8_scales_refuse_super_scales_float16_cannot_hold() -> None:
    assert int8_scales(np.array([[1e5, 1.0]], np.float32)) is None


def test_a_node_writes_int8_scales_and_reads_back_the_same_values() -> None:
    qw = quantize_weight(w(0, 300, 20), 32, "signed", 4, "int8")
    assert qw.super_scales is not None and qw.scales.dtype == np.float32
    node = Int4Node("n", ("x",), ("y",), qw.k, qw.n, 32, qw.packed, qw.scales, super_scales=qw.super_scales).to_node()
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    stored = numpy_helper.to_array(attrs["scales"])
    assert stored.dtype == np.int8 and stored.shape == (20, 10)
    assert numpy_helper.to_array(attrs["super_scales"]).dtype == np.float16
    assert numpy_helper.to_array(attrs["super_scales"]).shape == (20, 2)
    back = Int4Node.from_node(node)
    np.testing.assert_array_equal(back.scales, qw.scales)
    np.testing.assert_array_equal(back.super_scales, qw.super_scales)
    # Bytes per token: codes, one byte a scale, two per super-scale.
    assert back.nbytes == qw.packed.nbytes + 20 * 10 + 20 * 2 * 2 == qw.nbytes


def test_values_that_are_not_int8_multiples_are_refused_naming_the_node() -> None:
    qw = quantize_weight(w(0, 64, 8), 32, "signed", 4, "int8")
    bad = qw.scales.copy()
    bad[1, 1] *= 1.001
    node = Int4Node("odd", ("x",), ("y",), 64, 8, 32, qw.packed, bad, super_scales=qw.super_scales)
    with pytest.raises(ValueError, match="node 'odd': scales are not int8 multiples"):
        node.to_node()


def _with_attribute(node: onnx.NodeProto, name: str, value: np.ndarray | None) -> onnx.NodeProto:
    out = onnx.NodeProto()
    out.CopyFrom(node)
    keep = [a for a in out.attribute if a.name != name]
    del out.attribute[:]
    out.attribute.extend(keep)
    if value is not None:
        out.attribute.append(helper.make_attribute(name, numpy_helper.from_array(value, name)))
    return out


def test_from_node_names_int8_scale_problems_in_one_line() -> None:
    qw = quantize_weight(w(0, 64, 8), 32, "signed", 4, "int8")
    node = Int4Node("n", ("x",), ("y",), 64, 8, 32, qw.packed, qw.scales, super_scales=qw.super_scales).to_node()
    with pytest.raises(ValueError, match="node 'n': attribute 'super_scales' is missing"):
        Int4Node.from_node(_with_attribute(node, "super_scales", None))
    with pytest.raises(ValueError, match="'super_scales' is for int8 'scales' only"):
        Int4Node.from_node(_with_attribute(node, "scales", qw.scales.astype(np.float16)))
    with pytest.raises(ValueError, match="'super_scales' has shape \\[8, 2\\]"):
        Int4Node.from_node(_with_attribute(node, "super_scales", np.ones((8, 2), np.float16)))
    inf = qw.super_scales.copy()
    inf[3, 0] = np.inf
    with pytest.raises(ValueError, match="'super_scales': \\[3, 0\\] is not finite"):
        Int4Node.from_node(_with_attribute(node, "super_scales", inf))


def test_bits_per_weight_count_the_super_scales() -> None:
    assert bits_per_weight(576, 10, 32, 4, "int8") == pytest.approx(4 + 8 / 32 + 16 * 3 / 576)
    assert bits_per_weight(4096, 10, 32, 4, "int8") == pytest.approx(4 + 8 / 32 + 16 / 256)


# ---------------------------------------------------------------- exports


def mlp() -> onnx.ModelProto:
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"], name="up"),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "W2"], ["y"], name="down")]
    inits = [init("W1", w(1, 320, 256)), init("W2", w(2, 256, 96))]
    return model_of(nodes, [("x", ["b", 320])], [("y", ["b", 96])], inits)


@pytest.mark.parametrize("compute", ["fp32", "int8"])
def test_an_int8_scale_export_runs_and_matches_its_dequantized_twin(compute: str) -> None:
    model = mlp()
    q, summary = export_with_summary(model, scale_dtype="int8", compute=compute)
    half, half_summary = export_with_summary(model, scale_dtype="float16", compute=compute)
    for node in (n for n in q.graph.node if n.op_type == OP_TYPE):
        scales = next(a.t for a in node.attribute if a.name == "scales")
        assert scales.data_type == TensorProto.INT8
    x = {"x": np.random.default_rng(3).standard_normal((5, 320)).astype(np.float32)}
    check(model, q, x, rtol=1e-4 if compute == "fp32" else 2e-2)  # int8 mode also rounds the activations
    # Fewer bytes than float16 scales, at about their accuracy.
    assert summary.bytes_after < half_summary.bytes_after
    a, b, f = (make_session(m, threads=1).run(None, x)[0] for m in (q, half, model))
    err_int8, err_half = (np.linalg.norm(y - f) / np.linalg.norm(f) for y in (a, b))
    assert err_int8 < 1.05 * err_half, (err_int8, err_half)


def gated_model() -> onnx.ModelProto:
    nodes = [helper.make_node("MatMul", ["x", "G"], ["g"], name="gate"),
             helper.make_node("MatMul", ["x", "U"], ["u"], name="upp"),
             helper.make_node("Sigmoid", ["g"], ["sg"]),
             helper.make_node("Mul", ["g", "sg"], ["act"]),
             helper.make_node("Mul", ["act", "u"], ["y"])]
    inits = [init("G", w(4, 288, 64)), init("U", w(5, 288, 64))]
    return model_of(nodes, [("x", ["b", 288])], [("y", ["b", 64])], inits)


def test_a_gated_mlp_fuses_with_int8_scales() -> None:
    model = gated_model()
    q, _ = export_with_summary(model, scale_dtype="int8")
    (node,) = [n for n in q.graph.node if n.op_type == OP_TYPE]
    read = Int4Node.from_node(node)
    assert read.gated == "silu" and read.super_scales is not None and read.super_scales.shape == (128, 2)
    check(model, q, {"x": np.random.default_rng(4).standard_normal((3, 288)).astype(np.float32)})


V, H = 96, 64


def tied_lm() -> onnx.ModelProto:
    nodes = [helper.make_node("Gather", ["table", "ids"], ["h0"], name="embed"),
             helper.make_node("MatMul", ["h0", "W"], ["h1"], name="mlp"),
             helper.make_node("Transpose", ["table"], ["tableT"], perm=[1, 0]),
             helper.make_node("MatMul", ["h1", "tableT"], ["logits"], name="lm_head")]
    graph = helper.make_graph(
        nodes, "lm", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["s"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["s", V])],
        [init("table", w(1, V, H)), init("W", w(2, H, H))],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_tied_table_is_stored_once_with_int8_scales_and_super_scales() -> None:
    model = tied_lm()
    q, _ = export_with_summary(model, scale_dtype="int8")
    (gather,) = [n for n in q.graph.node if n.op_type == GATHER_OP_TYPE and n.domain == OP_DOMAIN]
    head = next(n for n in q.graph.node if n.name == "lm_head")
    assert len(gather.input) == 4 and list(head.input[1:]) == [gather.input[0], gather.input[2], gather.input[3]]
    inits = {t.name: t for t in q.graph.initializer}
    assert inits[gather.input[2]].data_type == TensorProto.INT8
    assert inits[gather.input[3]].data_type == TensorProto.FLOAT16
    check(model, q, {"ids": np.array([0, 5, V - 1, -2], np.int64)})


def calibration_rows(seed: int, rows: int, k: int) -> np.ndarray:
    """Inputs with a few hot channels and a shared component, as a real LLM's (where GPTQ and AWQ gain)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k)) + 0.7 * rng.standard_normal((rows, 1)) * rng.standard_normal(k)
    x[:, rng.choice(k, k // 32, replace=False)] *= 30
    return x.astype(np.float32)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_with_int8_scales_is_round_to_nearest_when_inputs_are_uncorrelated(act_order: bool) -> None:
    # H = I: rounding a column moves nothing else, so GPTQ's int8 scales and codes are RTN's, bit for bit.
    weight = w(6, 300, 24)
    got = gptq_quantize(weight, np.eye(300), 32, "mse", act_order=act_order, scale_dtype="int8")
    want = quantize_weight(weight, 32, "mse", 4, "int8")
    assert got.super_scales is not None and got.super_scales.dtype == np.float16
    for a, b in ((got.packed, want.packed), (got.scales, want.scales), (got.super_scales, want.super_scales)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(("act_order", "bits"), [(False, 4), (True, 4), (True, 3)])
def test_gptq_rounds_against_int8_scales_and_keeps_float16_scales_accuracy(act_order: bool, bits: int) -> None:
    weight = w(7, 200, 48)  # K not a multiple of the group, nor of a super-block: 7 groups, one run
    x = calibration_rows(8, 1024, 200)
    h = x.T.astype(np.float64) @ x
    got = gptq_quantize(weight, h, 32, "mse", act_order=act_order, scale_dtype="int8", bits=bits)
    assert got.super_scales.shape == (48, 1)
    encode_int8_scales(got.scales, got.super_scales)  # every scale is an int8 multiple of its super-scale
    half = gptq_quantize(weight, h, 32, "mse", act_order=act_order, bits=bits)
    rtn = quantize_weight(weight, 32, "mse", bits, "int8")
    e_int8, e_half, e_rtn = (weighted_error(weight, q, h) for q in (got, half, rtn))
    assert e_int8 < 0.8 * e_rtn and e_int8 < 1.05 * e_half, (e_int8, e_half, e_rtn)


def test_gptq_takes_a_runs_super_scale_from_the_weights_as_its_sweep_updated_them() -> None:
    # Input channels 256.. are zero: only the error GPTQ spreads fills their run, so a super-scale from the
    # weights before the sweep (0) would zero it (error 1.82x float16 scales' when that was the rule).
    weight = w(3, 512, 16)
    weight[256:] = 0
    x = calibration_rows(4, 2048, 512)
    h = x.T.astype(np.float64) @ x
    got = gptq_quantize(weight, h, 32, "mse", scale_dtype="int8", act_order=False)
    half = gptq_quantize(weight, h, 32, "mse", act_order=False)
    assert np.all(got.super_scales[:, 1] > 0)
    assert weighted_error(weight, got, h) < 1.15 * weighted_error(weight, half, h)


def test_a_nonzero_scale_never_rounds_to_zero() -> None:
    # 1e-4 is 1/10,000 of its run's largest scale: the nearest int8 multiple is 0, which would zero its group.
    q, d = int8_scales(np.array([[1.0, 1e-4, -1e-4, 0.0]], np.float32))
    np.testing.assert_array_equal(q, [[127, 1, -1, 0]])


@pytest.mark.parametrize("method", ["gptq", "awq", "awq+gptq"])
def test_calibrated_exports_write_int8_scales_and_match_their_dequantized_twin(method: str) -> None:
    model = mlp()
    rows = calibration_rows(9, 256, 320)
    q, _ = export_with_summary(
        model, feeds=[{"x": rows[:128]}, {"x": rows[128:]}], method=method, scale_dtype="int8", compute="fp32"
    )
    nodes = [n for n in q.graph.node if n.op_type == OP_TYPE]
    assert nodes and all(next(a.t for a in n.attribute if a.name == "scales").data_type == TensorProto.INT8
                         for n in nodes)
    check(model, q, {"x": rows[:5]}, rtol=1e-4)


def test_validate_reads_int8_scales_as_their_values(tmp_path) -> None:  # noqa: ANN001
    from cim_int4.cli import main

    model = mlp()
    src, out = tmp_path / "m.onnx", tmp_path / "m.i8.onnx"
    onnx.save(model, src)
    assert main(["export", str(src), "-o", str(out), "--scale-dtype", "int8"]) == 0
    # Every layer alone within its bound and its codes a rounding of the FP32 weight (exit 0),
    # which fails if a check reads the int8 codes of the scales as scales.
    assert main(["validate", str(src), str(out)]) == 0


def test_super_scales_float16_holds_only_coarsely_fall_back_to_float32_scales() -> None:
    # Subnormal float16 super-scales (under ~6e-5) round by more than 2^-9; under ~3e-8 they vanish.
    for std in (5e-6, 5e-8):
        assert int8_scales(np.full((2, 9), std, np.float32)) is None
        qw = quantize_weight(w(0, 288, 4) * np.float32(std), 32, "signed", 4, "int8")
        assert qw.super_scales is None and qw.scales.dtype == np.float32 and np.abs(qw.scales).max() > 0
    assert int8_scales(np.zeros((2, 9), np.float32)) is not None  # all-zero runs: d = 0, q = 0
