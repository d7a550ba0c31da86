"""The probe's products that dequantize codes inside ORT: the same cosines as the float32 weights fed."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from cim_int4.exporter import ExportOptions, quantize_weight
from cim_int4.exporter.probe import Probe
from cim_int4.graphs import random_input, single_matmul

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
    every, one = range(len(candidates)), [len(candidates) // 2]
    in_graph = [probe.cosines(every, weights), probe.cosines(one, weights)]
    probe.candidates = [replace(c, codes=None) for c in candidates]  # the If's other branch, fed float32
    fed = [probe.cosines(every, weights), probe.cosines(one, weights)]
    for a, b in zip(in_graph, fed, strict=True):
        assert np.array_equal(a, b)  # the same float32 weights, bit for bit
    assert in_graph[0].min() < in_graph[1].min() < 1.0  # and the weights were quantized


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
