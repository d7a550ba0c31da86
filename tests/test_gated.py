"""Gated MLPs: the op's ``gated`` attribute on every kernel path, its checks, and the exporter's fusion."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cim_int4.exporter import ExportOptions, export_int4, quantize_weight
from cim_int4.ops import reference
from conftest import KERNEL_ENV, available_kernels, init, model_of, op_attributes, op_model, random_weight, w
from onnx import TensorProto, helper

from cim_int4 import make_session
from cim_int4.contract import GATED_ACTIVATIONS, OP_DOMAIN, Int4Node, is_op_node, pack

KERNELS = available_kernels()
ULPS_OF_MAGNITUDE = 2.0**-22  # four float32 ulps of a dot product's magnitude


def gated_weight(k: int, h: int, group_size: int = 32, bits: int = 4, scale_dtype: str = "float32", seed: int = 0):
    """The attribute form of a gated node: gate's h channels, then up's h channels, in one QuantizedWeight."""
    rng = np.random.default_rng(seed)
    return quantize_weight(random_weight(rng, k, 2 * h) * 0.05, group_size, bits=bits, scale_dtype=scale_dtype)


def expected(a: np.ndarray, qw, bias, compute: str, activation: str) -> tuple[np.ndarray, np.ndarray]:
    """The gated output of the reference and the bound a kernel must stay within."""
    full = reference.emulate(a, qw.packed, qw.scales, qw.k, qw.group_size, bias, compute, qw.bits).astype(np.float64)
    absw = np.abs(reference.dequantize(qw.packed, qw.scales, qw.k, qw.group_size, qw.bits))
    bound = ULPS_OF_MAGNITUDE * (np.abs(a.astype(np.float64)) @ absw) + 2.0**-23 * np.abs(full)
    return reference.gated(full, activation), reference.gated_bound(full, bound, activation)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("compute", ["fp32", "int8"])
@pytest.mark.parametrize("activation", GATED_ACTIVATIONS)
@pytest.mark.parametrize(("k", "h"), [(64, 7), (100, 40), (256, 129), (576, 192)])
def test_gated_op_matches_the_reference(
    kernel: str, compute: str, activation: str, k: int, h: int, monkeypatch
) -> None:
    rng = np.random.default_rng(k + h)
    qw = gated_weight(k, h, seed=k)
    bias = rng.standard_normal(2 * h).astype(np.float32) if h == 40 else None
    monkeypatch.setenv(KERNEL_ENV, kernel)
    attrs = op_attributes(qw, bias, gated=activation, compute=compute)
    shapes = [(1,), (3,), (64,), (2, 5)]
    model = op_model(attrs, [[*(f"d{i}" for i in range(len(s))), k] for s in shapes])
    inputs = [rng.standard_normal((*s, k), dtype=np.float32) * 4 for s in shapes]
    feeds = {f"A{i}": a for i, a in enumerate(inputs)}
    ys = make_session(model, threads=1).run(None, feeds)
    for a, y in zip(inputs, ys, strict=True):
        assert y.shape == (*a.shape[:-1], h) and y.dtype == np.float32
        want, bound = expected(a, qw, bias, compute, activation)
        err = np.abs(y - want)
        assert (err <= bound).all(), f"{a.shape}: max excess {(err - bound).max():.3g}"
    # Each output is computed by one thread whatever the split.
    for y, y2 in zip(ys, make_session(model, threads=2).run(None, feeds), strict=True):
        assert y.tobytes() == y2.tobytes()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(("bits", "scale_dtype"), [(3, "float16"), (8, "float32"), (4, "float16")])
def test_gated_op_at_other_widths_and_float16_scales(kernel: str, bits: int, scale_dtype: str, monkeypatch) -> None:
    rng = np.random.default_rng(bits)
    qw = gated_weight(128, 48, bits=bits, scale_dtype=scale_dtype)
    monkeypatch.setenv(KERNEL_ENV, kernel)
    attrs = op_attributes(qw, gated="silu", bits=bits)
    a = rng.standard_normal((5, 128), dtype=np.float32)
    (y,) = make_session(op_model(attrs, [[5, 128]]), threads=1).run(None, {"A0": a})
    want, bound = expected(a, qw, None, "fp32", "silu")
    assert (np.abs(y - want) <= bound).all()


def test_the_gate_is_not_the_identity() -> None:
    # The control of the bound above: the plain product's gate half is far outside it.
    qw = gated_weight(64, 16)
    a = np.random.default_rng(1).standard_normal((4, 64), dtype=np.float32) * 4
    (y,) = make_session(op_model(op_attributes(qw, gated="silu"), [[4, 64]]), threads=1).run(None, {"A0": a})
    want, bound = expected(a, qw, None, "fp32", "silu")
    plain = reference.emulate(a, qw.packed, qw.scales, 64, 32)[:, :16]
    assert (np.abs(plain - want) > 10 * bound).mean() > 0.9
    assert (np.abs(y - want) <= bound).all()


def test_nan_in_the_gate_stays_nan() -> None:
    qw = gated_weight(32, 16)
    a = np.ones((1, 32), dtype=np.float32)
    a[0, 3] = np.nan
    (y,) = make_session(op_model(op_attributes(qw, gated="silu"), [[1, 32]]), threads=1).run(None, {"A0": a})
    assert np.isnan(y).all()


@pytest.mark.parametrize("kernel", KERNELS)
def test_overflowing_gates_follow_the_formula_on_every_path(kernel: str, monkeypatch) -> None:
    # Gate products far below exp's range: act(g) = g / (1 + exp(-t)) is -0 (finite g) or NaN
    # (g = -inf) on every path, as in the reference, not g / exp(clamped t).
    monkeypatch.setenv(KERNEL_ENV, kernel)
    q = np.concatenate([np.full((8, 32), -1), np.full((8, 32), 1)])  # gate channels -sum(a), up +sum(a)
    packed = pack(q)
    scales = np.ones((16, 1), np.float32)
    rows = np.array([np.full(32, 1e18), np.full(32, 3e37), np.full(32, 1e3)], dtype=np.float32)
    for activation in GATED_ACTIVATIONS:
        attrs = op_attributes(quantize_weight(np.zeros((32, 16), np.float32), 32), packed=packed, scales=scales,
                              gated=activation)  # fmt: skip
        (y,) = make_session(op_model(attrs, [[3, 32]]), threads=1).run(None, {"A0": rows})
        with np.errstate(over="ignore"):  # row 1's sums overflow to -inf, as the op's do
            g = reference.emulate(rows, packed, scales, 32, 32)[:, :8]
        want = reference.gate(g, -g, activation)
        assert np.isinf(g[1]).all() and np.isnan(want[1]).all() and (want[0] == 0).all()
        assert (y[0] == 0).all() and np.isnan(y[1]).all(), (activation, y[:2, :2])
        np.testing.assert_allclose(y[2], want[2], rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    ("overrides", "attribute", "message"),
    [
        (dict(gated="relu"), "gated", "expected one of"),
        (dict(gated=""), "gated", "expected one of"),
        (dict(gated=3), "gated", ""),
        (dict(N=None), "N", ""),
    ],
    ids=["unknown activation", "empty", "an int", "N missing"],
)
def test_bad_gated_attribute_is_refused_naming_it(overrides: dict, attribute: str, message: str) -> None:
    qw = gated_weight(64, 8)
    model = op_model(op_attributes(qw, **{"gated": "silu", **overrides}), [["M", 64]])
    with pytest.raises(Exception, match=f"attribute '{attribute}'.*{message}"):
        make_session(model, threads=1)
    with pytest.raises(ValueError, match=f"attribute '{attribute}'"):
        Int4Node.from_node(model.graph.node[0])


def test_odd_n_is_refused() -> None:
    qw = quantize_weight(random_weight(np.random.default_rng(0), 64, 7), 32)
    model = op_model(op_attributes(qw, gated="silu"), [["M", 64]])
    with pytest.raises(Exception, match="attribute 'N' is 7, expected an even N"):
        make_session(model, threads=1)
    with pytest.raises(ValueError, match="attribute 'N' is 7, expected an even N"):
        Int4Node.from_node(model.graph.node[0])


def test_gated_node_with_table_inputs_is_refused() -> None:
    qw = gated_weight(64, 8)
    node = helper.make_node("CimInt4MatMul", ["A", "P", "S"], ["Y"], name="g", domain=OP_DOMAIN, K=64, N=16,
                            gated="silu")  # fmt: skip
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], [init("P", qw.packed), init("S", qw.scales)],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(OP_DOMAIN, 1)])
    model.ir_version = 8
    with pytest.raises(Exception, match="attribute 'gated'; a gated node takes attributes"):
        make_session(model, threads=1)


def test_shape_inference_gives_half_the_channels() -> None:
    qw = gated_weight(64, 24)
    sess = make_session(op_model(op_attributes(qw, gated="gelu_tanh"), [["M", 64]]), threads=1)
    assert sess.get_outputs()[0].shape[-1] == 24


# ---------------------------------------------------------------- the exporter's fusion

K, H = 64, 96


def mlp_model(activation: str, extra: str | None = None) -> onnx.ModelProto:
    """x -> down(act(x @ Wg) * (x @ Wu)) with ``activation`` as ONNX writes it; ``extra`` breaks the pattern."""
    nodes = [
        helper.make_node("MatMul", ["x", "wg"], ["g"], name="gate"),
        helper.make_node("MatMul", ["x" if extra != "other input" else "x2", "wu"], ["u"], name="up"),
    ]
    opset = 17
    if activation == "sigmoid":
        nodes += [helper.make_node("Sigmoid", ["g"], ["s"]), helper.make_node("Mul", ["s", "g"], ["a"])]
    elif activation == "quickgelu":
        alpha = {"alpha": dict(alpha=1.702), "no alpha": {}}.get(extra, dict(alpha=1.0))  # absent: 1.702 in ORT
        nodes.append(helper.make_node("QuickGelu", ["g"], ["a"], domain="com.microsoft", **alpha))
    elif activation == "gelu":
        opset = 20
        approximate = "none" if extra == "erf" else "tanh"
        nodes.append(helper.make_node("Gelu", ["g"], ["a"], approximate=approximate))
    elif activation == "fastgelu":
        nodes.append(helper.make_node("FastGelu", ["g"], ["a"], domain="com.microsoft"))
    nodes += [
        helper.make_node("Mul", ["u", "a"], ["m"]),
        helper.make_node("MatMul", ["m", "wd"], ["y"], name="down"),
    ]
    outputs = [("y", ["M", K])]
    if extra == "gate read elsewhere":
        nodes.append(helper.make_node("Neg", ["g"], ["ng"]))
        outputs.append(("ng", ["M", H]))
    inputs = [("x", ["M", K])] + ([("x2", ["M", K])] if extra == "other input" else [])
    model = model_of(
        nodes, inputs, outputs, [init("wg", w(1, K, H) * 0.2), init("wu", w(2, K, H) * 0.2), init("wd", w(3, H, K))],
        opset=opset,
    )
    if activation in ("quickgelu", "fastgelu"):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    if any(is_op_node(n) for n in model.graph.node):
        return make_session(model, threads=1).run(["y"], feeds)[0]
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(["y"], feeds)[0]


@pytest.mark.parametrize(
    ("activation", "gated"),
    [("sigmoid", "silu"), ("quickgelu", "silu"), ("gelu", "gelu_tanh"), ("fastgelu", "gelu_tanh")],
)
def test_export_fuses_a_gated_mlp_into_one_node(activation: str, gated: str) -> None:
    model = mlp_model(activation)
    fused = export_int4(model, quiet=True)
    apart = export_int4(model, quiet=True, fuse_gated=False)
    ops = [n.op_type for n in fused.graph.node]
    assert ops == ["CimInt4MatMul", "CimInt4MatMul"], ops
    node = Int4Node.from_node(fused.graph.node[0])
    assert (node.gated, node.n, node.outputs_n, node.outputs) == (gated, 2 * H, H, ("m",))
    assert sum(is_op_node(n) for n in apart.graph.node) == 3 and len(apart.graph.node) > 3
    # The same codes, stacked: the fused node's output is the unfused graph's up to the activation's rounding.
    halves = [Int4Node.from_node(n) for n in apart.graph.node if is_op_node(n)][:2]
    assert np.array_equal(node.packed, np.concatenate([h.packed for h in halves]))
    assert np.array_equal(node.scales, np.concatenate([h.scales for h in halves]))
    feeds = {"x": np.random.default_rng(0).standard_normal((5, K), dtype=np.float32)}
    y_fused, y_apart, y_fp32 = run(fused, feeds), run(apart, feeds), run(model, feeds)
    np.testing.assert_allclose(y_fused, y_apart, rtol=1e-4, atol=1e-4 * np.abs(y_apart).max())
    assert np.linalg.norm(y_fused - y_fp32) / np.linalg.norm(y_fp32) < 0.2


@pytest.mark.parametrize(
    ("activation", "extra"),
    [
        ("gelu", "erf"),
        ("quickgelu", "alpha"),
        ("quickgelu", "no alpha"),
        ("sigmoid", "gate read elsewhere"),
        ("sigmoid", "other input"),
    ],
)
def test_export_leaves_other_patterns_apart(activation: str, extra: str) -> None:
    model = mlp_model(activation, extra)
    feeds = {"x": np.random.default_rng(0).standard_normal((5, K), dtype=np.float32)}
    if extra == "other input":
        feeds["x2"] = np.random.default_rng(1).standard_normal((5, K), dtype=np.float32)
    q = export_int4(model, quiet=True)
    assert sum(is_op_node(n) for n in q.graph.node) == 3
    assert not any(Int4Node.from_node(n).gated for n in q.graph.node if is_op_node(n))
    y, y_fp32 = run(q, feeds), run(model, feeds)
    assert np.linalg.norm(y - y_fp32) / np.linalg.norm(y_fp32) < 0.2


def test_halves_at_different_widths_stay_apart() -> None:
    q = export_int4(mlp_model("sigmoid"), quiet=True, bits={"gate": 8})
    nodes = [Int4Node.from_node(n) for n in q.graph.node if is_op_node(n)]
    assert [(n.name, n.bits, n.gated) for n in nodes] == [("gate", 8, None), ("up", 4, None), ("down", 4, None)]


def test_a_half_left_fp32_leaves_the_other_alone() -> None:
    q = export_int4(mlp_model("sigmoid"), quiet=True, exclude=("up",))
    assert [n.name for n in q.graph.node if is_op_node(n)] == ["gate", "down"]
    assert [n.op_type for n in q.graph.node].count("MatMul") == 1


def test_streamed_export_to_a_file_fuses_the_same(tmp_path) -> None:
    src = tmp_path / "mlp.onnx"
    onnx.save(mlp_model("sigmoid"), src)
    out = tmp_path / "int4.onnx"
    export_int4(src, out, ExportOptions(external_data=True), quiet=True)
    from_file = onnx.load(out)
    in_memory = export_int4(mlp_model("sigmoid"), quiet=True)
    for a, b in zip(from_file.graph.node, in_memory.graph.node, strict=True):
        assert Int4Node.from_node(a).gated == Int4Node.from_node(b).gated
        assert np.array_equal(Int4Node.from_node(a).packed, Int4Node.from_node(b).packed)
    assert not {v.name for v in from_file.graph.value_info} & {"g", "u", "s", "a"}


def test_summary_counts_the_fused_mlps(capsys) -> None:
    export_int4(mlp_model("gelu"), quiet=False)
    assert "gated MLPs: 1 fused" in capsys.readouterr().out


def test_matmulnbits_conversion_fuses_the_same() -> None:
    from cim_int4.exporter.convert import convert_with_summary

    from cim_int4.bench.variants import quantize_nbits

    nbits = quantize_nbits(mlp_model("quickgelu"), 4)
    fused, summary = convert_with_summary(nbits)
    apart, _ = convert_with_summary(nbits, fuse_gated=False)
    assert len(summary.gated) == 1 and "gated MLPs: 1 fused" in summary.format()
    nodes = [Int4Node.from_node(n) for n in fused.graph.node if is_op_node(n)]
    assert [(n.gated, n.n) for n in nodes] == [("silu", 2 * H), (None, K)]
    assert len(fused.graph.node) == 2 and len(apart.graph.node) == 5
    feeds = {"x": np.random.default_rng(0).standard_normal((5, K), dtype=np.float32)}
    y_fused, y_apart = run(fused, feeds), run(apart, feeds)
    np.testing.assert_allclose(y_fused, y_apart, rtol=1e-4, atol=1e-4 * np.abs(y_apart).max())


def test_conversion_leaves_the_models_own_int4_nodes_alone() -> None:
    # gate and up already CimInt4MatMul (a --no-fuse-gated output) beside a MatMulNBits down:
    # the conversion fuses only what it converted, so the pair stays two nodes.
    from cim_int4.exporter.convert import convert_with_summary

    from cim_int4.bench.variants import quantize_nbits

    nbits = quantize_nbits(mlp_model("sigmoid"), 4)
    mixed, _ = convert_with_summary(nbits, fuse_gated=False)
    down = next(i for i, n in enumerate(mixed.graph.node) if n.output[0] == "y")
    original = next(n for n in nbits.graph.node if n.op_type == "MatMulNBits" and n.output[0] == "y")
    mixed.graph.node[down].CopyFrom(original)
    mixed.graph.initializer.extend(t for t in nbits.graph.initializer if t.name in original.input)
    again, summary = convert_with_summary(mixed)
    assert summary.gated == [] and [c.name for c in summary.converted] == [original.name]
    assert not any(Int4Node.from_node(n).gated for n in again.graph.node if is_op_node(n))


def test_validate_checks_a_gated_node_against_both_fp32_projections() -> None:
    import cim_int4

    fp32 = mlp_model("sigmoid")
    q = export_int4(fp32, quiet=True)
    report = cim_int4.compare(fp32, q, dims={"M": 3})
    fused = next(layer for layer in report.layers if layer.output == "m")
    assert fused.kernel_ok and fused.code_steps is not None and fused.code_steps <= 0.5 + 1e-3
    # The up half's codes swapped for the gate's: the kernel computes what the file says, the
    # weights no longer round the FP32 ones.
    node = Int4Node.from_node(q.graph.node[0])
    swapped = np.concatenate([node.packed[H:], node.packed[:H]])
    q.graph.node[0].CopyFrom(dataclasses.replace(node, packed=swapped).to_node())
    bad = next(layer for layer in cim_int4.compare(fp32, q, dims={"M": 3}).layers if layer.output == "m")
    assert bad.kernel_ok and bad.code_steps > 1.5
