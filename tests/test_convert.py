"""from_matmulnbits / ``cim-int4 convert``: MatMulNBits nodes become CimInt4MatMul with the same weights."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cim_int4.exporter import ExportError, load_model, quantize_weight
from cim_int4.exporter.convert import convert_with_summary
from cim_int4.exporter.options import ExportOptions
from cim_int4.ops import reference
from conftest import U32, random_weight
from onnx import TensorProto, helper, numpy_helper

from cim_int4 import from_matmulnbits, make_session
from cim_int4.cli import main
from cim_int4.contract import OP_DOMAIN, OP_TYPE

# Two independent MatMuls, so each output's error bound is that of one layer; K = 80 is
# not a multiple of the block, so padding is exercised too.
SHAPES = {"w0": (96, 40), "w1": (80, 24)}
M = 5


def fp32_model(seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    nodes, inputs, outputs, inits = [], [], [], []
    for i, (name, (k, n)) in enumerate(SHAPES.items()):
        inits.append(numpy_helper.from_array(random_weight(rng, k, n), name))
        nodes.append(helper.make_node("MatMul", [f"x{i}", name], [f"y{i}"], name=f"mm{i}"))
        inputs.append(helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [M, k]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [M, n]))
    graph = helper.make_graph(nodes, "two_matmuls", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def ort_nbits(model: onnx.ModelProto, accuracy_level: int = 0, block_size: int = 32) -> onnx.ModelProto:
    """``model`` quantized by ORT's MatMulNBitsQuantizer: 4 bits, symmetric."""
    root = logging.getLogger()
    level = root.level
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    finally:
        root.setLevel(level)  # the module sets the root logger to INFO on import
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    q = MatMulNBitsQuantizer(copy, bits=4, block_size=block_size, is_symmetric=True, accuracy_level=accuracy_level)
    q.process()
    return q.model.model


def feeds(seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"x{i}": rng.standard_normal((M, k), dtype=np.float32) for i, (k, _) in enumerate(SHAPES.values())}


def run_plain(model: onnx.ModelProto, x: dict[str, np.ndarray]) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, x)


def op_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == OP_TYPE and n.domain == OP_DOMAIN]


def attrs(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_round_trip_matches_matmulnbits_accuracy_level_0(block_size: int) -> None:
    nbits = ort_nbits(fp32_model(), accuracy_level=0, block_size=block_size)
    converted, summary = convert_with_summary(nbits)
    assert len(summary.converted) == 2 and not summary.skipped
    assert not [n for n in converted.graph.node if n.op_type == "MatMulNBits"]
    assert not converted.graph.initializer, "the MatMulNBits weights must not stay behind as initializers"
    x = feeds()
    want = run_plain(nbits, x)
    got = make_session(converted, threads=1).run(None, x)
    inits = {t.name: numpy_helper.to_array(t) for t in nbits.graph.initializer}
    nbits_nodes = [n for n in nbits.graph.node if n.op_type == "MatMulNBits"]
    for i, (node, src) in enumerate(zip(op_nodes(converted), nbits_nodes, strict=True)):
        a = attrs(node)
        k, n = SHAPES[f"w{i}"]
        assert (a["K"], a["N"], a["group_size"]) == (k, n, block_size)
        assert "compute" not in a, "accuracy_level 0 converts to the default fp32 compute"
        packed, scales = numpy_helper.to_array(a["packed"]), numpy_helper.to_array(a["scales"])
        b = inits[src.input[1]].reshape(n, -1)
        # Byte-identical where K has data (K is even here); ORT pads with code 0, ours must be 8.
        np.testing.assert_array_equal(packed[:, : k // 2], b[:, : k // 2])
        assert np.all(packed[:, k // 2 :] == 0x88)
        np.testing.assert_array_equal(scales, inits[src.input[2]].reshape(n, -1))
        assert (scales < 0).any(), "ORT's symmetric rule gives some negative scales; they must carry over"
        exact = reference.matmul(x[f"x{i}"], packed, scales, k, block_size)
        bound = reference.error_bound(x[f"x{i}"], packed, scales, k, block_size)
        assert np.all(np.abs(got[i] - exact) <= bound), f"output {i}: ours outside the FP32 rounding bound"
        assert np.all(np.abs(want[i] - exact) <= bound), f"output {i}: MatMulNBits outside the FP32 rounding bound"
        assert np.all(np.abs(got[i] - want[i]) <= 2 * bound)


@pytest.mark.parametrize(
    ("level", "compute", "expected"), [(4, "auto", "int8"), (4, "fp32", None), (0, "int8", "int8")]
)
def test_accuracy_level_maps_to_compute(level: int, compute: str, expected: str | None) -> None:
    converted = from_matmulnbits(ort_nbits(fp32_model(), accuracy_level=level), compute=compute)
    nodes = op_nodes(converted)
    assert len(nodes) == 2
    for node in nodes:
        got = attrs(node).get("compute")
        assert (got.decode() if got is not None else None) == expected


def nbits_node(
    qw, *, inputs: dict[str, onnx.TensorProto | None] | None = None, name: str = "nb", **overrides: int
) -> tuple[onnx.NodeProto, list[onnx.TensorProto]]:
    """A hand-made MatMulNBits node for the weight ``qw`` (from our quantizer), its initializers by slot."""
    n, blocks = qw.scales.shape
    tensors = {
        "B": numpy_helper.from_array(qw.packed.reshape(n, blocks, qw.group_size // 2), f"{name}_B"),
        "scales": numpy_helper.from_array(qw.scales.reshape(-1), f"{name}_scales"),
    }
    tensors.update(inputs or {})
    slots = ["B", "scales", "zero_points", "g_idx", "bias"]
    names = ["A"] + [tensors[s].name if tensors.get(s) is not None else "" for s in slots]
    while names[-1] == "":
        names.pop()
    attributes = {"K": qw.k, "N": qw.n, "bits": 4, "block_size": qw.group_size} | overrides
    node = helper.make_node("MatMulNBits", names, [f"{name}_Y"], name=name, domain="com.microsoft", **attributes)
    return node, [t for t in tensors.values() if t is not None]


def one_node_model(node: onnx.NodeProto, inits: list[onnx.TensorProto], k: int) -> onnx.ModelProto:
    graph = helper.make_graph(
        [node],
        "nbits",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, [3, k])],
        [helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, None)],
        inits,
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


@pytest.mark.parametrize(("k", "block"), [(64, 16), (75, 16), (70, 32), (200, 64), (256, 256)])
def test_hand_made_nodes_with_bias_and_zero_points_8(k: int, block: int, rng: np.random.Generator) -> None:
    n = 12
    qw = quantize_weight(random_weight(rng, k, n), block, scale_dtype="float32")  # as MatMulNBits stores them
    blocks = qw.scales.shape[1]
    bias = rng.standard_normal(n, dtype=np.float32)
    zp = np.full((n, -(-blocks // 2)), 0x88, dtype=np.uint8)
    node, inits = nbits_node(
        qw,
        inputs={
            "zero_points": numpy_helper.from_array(zp, "zp"),
            "bias": numpy_helper.from_array(bias, "bias"),
        },
    )
    model = one_node_model(node, inits, k)
    converted = from_matmulnbits(model)
    a = attrs(op_nodes(converted)[0])
    np.testing.assert_array_equal(numpy_helper.to_array(a["bias"]), bias)
    np.testing.assert_array_equal(numpy_helper.to_array(a["packed"]), qw.packed)
    x = {"A": rng.standard_normal((3, k), dtype=np.float32)}
    want = run_plain(model, x)[0]
    got = make_session(converted, threads=1).run(None, x)[0]
    exact = reference.matmul(x["A"], qw.packed, qw.scales, k, block, bias)
    bound = reference.error_bound(x["A"], qw.packed, qw.scales, k, block) + U32 * np.abs(exact) * 2
    assert np.all(np.abs(got - exact) <= bound)
    assert np.all(np.abs(want - exact) <= bound)


def test_padding_codes_become_8(rng: np.random.Generator) -> None:
    k, n = 40, 8
    qw = quantize_weight(random_weight(rng, k, n), 32, scale_dtype="float32")  # as MatMulNBits stores them
    b = qw.packed.copy()
    b[:, k // 2 :] = 0x3C  # garbage MatMulNBits never reads
    node, inits = nbits_node(qw, inputs={"B": numpy_helper.from_array(b.reshape(n, 2, 16), "B")})
    converted = from_matmulnbits(one_node_model(node, inits, k))
    np.testing.assert_array_equal(numpy_helper.to_array(attrs(op_nodes(converted)[0])["packed"]), qw.packed)
    make_session(converted, threads=1)  # the op refuses padding codes other than 8


def _zp(value: int, n: int = 12, blocks: int = 2) -> onnx.TensorProto:
    return numpy_helper.from_array(np.full((n, -(-blocks // 2)), value, dtype=np.uint8), "zp")


@pytest.mark.parametrize(
    ("inputs", "overrides", "reason"),
    [
        ({"zero_points": "zp7"}, {}, "zero points other than 8"),
        ({"zero_points": "zpf"}, {}, "only packed uint8 zero points"),
        ({"g_idx": "gidx"}, {}, "g_idx"),
        ({}, {"bits": 8}, "bits=8"),
        ({}, {"block_size": 512}, "block_size=512"),
        ({"bias": "bias16"}, {}, "expected float32"),
    ],
)
def test_unconvertible_nodes_are_left_with_a_reason(inputs: dict, overrides: dict, reason: str) -> None:
    # float32 scales, as MatMulNBits stores them for float32 activations
    qw = quantize_weight(random_weight(np.random.default_rng(0), 64, 12), 32, scale_dtype="float32")
    tensors = {
        "zp7": _zp(0x77),
        "zpf": numpy_helper.from_array(np.full(24, 8.0, np.float32), "zp"),
        "gidx": numpy_helper.from_array(np.arange(64, dtype=np.int32) // 32, "g_idx"),
        "bias16": numpy_helper.from_array(np.zeros(12, np.float16), "bias"),
    }
    bad, bad_inits = nbits_node(
        qw, inputs={slot: tensors[key] for slot, key in inputs.items()}, name="bad", **overrides
    )
    good, good_inits = nbits_node(qw, name="good")
    model = one_node_model(good, good_inits, 64)
    model.graph.node.append(bad)
    model.graph.initializer.extend(bad_inits)
    model.graph.output.append(helper.make_tensor_value_info("bad_Y", TensorProto.FLOAT, None))
    converted, summary = convert_with_summary(model)
    assert [c.name for c in summary.converted] == ["good"]
    assert [s.name for s in summary.skipped] == ["bad"]
    assert reason in summary.skipped[0].reason
    assert [n.op_type for n in converted.graph.node] == [OP_TYPE, "MatMulNBits"]
    kept = {t.name for t in converted.graph.initializer}
    assert {t.name for t in bad_inits} <= kept and not {t.name for t in good_inits} & kept


def test_weight_from_a_graph_input_is_left(rng: np.random.Generator) -> None:
    qw = quantize_weight(random_weight(rng, 64, 12), 32, scale_dtype="float32")  # as MatMulNBits stores them
    node, inits = nbits_node(qw)
    model = one_node_model(node, inits, 64)
    model.graph.input.append(helper.make_tensor_value_info("nb_B", TensorProto.UINT8, [12, 2, 16]))
    with pytest.raises(ExportError, match="not a constant"):
        from_matmulnbits(model)


def test_no_matmulnbits_is_an_error() -> None:
    with pytest.raises(ExportError, match="no com.microsoft MatMulNBits node"):
        from_matmulnbits(fp32_model())


def test_bad_compute_choice() -> None:
    with pytest.raises(ValueError, match="compute must be one of"):
        from_matmulnbits(ort_nbits(fp32_model()), compute="int4")


def test_a_conversion_takes_the_export_options_it_can_honour_and_names_the_others() -> None:
    # The same ExportOptions as an export: compute (with "auto"), external_data and fuse_gated apply; a
    # group size or rule cannot (the MatMulNBits model fixed them), so asking for one is an error.
    nbits = ort_nbits(fp32_model(), accuracy_level=4)
    by_options = from_matmulnbits(nbits, ExportOptions(compute="fp32"))
    assert {a.s for n in by_options.graph.node for a in n.attribute if a.name == "compute"} <= {b"fp32"}
    assert {a.s for n in from_matmulnbits(nbits).graph.node for a in n.attribute if a.name == "compute"} == {b"int8"}
    only = r"takes only the options compute, external_data and fuse_gated, got \['group_size'\]"
    with pytest.raises(ValueError, match=only):
        from_matmulnbits(nbits, group_size=64)
    # For an export, "auto" is the op's default mode.
    assert ExportOptions(compute="auto").node_compute == "fp32"


def test_unloaded_external_data_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "nbits.onnx"
    onnx.save_model(ort_nbits(fp32_model()), path, save_as_external_data=True, size_threshold=0, location="w.bin")
    with pytest.raises(ExportError, match="external data that was not loaded"):
        from_matmulnbits(onnx.load(str(path), load_external_data=False))


def test_cli_convert_with_external_data(tmp_path: Path, capsys) -> None:
    src = tmp_path / "nbits.onnx"
    onnx.save_model(
        ort_nbits(fp32_model()), src, save_as_external_data=True, size_threshold=0, location="nbits.onnx.data"
    )
    before = (src.read_bytes(), (tmp_path / "nbits.onnx.data").read_bytes())
    out = tmp_path / "out.onnx"
    assert main(["convert", str(src), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "2 MatMulNBits node(s) converted" in text and "compute fp32" in text
    assert before == (src.read_bytes(), (tmp_path / "nbits.onnx.data").read_bytes()), "the input must not change"
    x = feeds()
    for got, want in zip(make_session(out, threads=1).run(None, x), run_plain(load_model(src), x), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert load_model(out).graph.node[0].op_type == OP_TYPE
    assert not (tmp_path / "out.onnx.data").exists(), "a small output stays one file unless asked"

    # --external-data: the converted attributes go to <output>.data (ORT keeps one copy, not two)
    out_ext = tmp_path / "ext.onnx"
    assert main(["convert", str(src), "-o", str(out_ext), "--external-data", "-q"]) == 0
    nodes = onnx.load(str(out_ext), load_external_data=False).graph.node
    packed = [a.t for n in nodes if n.op_type == OP_TYPE for a in n.attribute if a.name == "packed"]
    assert len(packed) == 2 and all(t.data_location == onnx.TensorProto.EXTERNAL for t in packed)
    ext_out, one_file_out = (make_session(p, threads=1).run(None, x) for p in (out_ext, out))
    for got, want in zip(ext_out, one_file_out, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    ("argv_tail", "message"),
    [
        (["missing.onnx", "-o", "out.onnx"], "missing.onnx: no such file"),
        (["same.onnx", "-o", "same.onnx"], "output path is the input file"),
        (["fp32.onnx", "-o", "out.onnx"], "nothing to convert"),
        (["nbits.onnx", "-o", "out.onnx", "--compute", "int4"], "invalid choice"),
    ],
)
def test_cli_convert_errors(argv_tail: list[str], message: str, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    onnx.save_model(fp32_model(), "fp32.onnx")
    onnx.save_model(ort_nbits(fp32_model()), "nbits.onnx")
    onnx.save_model(ort_nbits(fp32_model()), "same.onnx")
    before = Path("same.onnx").read_bytes()
    try:
        code = main(["convert", *argv_tail])
    except SystemExit as e:  # argparse rejects bad choices itself
        code = e.code
    err = capsys.readouterr().err
    assert code in (1, 2) and message in err
    assert len(err.strip().splitlines()) <= 2, err
    assert Path("same.onnx").read_bytes() == before
    assert not Path("out.onnx").exists()
