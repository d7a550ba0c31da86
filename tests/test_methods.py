"""Calibrated methods: GPTQ and AWQ against NumPy references, the calibration pass, ``auto``, and their errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cim_int4.exporter import ExportOptions, export_with_summary, quantize_weight
from cim_int4.exporter.awq import apply_scales, find_sites, search
from cim_int4.exporter.calibration import collect, feed_batches, split
from cim_int4.exporter.gptq import gptq_quantize, weighted_error
from cim_int4.exporter.probe import Probe
from cim_int4.exporter.rewrite import node_label
from cim_int4.exporter.scale_rules import group_scales
from cim_int4.exporter.subgraph import all_graphs
from cim_int4.graphs import LlamaConfig, llama_decoder, random_input, single_matmul
from cim_int4.ops.reference import dequantize, unpack
from onnx import helper, numpy_helper

from cim_int4 import make_session
from cim_int4.cli import main
from cim_int4.contract import OP_TYPE
from cim_int4.metrics import row_rel_l2

LLAMA = LlamaConfig(hidden=128, intermediate=256, layers=2, heads=4)


def outlier_rows(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    """Activations like a real LLM's: a few channels 20-50x the rest, and a shared component across channels."""
    x = rng.standard_normal((rows, k))
    x += 0.7 * rng.standard_normal((rows, 1)) * rng.standard_normal(k)
    hot = rng.choice(k, max(1, k // 32), replace=False)
    x[:, hot] *= rng.uniform(20, 50, len(hot))
    return x.astype(np.float32)


def textbook_gptq(
    w: np.ndarray, h: np.ndarray, group: int, rule: str, damp: float, bits: int = 4
) -> tuple[np.ndarray, np.ndarray]:
    """Optimal-brain-quantization sweep as written in the paper: the full inverse Hessian updated after every column.

    Each group's scale by ``rule``, the mse rule weighing channel k's squared error by H[k, k] (at least 1% of
    the mean diagonal), as the exporter's GPTQ does.
    """
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    importance = np.maximum(np.diag(h), 0.01 * np.mean(np.diag(h))).astype(np.float32)
    k, n = w.shape
    wt = w.T.astype(np.float64).copy()
    hinv = np.linalg.inv(h + damp * np.mean(np.diag(h)) * np.eye(k))
    q = np.zeros((n, k))
    scales = np.zeros((n, k // group), np.float32)
    for i in range(k):
        if i % group == 0:
            block = wt[:, None, i : i + group].astype(np.float32)
            scales[:, i // group] = group_scales(block, rule, bits, weights=importance[i : i + group])[:, 0]
        s = scales[:, i // group].astype(np.float64)
        q[:, i] = np.clip(np.rint(wt[:, i] / np.where(s != 0, s, 1)), lo, hi)
        err = (wt[:, i] - q[:, i] * s) / hinv[i, i]
        wt[:, i + 1 :] -= np.outer(err, hinv[i, i + 1 :])
        hinv -= np.outer(hinv[:, i], hinv[i, :]) / hinv[i, i]  # channel i is fixed from now on
    return q, scales


@pytest.mark.parametrize(
    ("rule", "bits"), [("signed", 4), ("mse", 4), ("signed", 2), ("mse", 3), ("mse", 5), ("signed", 8)]
)
def test_gptq_matches_the_textbook_sweep(rule: str, bits: int) -> None:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((96, 40)).astype(np.float32)
    x = outlier_rows(rng, 400, 96)
    h = x.T.astype(np.float64) @ x
    q_ref, s_ref = textbook_gptq(w, h, 32, rule, 0.01, bits)
    # blocks of 64: lazy updates across 2 groups; float32 scales, as the textbook sweep keeps them
    got = gptq_quantize(w, h, 32, rule, damp=0.01, block=64, scale_dtype="float32", bits=bits)
    assert got.bits == bits and got.packed.shape == (40, 96 * bits // 8)
    codes = unpack(got.packed, bits)[:, :96]
    # float32 sweep vs float64 textbook: a rounding tie may fall the other way in a few places
    assert np.mean(codes == q_ref) > 0.99
    assert np.allclose(got.scales, s_ref, rtol=1e-3, atol=0)
    ref_w = (q_ref.reshape(40, 3, 32) * s_ref[:, :, None]).reshape(40, 96).T
    ref_err = float(np.einsum("kn,kn->", h @ (ref_w - w), ref_w - w))
    assert weighted_error(w, got, h) == pytest.approx(ref_err, rel=0.02)


@pytest.mark.parametrize("scale_dtype", ["float16", "int8"])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_keeps_float32_scales_when_float16_cannot_hold_one(act_order: bool, scale_dtype: str) -> None:
    rng = np.random.default_rng(4)
    w = rng.standard_normal((64, 24)).astype(np.float32)
    w[:, 5] *= np.float32(1e6)  # one output channel's (super-)scales overflow float16
    h = (lambda x: x.T.astype(np.float64) @ x)(outlier_rows(rng, 256, 64))
    got = gptq_quantize(w, h, 32, "signed", act_order=act_order, scale_dtype=scale_dtype)
    want = gptq_quantize(w, h, 32, "signed", act_order=act_order, scale_dtype="float32")
    assert got.scales.dtype == np.float32 and got.super_scales is None
    np.testing.assert_array_equal(got.packed, want.packed)
    np.testing.assert_array_equal(got.scales, want.scales)


@pytest.mark.parametrize(
    ("rule", "bits"), [("signed", 4), ("mse", 4), ("balanced", 4), ("mse", 2), ("signed", 3), ("mse", 6)]
)
def test_gptq_cuts_the_calibrated_error_below_round_to_nearest(rule: str, bits: int) -> None:
    rng = np.random.default_rng(2)
    k, n = 200, 48  # K not a multiple of the group: the padded tail is swept too
    w = rng.standard_normal((k, n)).astype(np.float32)
    x = outlier_rows(rng, 1024, k)
    h = x.T.astype(np.float64) @ x
    rtn = weighted_error(w, quantize_weight(w, 32, rule, bits), h)
    plain = gptq_quantize(w, h, 32, rule, bits=bits)
    ordered = gptq_quantize(w, h, 32, rule, act_order=True, bits=bits)
    assert plain.scales.shape == (n, 7) and plain.super_scales is not None  # the default dtype: int8 scales
    assert dequantize(plain.packed, plain.scales, k, 32, bits).shape == (k, n)
    assert weighted_error(w, plain, h) < 0.8 * rtn
    assert weighted_error(w, ordered, h) < 0.8 * rtn


@pytest.mark.parametrize("rule", ["signed", "mse"])
def test_gptq_is_round_to_nearest_when_inputs_are_uncorrelated(rule: str) -> None:
    # H = I (or damped to the identity): rounding one column moves nothing else.
    w = np.random.default_rng(3).standard_normal((64, 24)).astype(np.float32)
    for bits in (4, 3, 8):
        rtn = quantize_weight(w, 32, rule, bits)
        for got in (
            gptq_quantize(w, np.eye(64), 32, rule, bits=bits),
            gptq_quantize(w, np.ones((64, 64)), 32, rule, damp=1e9, bits=bits),
        ):
            assert np.array_equal(got.packed, rtn.packed) and np.array_equal(got.scales, rtn.scales)


def test_calibration_pass_gathers_each_layer_inputs_statistics() -> None:
    model = single_matmul(64, 16)
    rng = np.random.default_rng(4)
    batches = [{"x": rng.standard_normal((m, 64)).astype(np.float32)} for m in (5, 7, 3)]
    probe = Probe(model, ExportOptions(), batches, calibrate=True)
    ((key, x),) = probe.inputs.items()
    fit, held = collect(probe.session, {x: 64}, batches, split(batches))
    rows = np.concatenate([b["x"] for b in batches])
    total = fit.stats[x] + held.stats[x]
    assert fit.runs == 3 and total.rows == 15 and fit.stats[x].rows == 8  # batches 0 and 2 fitted, 1 held out
    assert np.allclose(total.xtx, rows.T.astype(np.float64) @ rows, rtol=1e-5, atol=1e-4)
    assert np.allclose(total.mean_abs, np.abs(rows).mean(axis=0), rtol=1e-6)
    assert fit.state_bytes == 64 * 64 * 4 + 64 * 8
    # One batch: its odd rows are held out.
    one, other = collect(probe.session, {x: 64}, batches[:1], split(batches[:1]))
    assert one.stats[x].rows == 3 and other.stats[x].rows == 2
    assert np.allclose(one.stats[x].xtx, batches[0]["x"][0::2].T @ batches[0]["x"][0::2], rtol=1e-5, atol=1e-4)


def test_awq_folds_scales_exactly_into_norm_gains_and_the_gated_mlp() -> None:
    model = llama_decoder(LLAMA)
    probe = Probe(model, ExportOptions(), [])
    keys = {c.key: c for c in probe.candidates}
    readers = {i: keys[node_label(n, i)].w.shape[0] for i, n in enumerate(model.graph.node) if node_label(n, i) in keys}
    sites = find_sites(model, readers)
    # Per layer: the attention norm (q, k, v), the MLP norm (gate, up), and up_proj's columns for down_proj.
    assert len(sites) == 3 * LLAMA.layers
    assert sorted(len(s.readers) for s in sites) == [1, 1, 2, 2, 3, 3]
    rng = np.random.default_rng(5)
    scales = {s.x: rng.uniform(0.25, 4.0, readers[s.readers[0]]).astype(np.float32) for s in sites}
    shifted = apply_scales(model, sites, scales)
    feeds = random_input(model, {"batch": 2, "seq": 8}, seed=6)

    def run(m: onnx.ModelProto) -> np.ndarray:
        return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]

    assert float(row_rel_l2([run(model)], [run(shifted)]).max()) < 1e-5
    assert len(shifted.graph.initializer) == len(model.graph.initializer)  # the originals, unread, are dropped


def test_awq_search_never_does_worse_than_plain_rounding_on_its_statistics() -> None:
    model = single_matmul(256, 64)
    rng = np.random.default_rng(7)
    batches = [{"x": outlier_rows(rng, 256, 256)}]
    probe = Probe(model, ExportOptions(), batches, calibrate=True)
    ((key, x),) = probe.inputs.items()
    stats = collect(probe.session, {x: 256}, batches)[0].stats[x]
    s, loss, plain = search([probe.candidates[0].w], stats, 32, "mse")
    assert loss < 0.9 * plain and s.shape == (256,) and np.all(s > 0)


def gained_matmul(k: int, n: int) -> onnx.ModelProto:
    """``y = (x * gain) @ W``: a norm's gain before a projection, where AWQ's inverse scale folds."""
    rng = np.random.default_rng(10)
    base = single_matmul(k, n)
    gain = numpy_helper.from_array((1 + 0.1 * rng.standard_normal(k)).astype(np.float32), "gain")
    base.graph.initializer.append(gain)
    base.graph.node.insert(0, helper.make_node("Mul", ["x", "gain"], ["x_gained"], name="norm_gain"))
    base.graph.node[1].input[0] = "x_gained"
    return base


def _output_error(model: onnx.ModelProto, quantized: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> float:
    """``||Y_int4 - Y|| / ||Y||`` over all rows: the calibrated loss the methods minimise, on new rows."""
    (fp32,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    (int4,) = make_session(quantized, threads=1).run(None, feeds)
    return float(np.linalg.norm(int4 - fp32) / np.linalg.norm(fp32))


@pytest.mark.parametrize("bits", [2, 3, 6])
def test_gptq_at_another_width_runs_in_the_op_and_beats_rounding_at_that_width(bits: int) -> None:
    """The op's output error on the calibration rows (what GPTQ minimises; on this small toy new rows gain
    little: docs/widths.md has the real-LLM figures)."""
    model = gained_matmul(256, 64)
    rows = outlier_rows(np.random.default_rng(11), 1024, 256)
    calibration = [{"x": rows[:512]}, {"x": rows[512:]}]
    errors = {}
    for method in ("rtn", "gptq"):
        feeds = calibration if method == "gptq" else None
        q, _ = export_with_summary(model, feeds=feeds, method=method, bits=bits, scale_rule="mse", target_cosine=0.0)
        (node,) = [n for n in q.graph.node if n.op_type == OP_TYPE]
        assert {a.name: a.i for a in node.attribute}.get("bits", 4) == bits
        errors[method] = _output_error(model, q, {"x": rows})
    assert errors["gptq"] < 0.92 * errors["rtn"]


@pytest.mark.parametrize(("rule", "gptq_gain"), [("signed", 0.9), ("mse", 1.0)])
def test_calibrated_methods_beat_round_to_nearest_on_new_inputs_with_outliers(rule: str, gptq_gain: float) -> None:
    model = gained_matmul(256, 64)
    rows = outlier_rows(np.random.default_rng(9), 1536, 256)
    calibration = [{"x": rows[:512]}, {"x": rows[512:1024]}]
    unseen = {"x": rows[1024:]}  # the same hot channels, new rows
    errors = {}
    for method in ("rtn", "gptq", "awq", "awq+gptq", "auto"):
        q, summary = export_with_summary(model, feeds=calibration, target_cosine=0.0, method=method, scale_rule=rule)
        assert sum(n.op_type == OP_TYPE for n in q.graph.node) == 1
        errors[method] = _output_error(model, q, unseen)
    # Measured (signed): rtn 0.058, gptq 0.047, awq 0.028: AWQ's scales lift the hot channels off the coarse grid.
    assert errors["gptq"] < gptq_gain * errors["rtn"] and errors["awq"] < 0.8 * errors["rtn"], errors
    assert errors["awq+gptq"] < errors["rtn"], errors
    assert errors["auto"] <= min(errors["gptq"], errors["rtn"]), errors
    assert "method auto" in summary.format() and "calibration pass of 2 run(s)" in summary.format()


def test_methods_keep_mixed_precision_and_every_rule_working() -> None:
    model = llama_decoder(LLAMA)
    feeds = [random_input(model, {"batch": 2, "seq": 8}, seed=s) for s in range(2)]
    for method, rule in (("gptq", "signed"), ("awq", "auto"), ("auto", "balanced")):
        _, summary = export_with_summary(model, feeds=feeds, target_cosine=0.995, method=method, scale_rule=rule)
        report = summary.mixed_precision
        assert report.cosine_probe >= 0.995 and report.cosine_exported >= 0.99, summary.format()
        assert report.calibration_runs == 2


def test_method_auto_keeps_the_default_export_when_no_pair_wins_by_the_margin() -> None:
    # qwen2's calibration batch: rtn/mse cuts the default's held-out damage by 2.7% (< 5%), AWQ pairs lose.
    models = Path(__file__).parent / "models"
    model = onnx.load(models / "qwen2.onnx")
    with np.load(models / "qwen2.npz") as data:
        feeds = {k: data[k] for k in data.files}
    auto, summary = export_with_summary(model, method="auto", feeds=feeds, target_cosine=0.0)
    default, _ = export_with_summary(model)
    choice = summary.mixed_precision.rule_choice
    assert (choice.default, choice.chosen, choice.best) == ("rtn/balanced", "rtn/balanced", "rtn/mse"), choice
    assert summary.mixed_precision.awq_inputs == 0 and "AWQ" not in summary.format()
    assert "the default kept: rtn/mse cut its damage by less than 5%" in summary.format()

    def tensors(m: onnx.ModelProto) -> list[bytes]:
        found = [a.t for n in m.graph.node for a in n.attribute if a.type == onnx.AttributeProto.TENSOR]
        return [numpy_helper.to_array(t).tobytes() for t in found]

    assert tensors(auto) == tensors(default) and len(tensors(auto)) > 10  # the same codes and scales


def test_calibrated_method_without_feeds_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model = single_matmul(64, 16)
    for method in ("gptq", "awq"):
        with pytest.raises(ValueError, match=f"method '{method}' needs calibration inputs"):
            export_with_summary(model, method=method)
    quantized, _ = export_with_summary(model, method="auto")  # auto without feeds: round-to-nearest
    assert quantized.graph.node[0].op_type == OP_TYPE
    with pytest.raises(ValueError, match="method must be one of"):
        ExportOptions(method="hqq")
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    assert main(["export", str(path), "-o", str(tmp_path / "q.onnx"), "--method", "gptq"]) != 0
    err = capsys.readouterr().err.strip()
    assert "--method gptq needs --feeds" in err and len(err.splitlines()) == 1
    np.savez(tmp_path / "cal.npz", x=np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32))
    out = tmp_path / "q.onnx"
    args = ["export", str(path), "-o", str(out), "--method", "gptq", "--feeds", str(tmp_path / "cal.npz")]
    assert main([*args, "--target-cosine", "0", "-q"]) == 0
    assert onnx.load(out).graph.node[0].op_type == OP_TYPE


@pytest.mark.parametrize(
    ("feeds", "message"),
    [
        ({"x": np.zeros((4, 64), np.float64)}, r"feeds: input 'x' is float64, the model expects float32"),
        (
            {"x": np.zeros((4, 32), np.float32)},
            r"feeds: input 'x' has shape \[4, 32\], the model expects \['M', 64\]",
        ),
        ({"y": np.zeros((4, 64), np.float32)}, r"missing \['x'\], not inputs of the model \['y'\]"),
        ([{"x": np.zeros((4, 64), np.float32)}, {"x": np.zeros(3, np.float32)}], r"feeds\[1\]: input 'x' has shape"),
        ([{"x": np.zeros((4, 64), np.float32)}, "x"], r"feeds\[1\]: expected a dict of input arrays, got str"),
        ([], "the iterable gave no batch"),
        (3, "feeds must be an .npz path, a dict of input arrays or an iterable of them, got int"),
    ],
)
def test_bad_feeds_are_one_line_errors(feeds: object, message: str) -> None:
    model = single_matmul(64, 16)
    with pytest.raises(ValueError, match=message) as info:
        feed_batches(feeds, model)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=message):
        export_with_summary(model, feeds=feeds, method="gptq")


def test_awq_folds_into_the_gains_of_ort_fused_norms() -> None:
    # The genai builder's graphs: SkipSimplifiedLayerNormalization (com.microsoft) and
    # SimplifiedLayerNormalization (registered by ORT in the ONNX domain) before the projections.
    rng = np.random.default_rng(11)
    k, n = 64, 32

    def const(name: str, shape: tuple[int, ...]) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)

    nodes = [
        helper.make_node(
            "SkipSimplifiedLayerNormalization",
            ["x", "skip", "g1"],
            ["h1", "", "", "sum"],
            domain="com.microsoft",
            epsilon=1e-6,
        ),  # fmt: skip
        helper.make_node("MatMul", ["h1", "w1"], ["y1"]),
        helper.make_node("SimplifiedLayerNormalization", ["sum", "g2"], ["h2"], epsilon=1e-6, axis=-1),
        helper.make_node("MatMul", ["h2", "w2"], ["y2"]),
        helper.make_node("MatMul", ["h2", "w3"], ["y3"]),
    ]
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 5, k])
    skip = helper.make_tensor_value_info("skip", onnx.TensorProto.FLOAT, [2, 5, k])
    outs = [helper.make_tensor_value_info(y, onnx.TensorProto.FLOAT, None) for y in ("y1", "y2", "y3", "sum")]
    inits = [const("g1", (k,)), const("g2", (k,)), const("w1", (k, n)), const("w2", (k, n)), const("w3", (k, n))]
    graph = helper.make_graph(nodes, "norms", [x, skip], outs, inits)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    sites = find_sites(model, {1: k, 3: k, 4: k})
    assert sorted((model.graph.node[s.node].op_type, len(s.readers)) for s in sites) == [
        ("SimplifiedLayerNormalization", 2),
        ("SkipSimplifiedLayerNormalization", 1),
    ]
    shifted = apply_scales(model, sites, {s.x: rng.uniform(0.2, 5.0, k).astype(np.float32) for s in sites})
    feeds = {
        "x": rng.standard_normal((2, 5, k)).astype(np.float32),
        "skip": rng.standard_normal((2, 5, k)).astype(np.float32),
    }

    def run(m: onnx.ModelProto) -> list[np.ndarray]:
        return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)

    assert float(row_rel_l2(run(model), run(shifted)).max()) < 1e-5


def test_layers_inside_subgraphs_fall_back_to_rounding() -> None:
    # Their inputs cannot be graph outputs, so there are no statistics: GPTQ rounds them to nearest.
    from test_rewrite_nodes import K, M, subgraph_model, x

    model = subgraph_model()
    feeds = {"x": x(), "cond": np.array(True), "xs": x(4, 2, M, K)}
    plain, _ = export_with_summary(model, feeds=feeds, target_cosine=0.0, scale_rule="mse")
    for method in ("gptq", "auto"):
        q, summary = export_with_summary(model, feeds=feeds, target_cosine=0.0, method=method, scale_rule="mse")
        assert len(summary.rewritten) == 3, summary.format()
    assert q.SerializeToString() == plain.SerializeToString()  # every layer is in a body: each method rounds
    # A bits mapping names a body's node by its own name, with feeds as without them.
    widths = {}
    for method, kw in (("rtn", {}), ("rtn", {"feeds": feeds}), ("gptq", {"feeds": feeds})):
        q, summary = export_with_summary(
            model, method=method, target_cosine=0.0, scale_rule="mse", bits={"mm": 8, "body_mm": 2}, **kw
        )
        found = {n.name: {a.name: a.i for a in n.attribute}.get("bits", 4) for g in all_graphs(q.graph) for n in g.node
                 if n.op_type == OP_TYPE}  # fmt: skip
        widths[(method, bool(kw))] = found
    assert widths[("rtn", False)]["mm"] == 8 and widths[("rtn", False)]["body_mm"] == 2, widths
    assert widths[("rtn", True)] == widths[("rtn", False)] == widths[("gptq", True)]


TIED = Path(__file__).parent / "genai" / "llama-tied-fp32" / "model.onnx"


def _tied_feeds(model: onnx.ModelProto, seed: int) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(seed).integers(0, 1000, (1, 12), dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for i in model.graph.input:
        if i.name.startswith("past_key_values"):
            feeds[i.name] = np.zeros((1, 2, 0, 16), np.float32)
    return feeds


def test_gptq_streamed_from_a_file_matches_in_memory_and_the_tied_table_gets_the_heads_codes(tmp_path: Path) -> None:
    from cim_int4.exporter import export_int4, load_model

    model = load_model(TIED)
    feeds = [_tied_feeds(model, s) for s in range(3)]
    options = {"method": "gptq", "scale_rule": "signed", "feeds": feeds, "target_cosine": 0.0}
    out = tmp_path / "gptq.onnx"
    export_int4(TIED, out, quiet=True, external_data=True, **options)  # weights read from the file, one at a time
    mem, summary = export_with_summary(model, **options)
    streamed = load_model(out)
    tensors = {t.name: numpy_helper.to_array(t) for t in streamed.graph.initializer}
    assert tensors.keys() == {t.name for t in mem.graph.initializer}
    for t in mem.graph.initializer:
        np.testing.assert_array_equal(tensors[t.name], numpy_helper.to_array(t), err_msg=t.name)
    # The one int4 table (read by the Gather and the tied head) holds the head's GPTQ codes, not rounding's.
    (packed,) = [t for t in mem.graph.initializer if t.name.endswith("int4_packed")]
    head = next(n for n in mem.graph.node if n.op_type == OP_TYPE and packed.name in n.input)
    w = next(t for t in model.graph.initializer if list(t.dims) == [64, 1000])  # the head's [K, N], the table's T
    rtn = quantize_weight(numpy_helper.to_array(w), 32, "signed")
    assert not np.array_equal(numpy_helper.to_array(packed), rtn.packed), head.name
    # The probe feeds the head's FP32 weight to the table's Transpose too: no second copy in its session.
    probe = Probe(model, ExportOptions(), [])
    assert [c.also for c in probe.candidates if c.also] == [("lm_head.MatMul.weight",)]
    # The calibration pass, then the check's FP32 reference run again (one pair, target 0: not kept meanwhile).
    assert summary.mixed_precision.runs == 2 * len(feeds)


def test_references_spilled_to_disk_give_the_same_check_and_leave_no_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    from cim_int4.exporter import load_model
    from cim_int4.exporter import memory as memory_module

    model = load_model(TIED)
    feeds = [_tied_feeds(model, s) for s in range(3)]
    kept = {}
    for ram in (memory_module.REFERENCE_RAM_BYTES, 0):  # in memory, then every reference on disk
        monkeypatch.setattr(memory_module, "REFERENCE_RAM_BYTES", ram)
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        for target in (0.0, 0.999):  # the check's own store (target 0), the probe's kept outputs (target > 0)
            _, summary = export_with_summary(model, method="gptq", feeds=feeds, target_cosine=target)
            report = summary.mixed_precision
            kept[ram, target] = (report.cosine_exported, report.cosine_probe, report.runs)
        assert not list(tmp_path.glob("cim-int4-reference-*")), "the temporary references must be removed"
    for target in (0.0, 0.999):
        assert kept[0, target] == kept[memory_module.REFERENCE_RAM_BYTES, target]


def test_reference_store_round_trip_and_a_full_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    from cim_int4.exporter import memory as memory_module
    from cim_int4.exporter.memory import ReferenceStore

    monkeypatch.setattr(memory_module, "REFERENCE_RAM_BYTES", 0)
    outs = [np.arange(12, dtype=np.float32).reshape(3, 4), np.ones(5, np.float32)]
    store = ReferenceStore(2, outs)
    assert store.put(0, outs) and len(store) == 1 and store.get(1) is None
    for got, want in zip(store.get(0), outs, strict=True):
        np.testing.assert_array_equal(got, want)
        assert got.dtype == want.dtype

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "save", full)
    assert not store.put(1, outs) and store.get(1) is None and len(store) == 1
