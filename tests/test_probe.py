"""The probe's products that dequantize codes inside ORT: the same cosines as the float32 weights fed."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from cim_int4.exporter import ExportOptions, quantize_weight
from cim_int4.exporter.probe import Probe, weight32
from cim_int4.graphs import random_input, single_matmul
from cim_int4.ops.reference import dequantize

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
