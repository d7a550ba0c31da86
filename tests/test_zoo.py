"""The zoo: third-party-exported models (tests/zoo, made by tests/zoo/make_zoo.py) through the exporter.

For each: how many MatMul/Gemm are quantized and skipped (and why), and the output's cosine
against the unquantized model in ORT, beside ORT's MatMulNBitsQuantizer (4 bits, block 32,
symmetric) on the same model. The numbers are in tests/zoo/README.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cim_int4.exporter import ExportSummary, export_with_summary
from cim_int4.exporter.fold import COMPUTED
from cim_int4.exporter.subgraph import all_graphs

from cim_int4 import make_session
from cim_int4.bench import quantize_nbits

ZOO = Path(__file__).resolve().parent / "zoo"
INDEX = json.loads((ZOO / "zoo.json").read_text())["models"]
SEQ = 8

# name -> (MatMul/Gemm quantized, skipped): every skipped node is an attention activation x activation MatMul.
EXPECTED = {
    "bart_legacy": (33, 12),
    "bert_legacy_inputs": (12, 4),
    "cond_dynamo": (2, 0),  # Gemms in both branches of an If, on outer-scope weights
    "gpt2_legacy": (9, 4),
    "llama_dynamo": (15, 4),
    "llama_dynamo_fp16": (15, 4),
    "llama_legacy": (15, 4),
    "llama_legacy_fp16": (15, 4),
    "qwen2_tied_dynamo": (15, 4),
}
# name -> embedding tables (Gather on a constant table) made int4, and how many LM heads read one (tied).
# The FP16 models' tables stay FP16 (skipped with the reason); the positions of BART, BERT and GPT-2 count too.
EXPECTED_TABLES = {
    "bart_legacy": (3, 1),
    "bert_legacy_inputs": (3, 0),
    "cond_dynamo": (0, 0),
    "gpt2_legacy": (2, 1),
    "llama_dynamo": (1, 0),
    "llama_dynamo_fp16": (0, 0),
    "llama_legacy": (1, 0),
    "llama_legacy_fp16": (0, 0),
    "qwen2_tied_dynamo": (1, 1),
}


@dataclass(frozen=True)
class ZooResult:
    """One zoo model through both quantizers."""

    summary: ExportSummary
    cosine: float
    nbits_nodes: int
    nbits_cosine: float
    # The export with keep_embedding (tables FP32, as MatMulNBitsQuantizer leaves them): like with like.
    fp32_tables_cosine: float


def feeds(name: str) -> list[dict[str, np.ndarray]]:
    """The inputs each model runs on: token ids, or for the If model one input down each branch."""
    rng = np.random.default_rng(0)
    if INDEX[name]["kind"] == "cond":
        x = rng.standard_normal((2, 64)).astype(np.float32)
        x = x if x.sum() > 0 else -x
        return [{"x": x}, {"x": -x}]
    ids = rng.integers(0, INDEX[name]["vocab"], size=(1, SEQ), dtype=np.int64)
    return [{"input_ids": ids, "attention_mask": np.ones((1, SEQ), dtype=np.int64)}]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a64 @ b64 / (np.linalg.norm(a64) * np.linalg.norm(b64)))


def run(model: onnx.ModelProto, inputs: list[dict[str, np.ndarray]]) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.concatenate([sess.run(None, f)[0].ravel() for f in inputs])


def zoo_result(name: str) -> ZooResult:
    """Export zoo model ``name`` both ways and compare each output with the original's."""
    model = onnx.load(str(ZOO / f"{name}.onnx"))
    inputs = feeds(name)
    reference = run(model, inputs)
    q, summary = export_with_summary(model)
    sess = make_session(q, threads=1)
    ours = np.concatenate([sess.run(None, f)[0].ravel() for f in inputs])
    assert ours.dtype == reference.dtype and ours.shape == reference.shape
    kept, _ = export_with_summary(model, keep_embedding=True)
    kept_sess = make_session(kept, threads=1)
    kept_out = np.concatenate([kept_sess.run(None, f)[0].ravel() for f in inputs])
    nbits = quantize_nbits(model, accuracy_level=0)
    nbits_nodes = sum(n.op_type == "MatMulNBits" for g in all_graphs(nbits.graph) for n in g.node)
    return ZooResult(
        summary, cosine(ours, reference), nbits_nodes, cosine(run(nbits, inputs), reference),
        cosine(kept_out, reference),
    )


@pytest.fixture(scope="module", params=sorted(INDEX))
def result(request: pytest.FixtureRequest) -> tuple[str, ZooResult]:
    return request.param, zoo_result(request.param)


def test_every_zoo_model_is_expected() -> None:
    assert sorted(INDEX) == sorted(EXPECTED)
    for name, entry in INDEX.items():
        assert (ZOO / f"{name}.onnx").stat().st_size == entry["bytes"], f"{name}.onnx differs from zoo.json"


def test_counts_and_reasons(result: tuple[str, ZooResult]) -> None:
    name, r = result
    matmuls = [x for x in r.summary.rewritten if x.op_type != "Gather"]
    skipped = [s for s in r.summary.skipped if s.op_type != "Gather"]
    assert (len(matmuls), len(skipped)) == EXPECTED[name], r.summary.format()
    assert {s.reason for s in skipped} <= {COMPUTED}, r.summary.format()
    assert len(matmuls) >= r.nbits_nodes, "MatMulNBitsQuantizer found weights we did not"
    tables = [x for x in r.summary.rewritten if x.op_type == "Gather"]
    tied = [x for x in matmuls if "tied" in x.notes]
    assert (len(tables), len(tied)) == EXPECTED_TABLES[name], r.summary.format()
    for s in r.summary.skipped:
        if s.op_type == "Gather":
            assert INDEX[name]["fp16"] and "FLOAT16" in s.reason, r.summary.format()


def test_accuracy_against_the_original_and_matmulnbits(result: tuple[str, ZooResult]) -> None:
    name, r = result
    assert r.cosine > 0.98, f"{name}: cosine {r.cosine:.5f} vs the unquantized model"
    if r.nbits_nodes == len([x for x in r.summary.rewritten if x.op_type != "Gather"]):
        # Same nodes quantized: the default rule (balanced) is at least MatMulNBits' (signed) on every zoo model.
        c = r.fp32_tables_cosine
        assert c > r.nbits_cosine - 1e-4, f"{name}: cosine {c:.5f}, MatMulNBits {r.nbits_cosine:.5f}"
