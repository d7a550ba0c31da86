"""Int4 embeddings in the exporter: which Gathers are quantized, tied LM heads stored once, convert keeps the share."""

from __future__ import annotations

import glob
from pathlib import Path

import numpy as np
import onnx
import pytest
from cim_int4.exporter import ExportOptions, export_int4, export_with_summary, load_model, rewrite_model
from cim_int4.exporter.convert import convert_file
from cim_int4.ops import reference
from conftest import check, dequantized_model, init, model_of, w
from onnx import TensorProto, helper, numpy_helper

from cim_int4 import make_session
from cim_int4.cli import main
from cim_int4.contract import GATHER_OP_TYPE, OP_DOMAIN, OP_TYPE, encode_int8_scales

HERE = Path(__file__).resolve().parent
GENAI = HERE / "genai"
V, H = 300, 64  # vocabulary, hidden


def lm(tied: str = "transpose", table_dtype: int = TensorProto.FLOAT, axis: int = 0) -> onnx.ModelProto:
    """ids -> Gather(table) -> MatMul(W) -> MatMul(lm head): the head's weight per ``tied``.

    ``tied``: "transpose" (Transpose of the table, as the genai builder's FP32 model),
    "copy" (a second initializer holding table.T), "gemm" (Gemm transB=1 on the table),
    "other" (an unrelated weight).
    """
    table = w(1, V, H)
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["h0"], name="embed", axis=axis),
        helper.make_node("MatMul", ["h0", "W"], ["h1"], name="mlp"),
    ]
    inits = [numpy_helper.from_array(table.astype(helper.tensor_dtype_to_np_dtype(table_dtype)), "table"),
             init("W", w(2, H, H))]
    if table_dtype != TensorProto.FLOAT:
        nodes.insert(1, helper.make_node("Cast", ["h0"], ["h0f"], to=TensorProto.FLOAT))
        nodes[2].input[0] = "h0f"
    if tied == "transpose":
        nodes += [helper.make_node("Transpose", ["table"], ["tableT"], perm=[1, 0]),
                  helper.make_node("MatMul", ["h1", "tableT"], ["logits"], name="lm_head")]
    elif tied == "copy":
        inits.append(init("head", np.ascontiguousarray(table.T)))
        nodes.append(helper.make_node("MatMul", ["h1", "head"], ["logits"], name="lm_head"))
    elif tied == "gemm":
        nodes.append(helper.make_node("Gemm", ["h1", "table"], ["logits"], name="lm_head", transB=1))
    else:
        inits.append(init("head", w(3, H, V)))
        nodes.append(helper.make_node("MatMul", ["h1", "head"], ["logits"], name="lm_head"))
    graph = helper.make_graph(
        nodes, "lm", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["s"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["s", V])], inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


IDS = {"ids": np.array([0, 5, V - 1, -2], np.int64)}


def nodes_of(model: onnx.ModelProto, op_type: str) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == op_type and n.domain == OP_DOMAIN]


def int4_tables(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    """The uint8 code tensors held anywhere in the model (initializers and node attributes)."""
    tensors = [t for t in model.graph.initializer if t.data_type == TensorProto.UINT8]
    tensors += [a.t for n in model.graph.node for a in n.attribute if a.type == onnx.AttributeProto.TENSOR
                and a.t.data_type == TensorProto.UINT8]
    return tensors


@pytest.mark.parametrize("tied", ["transpose", "copy", "gemm"])
def test_a_tied_head_reads_the_one_int4_table_of_the_embedding(tied: str) -> None:
    model = lm(tied)
    q, summary = export_with_summary(model)
    (gather,) = nodes_of(q, GATHER_OP_TYPE)
    head = next(n for n in nodes_of(q, OP_TYPE) if n.name == "lm_head")
    # codes, int8 scales and their super-scales (the default scale dtype)
    assert list(head.input[1:]) == [gather.input[0], *gather.input[2:]] and len(gather.input) == 4
    assert not {a.name for a in head.attribute} & {"packed", "scales", "super_scales"}
    # One copy: the table's codes and the mlp's; no FP32 table or transposed copy left.
    assert sorted(tuple(t.dims) for t in int4_tables(q)) == [(H, H // 2), (V, H // 2)]
    assert not [t for t in q.graph.initializer if t.data_type == TensorProto.FLOAT and t.dims == [V, H]]
    assert any("tied" in r.notes for r in summary.rewritten)
    check(model, q, IDS)


def test_the_tied_model_equals_the_untied_one_bit_for_bit() -> None:
    q, _ = export_with_summary(lm("transpose"))
    # The same codes and scales given to the head as its own attributes (the untied form).
    untied = onnx.ModelProto()
    untied.CopyFrom(q)
    head = next(n for n in untied.graph.node if n.name == "lm_head")
    tables = {t.name: numpy_helper.to_array(t) for t in untied.graph.initializer}
    head.attribute.extend([helper.make_attribute(name, numpy_helper.from_array(tables[source], name))
                           for name, source in zip(("packed", "scales", "super_scales"), head.input[1:], strict=False)])
    del head.input[1:]
    for compute in ("fp32", "int8"):
        for a in [*head.attribute, *next(n for n in q.graph.node if n.name == "lm_head").attribute]:
            if a.name == "compute":
                a.s = compute.encode()
        got = make_session(q, threads=1).run(None, IDS)[0]
        want = make_session(untied, threads=1).run(None, IDS)[0]
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_the_table_is_quantized_as_the_head_weight_would_be() -> None:
    q, _ = export_with_summary(lm("other"), scale_rule="signed")
    (gather,) = nodes_of(q, GATHER_OP_TYPE)
    tables = {t.name: numpy_helper.to_array(t) for t in q.graph.initializer}
    from cim_int4.exporter import quantize_weight

    qw = quantize_weight(w(1, V, H).T, 32, "signed")
    np.testing.assert_array_equal(tables[gather.input[0]], qw.packed)
    np.testing.assert_array_equal(tables[gather.input[2]], encode_int8_scales(qw.scales, qw.super_scales))
    np.testing.assert_array_equal(tables[gather.input[3]], qw.super_scales)
    y = make_session(q, threads=1).run(None, IDS)[0]
    assert y.shape == (4, V)


def test_an_untied_head_keeps_its_own_weights() -> None:
    q, summary = export_with_summary(lm("other"))
    head = next(n for n in nodes_of(q, OP_TYPE) if n.name == "lm_head")
    assert len(head.input) == 1 and {"packed", "scales"} <= {a.name for a in head.attribute}
    assert not any("tied" in r.notes for r in summary.rewritten)


def test_a_head_that_differs_in_one_value_is_not_tied() -> None:
    model = lm("copy")
    head = next(t for t in model.graph.initializer if t.name == "head")
    value = numpy_helper.to_array(head).copy()
    value[3, 7] += 1e-3
    head.CopyFrom(numpy_helper.from_array(value, "head"))
    q, _ = export_with_summary(model)
    assert len(next(n for n in nodes_of(q, OP_TYPE) if n.name == "lm_head").input) == 1


def test_keep_embedding_leaves_the_table_fp32_and_the_head_untied() -> None:
    model = lm("transpose")
    q, summary = export_with_summary(model, keep_embedding=True)
    assert not nodes_of(q, GATHER_OP_TYPE)
    assert [n.op_type for n in q.graph.node if n.op_type == "Gather"] == ["Gather"]
    head = next(n for n in nodes_of(q, OP_TYPE) if n.name == "lm_head")
    assert len(head.input) == 1
    assert not any(s.op_type == "Gather" for s in summary.skipped)
    assert ExportOptions(keep_embedding=True).keep_embedding
    check(model, q, IDS)


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        (lm("other", table_dtype=TensorProto.FLOAT16), "is FLOAT16; only FLOAT tables are quantized"),
        (lm("other", axis=1), "gathers along axis 1; only rows"),
    ],
)
def test_gathers_left_fp32_say_why(model: onnx.ModelProto, reason: str) -> None:
    q, summary = export_with_summary(model)
    assert not nodes_of(q, GATHER_OP_TYPE)
    (skipped,) = [s for s in summary.skipped if s.op_type == "Gather"]
    assert reason in skipped.reason


def test_narrow_tables_small_tables_and_excluded_gathers_are_skipped() -> None:
    model = lm("other")
    for options, reason in [
        ({"group_size": 128}, "shorter than group_size=128"),
        ({"min_size": V * H + 1}, "fewer than min_size"),
        ({"exclude": ["embed"]}, "excluded by pattern 'embed'"),
    ]:
        try:
            q, summary = export_with_summary(model, **options)
        except Exception as e:  # noqa: BLE001 - group 128 > H leaves nothing at all
            assert reason in str(e)
            continue
        assert not nodes_of(q, GATHER_OP_TYPE)
        assert reason in next(s.reason for s in summary.skipped if s.op_type == "Gather")


def test_gathers_on_activations_or_shapes_are_not_reported() -> None:
    shape_gather = helper.make_node("Gather", ["shape", "zero"], ["n"], axis=0)
    act_gather = helper.make_node("Gather", ["x", "idx"], ["g"], axis=1)
    model = model_of(
        [helper.make_node("Shape", ["x"], ["shape"]), shape_gather, act_gather,
         helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")],
        [("x", [2, 64])], [("y", [2, 32])],
        [init("W", w(0, 64, 32)), numpy_helper.from_array(np.array(0, np.int64), "zero"),
         numpy_helper.from_array(np.array([1], np.int64), "idx")],
    )
    q, summary = rewrite_model(model)
    assert [s for s in summary.skipped if s.op_type == "Gather"] == []
    assert not nodes_of(q, GATHER_OP_TYPE)


def test_a_probe_model_leaves_gathers_alone() -> None:
    from cim_int4.exporter.probe_model import probe_model

    probe, candidates = probe_model(lm("transpose"), ExportOptions())
    assert [n.op_type for n in probe.graph.node].count("Gather") == 1
    assert len(candidates) == 2


MODELS = sorted(glob.glob(str(HERE / "models" / "*.onnx")) + glob.glob(str(HERE / "zoo" / "*.onnx")))


@pytest.mark.parametrize("path", MODELS)
def test_models_without_a_table_gather_export_as_with_keep_embedding(path: str) -> None:
    # keep_embedding takes the path of exports before int4 embeddings existed: a model with no
    # Gather on a constant table must not change by a byte.
    model = load_model(path)
    try:
        q, summary = export_with_summary(model)
    except Exception:  # noqa: BLE001 - a zoo model with nothing to quantize is another test's business
        return
    if any(r.op_type == "Gather" for r in summary.rewritten):
        assert nodes_of(q, GATHER_OP_TYPE)
        return
    kept, _ = export_with_summary(model, keep_embedding=True)
    assert q.SerializeToString() == kept.SerializeToString()


def test_the_exported_file_holds_one_copy(tmp_path: Path) -> None:
    src = GENAI / "llama-tied-fp32" / "model.onnx"
    tied = tmp_path / "tied.onnx"
    kept = tmp_path / "kept.onnx"
    export_int4(src, tied, quiet=True, external_data=True)
    export_int4(src, kept, quiet=True, external_data=True, keep_embedding=True)
    size = {p: sum(f.stat().st_size for f in tmp_path.glob(p.name + "*")) for p in (tied, kept)}
    q = load_model(tied)
    codes = [t for t in int4_tables(q) if t.dims[0] == 1000]
    assert len(codes) == 1, [t.name for t in codes]
    # Without the FP32 table (1000 x 64 x 4 bytes) and the head's own int4 copy.
    assert size[tied] < size[kept] - 1000 * 64 * 4
    # The streamed export (from a file) and the in-memory one agree.
    mem, _ = export_with_summary(load_model(src))
    feeds = {"input_ids": np.array([[1, 5, 999]], np.int64), "attention_mask": np.ones((1, 3), np.int64)}
    for i in q.graph.input:
        if i.name.startswith("past_key_values"):
            feeds[i.name] = np.zeros((1, 2, 0, 16), np.float32)
    a = make_session(q, threads=1).run(["logits"], feeds)[0]
    b = make_session(mem, threads=1).run(["logits"], feeds)[0]
    np.testing.assert_array_equal(a, b)
    twin = make_session(dequantized_model(q), threads=1).run(["logits"], feeds)[0]
    np.testing.assert_allclose(a, twin, rtol=1e-3, atol=1e-3 * float(np.abs(twin).max()))


def test_convert_keeps_the_builders_shared_table(tmp_path: Path) -> None:
    src = GENAI / "llama-tied-int4" / "model.onnx"
    out = tmp_path / "model.onnx"
    summary = convert_file(src, out, quiet=True)
    assert [c.name for c in summary.converted if c.shared] == ["/lm_head/MatMul_Q4"]
    assert summary.gathers == ["/model/embed_tokens/GatherBlockQuantized"]
    q = load_model(out)
    head = next(n for n in q.graph.node if n.name == "/lm_head/MatMul_Q4")
    (gather,) = nodes_of(q, GATHER_OP_TYPE)
    # Both read the builder's one B/scales pair; its Reshape (a second copy once ORT folds it) is gone.
    assert head.op_type == OP_TYPE
    assert list(head.input[1:]) == ["lm_head.MatMul.weight_Q4", "lm_head.MatMul.weight_scales"]
    assert list(gather.input[0::2]) == list(head.input[1:])
    assert not [n for n in q.graph.node if n.op_type in ("Reshape", "GatherBlockQuantized") and "embed" in n.name]
    assert len([t for t in int4_tables(q) if t.dims[0] == 1000]) == 1
    in_size = sum(f.stat().st_size for f in src.parent.glob("model.onnx*"))
    out_size = sum(f.stat().st_size for f in tmp_path.glob("model.onnx*"))
    assert out_size <= 1.01 * in_size, (out_size, in_size)
    feeds = {"input_ids": np.array([[1, 5, 999, 0]], np.int64), "attention_mask": np.ones((1, 4), np.int64)}
    for i in q.graph.input:
        if i.name.startswith("past_key_values"):
            feeds[i.name] = np.zeros((1, 2, 0, 16), np.float32)
    import onnxruntime as ort

    original = load_model(src)
    embedding = "/model/embed_tokens/GatherBlockQuantized/output_0"
    for m in (q, original):
        m.graph.output.append(helper.make_tensor_value_info(embedding, TensorProto.FLOAT, None))
    got = make_session(q, threads=1).run(["logits", embedding], feeds)
    want = ort.InferenceSession(original.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        ["logits", embedding], feeds
    )
    # The gathered rows are the same float32 products; the head computes from the same codes.
    np.testing.assert_array_equal(got[1], want[1])
    assert np.abs(got[0] - want[0]).max() <= 0.02 * np.abs(want[0]).max()


def test_gather_reference_refuses_bad_indices() -> None:
    packed = np.full((3, 16), 0x88, np.uint8)
    with pytest.raises(IndexError, match=r"outside \[-3, 2\]"):
        reference.gather(packed, np.ones((3, 1), np.float32), np.array([3]), 32, 32)


def test_cli_keep_embedding(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    src = tmp_path / "lm.onnx"
    onnx.save(lm("transpose"), src)
    assert main(["export", str(src), "-o", str(tmp_path / "a.onnx")]) == 0
    assert "quantized Gather 'embed'" in capsys.readouterr().out
    assert main(["export", str(src), "-o", str(tmp_path / "b.onnx"), "--keep-embedding"]) == 0
    assert "Gather" not in capsys.readouterr().out
    assert not nodes_of(onnx.load(str(tmp_path / "b.onnx")), GATHER_OP_TYPE)


def test_the_reference_backend_runs_int4_embeddings_and_tied_heads() -> None:
    pytest.importorskip("onnxruntime_extensions")
    q, _ = export_with_summary(lm("transpose"))
    got = make_session(q, threads=1).run(None, IDS)[0]
    ref = make_session(q, threads=1, backend="reference").run(None, IDS)[0]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))


def test_cli_genai_keep_embedding(tmp_path: Path) -> None:
    for flags, gathers in (([], 1), (["--keep-embedding"], 0)):
        out = tmp_path / f"out{len(flags)}"
        assert main(["genai", str(GENAI / "llama-tied-fp32"), "-o", str(out), "-q", *flags]) == 0
        assert len(nodes_of(onnx.load(str(out / "model.onnx")), GATHER_OP_TYPE)) == gathers
