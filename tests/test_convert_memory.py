"""``cim-int4 convert`` / ``genai`` in bounded memory, with the same output bytes and the caller's model untouched."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from cim_int4.exporter import load_model, save_model
from cim_int4.exporter.convert import NothingToConvert, convert_file, convert_with_summary, int4_bytes
from cim_int4.exporter.writer import model_size
from onnx import TensorProto, helper, numpy_helper
from test_convert import fp32_model, ort_nbits
from test_genai import INT4

from cim_int4 import from_matmulnbits
from cim_int4.bench.convert_memory import conversion_peak
from cim_int4.genai import CONFIG_NAME, prepare
from cim_int4.genai_bench import decoder_file

# The acceptance bound: a conversion's peak RSS above the imports, over the int4 bytes. Before
# the in-place conversion it was 6.2-6.7x (whole-model copies); now 1.1-1.4x.
PEAK_OVER_INT4 = 2.0


def nbits_chain(layers: int, dim: int, block: int = 32, seed: int = 0) -> onnx.ModelProto:
    """``layers`` MatMulNBits nodes of dim x dim in a chain, with random codes and scales (no quantizer: fast)."""
    rng = np.random.default_rng(seed)
    blocks = dim // block
    nodes, inits = [], []
    for i in range(layers):
        inits.append(numpy_helper.from_array(rng.integers(0, 256, (dim, blocks, block // 2), np.uint8), f"B{i}"))
        inits.append(numpy_helper.from_array(rng.uniform(0.01, 0.02, dim * blocks).astype(np.float32), f"s{i}"))
        nodes.append(
            helper.make_node(
                "MatMulNBits", [f"x{i}", f"B{i}", f"s{i}"], [f"x{i + 1}"], name=f"mm{i}", domain="com.microsoft",
                K=dim, N=dim, bits=4, block_size=block,
            )
        )  # fmt: skip
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x0", TensorProto.FLOAT, [1, dim])],
        [helper.make_tensor_value_info(f"x{layers}", TensorProto.FLOAT, [1, dim])],
        inits,
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def test_conversion_peak_memory_is_bounded_by_the_int4_bytes(tmp_path: Path) -> None:
    # 12 x 4096x4096: 126 MB of B + scales, enough that a whole-model copy shows over the interpreter's noise.
    src = tmp_path / "src"
    src.mkdir()
    onnx.save(nbits_chain(12, 4096), src / "model.onnx", save_as_external_data=True, location="model.onnx.data")
    (src / CONFIG_NAME).write_text(json.dumps({"model": {"decoder": {"filename": "model.onnx"}}}))
    weights = int4_bytes(src / "model.onnx")
    assert weights > 120e6
    runs = {
        "convert": ("convert", src / "model.onnx", tmp_path / "one.onnx", False),
        "convert --external-data": ("convert", src / "model.onnx", tmp_path / "ext.onnx", True),
        "genai": ("genai", src, tmp_path / "genai", False),
    }
    for label, (mode, source, output, external) in runs.items():
        baseline, peak = conversion_peak(mode, source, output, external)
        ratio = (peak - baseline) / weights
        assert ratio < PEAK_OVER_INT4, f"{label}: peak RSS {ratio:.2f}x the int4 bytes over the imports"
    assert len(load_model(tmp_path / "ext.onnx").graph.node) == 12


def reference(src: Path, out: Path, external_data: bool) -> None:
    """What ``convert_file`` wrote before it converted in place: load, convert a copy, save."""
    save_model(from_matmulnbits(load_model(src)), out, external_data=external_data)


def with_embedding(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` plus a Gather from an FP32 table that stays as it is (big enough to be read lazily)."""
    rng = np.random.default_rng(3)
    model.graph.initializer.append(numpy_helper.from_array(rng.standard_normal((300, 8)).astype(np.float32), "emb"))
    model.graph.initializer.append(numpy_helper.from_array(np.array([1, 7, 299], np.int64), "ids"))
    model.graph.node.append(helper.make_node("Gather", ["emb", "ids"], ["rows"], name="gather"))
    model.graph.output.append(helper.make_tensor_value_info("rows", TensorProto.FLOAT, [3, 8]))
    return model


def files_of(output: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in output.parent.iterdir() if p.name.startswith(output.name)}


@pytest.mark.parametrize("external_data", [False, True])
@pytest.mark.parametrize("input_external", [False, True])
def test_convert_file_writes_the_same_bytes(input_external: bool, external_data: bool, tmp_path: Path) -> None:
    src = tmp_path / "nbits.onnx"
    model = with_embedding(ort_nbits(fp32_model()))
    if input_external:  # every tensor external, even those too small for the output's data file
        onnx.save_model(model, src, save_as_external_data=True, size_threshold=0, location="nbits.onnx.data")
    else:
        onnx.save_model(model, src)
    (tmp_path / "new").mkdir()
    (tmp_path / "old").mkdir()
    convert_file(src, tmp_path / "new" / "out.onnx", quiet=True, external_data=external_data)
    reference(src, tmp_path / "old" / "out.onnx", external_data)
    new, old = files_of(tmp_path / "new" / "out.onnx"), files_of(tmp_path / "old" / "out.onnx")
    assert sorted(new) == sorted(old) == ["out.onnx", "out.onnx.data"][: 1 + external_data]
    assert new == old


def test_genai_writes_the_same_model_bytes(tmp_path: Path) -> None:
    out = prepare(INT4, tmp_path / "new", quiet=True)
    decoder = decoder_file(INT4)
    (tmp_path / "old").mkdir()
    reference(decoder, tmp_path / "old" / decoder.name, external_data=True)
    assert files_of(out / decoder.name) == files_of(tmp_path / "old" / decoder.name)


def test_the_callers_model_is_not_changed(tmp_path: Path) -> None:
    model = ort_nbits(fp32_model())
    before = model.SerializeToString()
    converted = from_matmulnbits(model)
    again, summary = convert_with_summary(model, compute="int8")
    assert model.SerializeToString() == before
    assert converted.SerializeToString() != before and len(summary.converted) == 2
    assert again.graph.node[0].op_type == converted.graph.node[0].op_type == "CimInt4MatMul"


def test_nothing_to_convert_names_the_reason(tmp_path: Path) -> None:
    onnx.save_model(fp32_model(), tmp_path / "fp32.onnx")
    with pytest.raises(NothingToConvert, match="nothing to convert") as caught:
        convert_file(tmp_path / "fp32.onnx", tmp_path / "out.onnx", quiet=True)
    assert not caught.value.summary.skipped
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp32.onnx"], "a failed convert leaves nothing behind"


def test_model_size_is_the_serialized_size() -> None:
    for model in (fp32_model(), ort_nbits(fp32_model()), from_matmulnbits(ort_nbits(fp32_model())), nbits_chain(2, 64)):
        assert model_size(model) == model.ByteSize() == len(model.SerializeToString())
