"""The probe's products that dequantize codes inside ORT: the same cosines as the float32 weights fed."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cim_int4.exporter import ExportOptions, quantize_weight
from cim_int4.exporter.probe import Probe, _feeds_of, weight32
from cim_int4.graphs import random_input, single_matmul
from cim_int4.ops.reference import dequantize
from onnx import TensorProto, helper, numpy_helper

from cim_int4.metrics import row_cosines

MODELS = Path(__file__).parent / "models"


@pytest.fixture(scope="module")
def llama() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    with np.load(MODELS / "llama.npz") as data:
        feeds = {k: data[k] for k in data.files}
    return onnx.load(MODELS / "llama.onnx"), feeds


@pytest.mark.parametrize(("bits", "dtype"), [(4, "float32"), (3, "float16"), (2, "float16"), (8, "float32")])
def test_codes_in_the_graph_give_the_cosines_of_the_dequantized_weights(llama, bits: int, dtype: str) -> None:
    model, feeds = llama
    probe = Probe(model, ExportOptions(scale_dtype=dtype), [feeds])
    candidates = probe.candidates
    assert candidates and all(c.codes is not None for c in candidates)  # every K of the model is whole groups
    weights = {c.key: quantize_weight(c.w, 32, "signed", bits, dtype) for c in candidates}
    every, two = range(len(candidates)), [len(candidates) // 2, len(candidates) // 2 + 1]
    in_graph = [probe.cosines(every, weights), probe.cosines(two, weights)]
    probe.candidates = [replace(c, codes=None) for c in candidates]  # the If's other branch, fed float32
    fed = [probe.cosines(every, weights), probe.cosines(two, weights)]
    for a, b in zip(in_graph, fed, strict=True):
        assert np.array_equal(a, b)  # the same float32 weights, bit for bit
    assert in_graph[0].min() < in_graph[1].min() < 1.0  # and the weights were quantized


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize(("k", "dtype"), [(64, "float32"), (40, "float16"), (100, "float32")])
def test_float32_weights_are_the_references_dequantization_rounded(bits: int, k: int, dtype: str) -> None:
    w = np.random.default_rng(bits * k).standard_normal((k, 24)).astype(np.float32)
    qw = quantize_weight(w, 32, "signed", bits, dtype)  # K = 40 and 100: a partial last group
    assert np.array_equal(weight32(qw), dequantize(qw.packed, qw.scales, qw.k, 32, bits).astype(np.float32))


def test_a_model_below_ir_4_has_no_overridable_codes_and_still_runs() -> None:
    model = single_matmul(64, 16)
    model.ir_version = 3  # an initializer that is also an input is a constant there
    probe = Probe(model, ExportOptions(), [random_input(model, seed=1)], calibrate=True)
    (c,) = probe.candidates
    assert c.codes is None and probe.measured == {c.key}
    assert 0.99 < probe.cosines([0], {c.key: quantize_weight(c.w, 32, "signed")}).min() < 1.0


def test_a_subgraph_output_named_like_a_main_graph_tensor_is_not_measured() -> None:
    from cim_int4.exporter.subgraph import all_graphs
    from test_rewrite_nodes import K, M, subgraph_model, x

    model = subgraph_model()
    body = next(g for g in all_graphs(model.graph) if g.name == "body")
    body.node[1].output[0] = body.output[1].name = "z"  # "z" is also the main graph's Scan output
    feeds = {"x": x(), "cond": np.array(False), "xs": x(4, 2, M, K)}
    probe = Probe(model, ExportOptions(), [feeds], calibrate=True)
    assert len(probe.candidates) == 3 and not probe.measured  # every product sits in a subgraph
    probe.calibrate([])  # exposes no subgraph tensor as a graph output


def test_a_layer_of_partial_groups_is_fed_its_float32_weight() -> None:
    model = single_matmul(40, 16)  # K = 40: one whole group of 32 and a partial one
    feeds = random_input(model, seed=1)
    probe = Probe(model, ExportOptions(), [feeds])
    (c,) = probe.candidates
    assert c.codes is None
    cos = probe.cosines([0], {c.key: quantize_weight(c.w, 32, "signed")})
    assert cos.size and 0.99 < cos.min() < 1.0


def test_bounded_heap_maps_large_blocks_inside_and_leaves_a_set_threshold_alone(monkeypatch) -> None:
    import ctypes

    from cim_int4.exporter import memory

    calls = []

    class Libc:
        def mallopt(self, param: int, value: int) -> int:
            calls.append((param, value))
            return 1

    monkeypatch.setattr(ctypes, "CDLL", lambda name: Libc())
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    with memory.bounded_heap():
        assert calls == [(-3, memory.HEAP_MMAP_BYTES)]
    assert calls[-1] == (-3, 32 << 20) and len(calls) == 2
    calls.clear()
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # the user's choice wins
    with memory.bounded_heap():
        pass
    assert calls == []


def _tied_model(transposed_table: bool, v: int = 96) -> onnx.ModelProto:
    """ids -> Gather(table) -> MatMul(head) -> logits, the table tied to the head's weight W [H, V]: stored as
    the head's W read by the Gather through a Transpose (the genai builder), or as the table read by the head
    through a Transpose (torch.onnx's dynamo export)."""
    h = 64
    w = np.random.default_rng(3).standard_normal((h, v)).astype(np.float32)
    if transposed_table:
        init = numpy_helper.from_array(np.ascontiguousarray(w.T), "table")
        nodes = [helper.make_node("Transpose", ["table"], ["w"], perm=[1, 0]),
                 helper.make_node("Gather", ["table", "ids"], ["x"]),
                 helper.make_node("MatMul", ["x", "w"], ["logits"], name="head")]  # fmt: skip
    else:
        init = numpy_helper.from_array(w, "w")
        nodes = [helper.make_node("Transpose", ["w"], ["table"], perm=[1, 0]),
                 helper.make_node("Gather", ["table", "ids"], ["x"]),
                 helper.make_node("MatMul", ["x", "w"], ["logits"], name="head")]  # fmt: skip
    graph = helper.make_graph(
        nodes, "tied", [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 5])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 5, v])], [init],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("transposed_table", [False, True])
def test_a_tied_heads_run_quantizes_its_embedding_table_too(transposed_table: bool) -> None:
    model = _tied_model(transposed_table)
    feeds = {"ids": np.random.default_rng(0).integers(0, 96, (2, 5)).astype(np.int64)}
    probe = Probe(model, ExportOptions(), [feeds])
    (c,) = probe.candidates
    assert c.tables == ((model.graph.initializer[0].name, transposed_table),)
    qw = quantize_weight(c.w, 32, "signed", 2, "float32")
    # what the export computes: the head and its table both read the quantized weight
    tied = onnx.ModelProto()
    tied.CopyFrom(model)
    w = weight32(qw)
    tied.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(w.T) if transposed_table else w,
                                                               tied.graph.initializer[0].name))  # fmt: skip
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)  # noqa: E731
    want = row_cosines(run(model), run(tied))
    np.testing.assert_allclose(probe.cosines([0], {c.key: qw}), want, rtol=0, atol=1e-6)
    # a run of several layers feeds the head its codes, and the table its float32 weight still
    fed = _feeds_of(c, qw, codes=True)
    assert c.codes is not None and c.codes.q in fed and c.weight_name not in fed
    table = fed[model.graph.initializer[0].name]
    assert np.array_equal(table, w.T if transposed_table else w) and table.flags.c_contiguous
    # a kept FP32 embedding leaves the table alone
    kept = Probe(model, ExportOptions(keep_embedding=True), [feeds]).cosines([0], {c.key: qw})
    assert kept.min() > want.min() + 1e-3  # the head alone: less damage than head and table


def test_a_gather_of_the_heads_weight_untransposed_is_not_its_table() -> None:
    model = _tied_model(transposed_table=False, v=64)
    model.graph.node[1].input[0] = "w"  # the Gather reads W [H, V] itself: rows of H, not the head's V rows
    model.graph.node.remove(model.graph.node[0])
    probe = Probe(model, ExportOptions(), [{"ids": np.zeros((2, 5), dtype=np.int64)}])
    (c,) = probe.candidates
    assert c.also == ("w",) and c.tables == ()  # shared (one FP32 copy), but not quantized with the head
