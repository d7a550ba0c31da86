"""Accuracy of every scale rule against ORT's MatMulNBits RTN: the README's "Accuracy" table.

    .venv/bin/python tests/models/accuracy.py [--cases NAME ...] [--markdown]

Each case is an FP32 model and its inputs: the repository's graphs (cim_int4.graphs) at
their default sizes, and the random-init transformers of tests/models (make_models.py).
Every rule exports the same layers that MatMulNBits quantizes (4 bits, block 32,
symmetric, accuracy level 0), so the columns differ only in how weights are rounded. The
metric is the worst cosine (and rel L2) of the final outputs vs FP32 over the batch
(``cim_int4.exporter.sensitivity.worst_cosine``), run in ONNX Runtime with CimInt4MatMul.
tests/test_accuracy.py runs the small cases.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from cim_int4.exporter import SCALE_RULES, export_with_summary
from cim_int4.exporter.sensitivity import worst_cosine, worst_rel_l2
from cim_int4.graphs import BUILDERS, LlamaConfig, llama_decoder, random_input, single_matmul
from cim_int4.ops import session_options

from cim_int4.bench.variants import quantize_nbits

MODELS = Path(__file__).parent


@dataclass(frozen=True)
class Case:
    """A model and the inputs it is measured on."""

    name: str
    model: Callable[[], onnx.ModelProto]
    feeds: Callable[[onnx.ModelProto], dict[str, np.ndarray]]


def _random(dims: dict[str, int], transform: Callable[[np.ndarray], np.ndarray] = lambda x: x) -> Callable:
    def feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
        return {k: transform(v) for k, v in random_input(model, dims, seed=1).items()}

    return feeds


def _stored(name: str) -> Case:
    def feeds(_: onnx.ModelProto) -> dict[str, np.ndarray]:
        with np.load(MODELS / f"{name}.npz") as data:
            return {k: data[k] for k in data.files}

    return Case(name, lambda: onnx.load(MODELS / f"{name}.onnx"), feeds)


STORED = ("llama", "qwen2", "gpt2", "bert", "t5", "vit")
CASES: dict[str, Case] = {
    "matmul": Case("matmul 4096x4096", BUILDERS["matmul"], _random({"M": 16})),
    # Non-negative inputs (as after ReLU/GELU/SiLU): where a biased rounding adds up over K.
    "matmul-relu": Case("matmul 4096x4096, inputs >= 0", BUILDERS["matmul"], _random({"M": 16}, np.abs)),
    "chain": Case("chain 4x1024", BUILDERS["chain"], _random({"M": 16})),
    "mlp": Case("mlp (ReLU)", BUILDERS["mlp"], _random({"batch": 16})),
    "llama": Case("llama decoder 4L h1024", BUILDERS["llama"], _random({"batch": 4, "seq": 16})),
    **{f"hf-{name}": _stored(name) for name in STORED},
}
# Small enough for the test suite: seconds in all.
SMALL_CASES: dict[str, Case] = {
    "matmul-relu": Case("matmul 1024x256, inputs >= 0", lambda: single_matmul(1024, 256), _random({"M": 16}, np.abs)),
    "llama": Case(
        "llama decoder 2L h128",
        lambda: llama_decoder(LlamaConfig(hidden=128, intermediate=256, layers=2, heads=4)),
        _random({"batch": 2, "seq": 8}),
    ),
    "mlp": Case("mlp (ReLU)", BUILDERS["mlp"], _random({"batch": 16})),
    **{f"hf-{name}": _stored(name) for name in STORED},
}


def matmul_nbits(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with ORT's MatMulNBitsQuantizer applied: 4 bits, block 32, symmetric, accuracy level 0."""
    return quantize_nbits(model, accuracy_level=0)


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    sess = ort.InferenceSession(
        model.SerializeToString(), session_options(pin=False), providers=["CPUExecutionProvider"]
    )
    names = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in feeds.items() if k in names})


@dataclass(frozen=True)
class Row:
    """One case: worst output cosine and rel L2 per scale rule, and of MatMulNBits."""

    case: str
    layers: int
    cosine: dict[str, float]
    rel_l2: dict[str, float]


def measure(case: Case, rules: tuple[str, ...] = SCALE_RULES) -> Row:
    """Quantize ``case`` with every rule and MatMulNBits, same layers, and measure the outputs against FP32."""
    model = case.model()
    feeds = case.feeds(model)
    reference = _run(model, feeds)
    nbits = matmul_nbits(model)
    # Nodes MatMulNBits left as MatMul/Gemm stay FP32 in ours too (it quantizes MatMul only).
    left = [n.name for n in nbits.graph.node if n.op_type in ("MatMul", "Gemm") and n.name]
    cosine, rel = {}, {}
    layers = 0
    for rule in rules:
        quantized, summary = export_with_summary(model, scale_rule=rule, exclude=left)
        layers = len(summary.rewritten)
        out = _run(quantized, feeds)
        cosine[rule], rel[rule] = worst_cosine(reference, out), worst_rel_l2(reference, out)
    out = _run(nbits, feeds)
    cosine["MatMulNBits"], rel["MatMulNBits"] = worst_cosine(reference, out), worst_rel_l2(reference, out)
    quantized_nbits = sum(n.op_type == "MatMulNBits" for n in nbits.graph.node)
    if quantized_nbits != layers:
        raise AssertionError(f"{case.name}: MatMulNBits quantized {quantized_nbits} nodes, cim-int4 {layers}")
    return Row(case.name, layers, cosine, rel)


def markdown(rows: list[Row], rules: tuple[str, ...] = SCALE_RULES) -> str:
    """The table of the README: worst output cosine (rel L2) per rule, MatMulNBits last."""
    cols = [*rules, "MatMulNBits"]
    lines = [
        "| model | layers | " + " | ".join(cols) + " |",
        "|---|---|" + "---|" * len(cols),
    ]
    for r in rows:
        cells = [f"{r.cosine[c]:.5f} ({r.rel_l2[c]:.3f})" for c in cols]
        lines.append(f"| {r.case} | {r.layers} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()
    rows = []
    for name in args.cases:
        rows.append(measure(CASES[name]))
        print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(markdown(rows))


if __name__ == "__main__":
    main()
