"""Accuracy of every scale rule against ORT's MatMulNBits RTN: the table of docs/accuracy.md.

    .venv/bin/python tests/models/accuracy.py [--cases NAME ...] [--batches N]

Each case is an FP32 model and a way to draw its inputs: the repository's graphs
(cim_int4.graphs) at their default sizes, and the random-init transformers of tests/models
(make_models.py). Every rule exports the same layers that MatMulNBits quantizes (4 bits,
block 32, symmetric, accuracy level 0), so the columns differ only in how weights are
rounded. Every column is measured on the same ``--batches`` evaluation batches (drawn like
the case's batch 0, with other seeds), run in ONNX Runtime with CimInt4MatMul: the mean
and the worst cosine (and the mean rel L2) of the final outputs vs FP32 over every batch row.
Batch 0 (the stored .npz of a transformer) is the calibration batch of ``auto``, which
sees it and not the evaluation batches; the column ``method auto`` is ``export_int4(method="auto")``
on the same batch (round-to-nearest, GPTQ or AWQ under every rule, chosen on held-out rows of it).
One batch of 4 rows decides little: between two
rules the worst row of one batch moves by +-0.003 with the batch on these decoders.
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
from cim_int4.graphs import BUILDERS, LlamaConfig, llama_decoder, random_input, single_matmul
from cim_int4.ops import session_options

from cim_int4.bench.variants import quantize_nbits
from cim_int4.metrics import row_cosines, row_rel_l2

MODELS = Path(__file__).parent
BATCHES = 8  # evaluation batches per case
METHOD_AUTO = "method auto"  # the column of export_int4(method="auto", scale_rule="auto") with feeds
VOCAB = 512  # token ids are drawn below it, as make_models.py draws them

Feeds = dict[str, np.ndarray]


@dataclass(frozen=True)
class Case:
    """A model and how to draw its inputs: ``feeds(model, batch)``, batch 0 the calibration batch."""

    name: str
    model: Callable[[], onnx.ModelProto]
    feeds: Callable[[onnx.ModelProto, int], Feeds]


def _random(dims: dict[str, int], transform: Callable[[np.ndarray], np.ndarray] = lambda x: x) -> Callable:
    def feeds(model: onnx.ModelProto, batch: int) -> Feeds:
        return {k: transform(v) for k, v in random_input(model, dims, seed=1 + batch).items()}

    return feeds


def _like(stored: Feeds, rng: np.random.Generator) -> Feeds:
    """A new batch shaped like ``stored``: token ids below VOCAB, the same attention mask, Gaussian floats."""
    out = {}
    for name, v in stored.items():
        if name == "attention_mask" or v.dtype.kind == "b":
            out[name] = v
        elif v.dtype.kind in "iu":
            out[name] = rng.integers(0, VOCAB, size=v.shape, dtype=v.dtype)
        else:
            out[name] = rng.standard_normal(v.shape).astype(v.dtype)
    return out


def _stored(name: str) -> Case:
    def feeds(_: onnx.ModelProto, batch: int) -> Feeds:
        with np.load(MODELS / f"{name}.npz") as data:
            stored = {k: data[k] for k in data.files}
        return stored if batch == 0 else _like(stored, np.random.default_rng(1000 + batch))

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


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(
        model.SerializeToString(), session_options(pin=False), providers=["CPUExecutionProvider"]
    )


def _run(session: ort.InferenceSession, feeds: Feeds) -> list[np.ndarray]:
    names = {i.name for i in session.get_inputs()}
    return session.run(None, {k: v for k, v in feeds.items() if k in names})


@dataclass(frozen=True)
class Row:
    """One case: per column (rule or MatMulNBits) the mean and worst output cosine and the mean rel L2."""

    case: str
    layers: int
    cosine: dict[str, float]  # mean over every evaluation row
    worst: dict[str, float]
    rel_l2: dict[str, float]  # mean
    auto_chose: str | None = None  # the rule "auto" chose on the calibration batch
    method_chose: str | None = None  # the (method/rule) "method auto" chose there


def measure(case: Case, rules: tuple[str, ...] = (*SCALE_RULES, METHOD_AUTO), batches: int = BATCHES) -> Row:
    """Quantize ``case`` with every rule and MatMulNBits, same layers, and measure the outputs against FP32."""
    model = case.model()
    calibration = case.feeds(model, 0)
    evaluation = [case.feeds(model, b) for b in range(1, batches + 1)]
    fp32 = _session(model)
    reference = [_run(fp32, f) for f in evaluation]
    nbits = matmul_nbits(model)
    # Nodes MatMulNBits left as MatMul/Gemm stay FP32 in ours too (it quantizes MatMul only).
    left = [n.name for n in nbits.graph.node if n.op_type in ("MatMul", "Gemm") and n.name]
    cosine, worst, rel = {}, {}, {}
    layers, chose, method_chose = 0, None, None

    def score(column: str, quantized: onnx.ModelProto) -> None:
        session = _session(quantized)
        outs = [_run(session, f) for f in evaluation]
        cos = np.concatenate([row_cosines(r, o) for r, o in zip(reference, outs, strict=True)])
        cosine[column], worst[column] = float(cos.mean()), float(cos.min())
        rel[column] = float(np.concatenate([row_rel_l2(r, o) for r, o in zip(reference, outs, strict=True)]).mean())

    for rule in rules:
        calibrated = {"feeds": calibration, "target_cosine": 0.0} if rule in ("auto", METHOD_AUTO) else {}
        if rule == METHOD_AUTO:
            calibrated["method"] = "auto"
        # The embedding stays FP32, as MatMulNBits leaves it: the columns differ only in the MatMuls.
        quantized, summary = export_with_summary(
            model, scale_rule="auto" if rule == METHOD_AUTO else rule, exclude=left, keep_embedding=True, **calibrated
        )
        if rule == "auto":
            chose = summary.mixed_precision.rule_choice.chosen
        if rule == METHOD_AUTO:
            method_chose = summary.mixed_precision.rule_choice.chosen
        layers = len(summary.rewritten)
        score(rule, quantized)
    score("MatMulNBits", nbits)
    quantized_nbits = sum(n.op_type == "MatMulNBits" for n in nbits.graph.node)
    if quantized_nbits != layers:
        raise AssertionError(f"{case.name}: MatMulNBits quantized {quantized_nbits} nodes, cim-int4 {layers}")
    return Row(case.name, layers, cosine, worst, rel, chose, method_chose)


def markdown(rows: list[Row], rules: tuple[str, ...] = (*SCALE_RULES, METHOD_AUTO)) -> str:
    """The docs/accuracy.md table: mean output cosine (worst row) [mean rel L2] per rule, MatMulNBits last."""
    cols = [*rules, "MatMulNBits"]
    lines = [
        "| model | layers | " + " | ".join(cols) + " |",
        "|---|---|" + "---|" * len(cols),
    ]
    for r in rows:
        cells = [f"{r.cosine[c]:.5f} ({r.worst[c]:.5f}) [{r.rel_l2[c]:.3f}]" for c in cols]
        if "auto" in cols and r.auto_chose:
            cells[cols.index("auto")] += f" {r.auto_chose}"
        if METHOD_AUTO in cols and r.method_chose:
            cells[cols.index(METHOD_AUTO)] += f" {r.method_chose}"
        lines.append(f"| {r.case} | {r.layers} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--batches", type=int, default=BATCHES, help=f"evaluation batches (default {BATCHES})")
    args = parser.parse_args()
    rows = []
    for name in args.cases:
        rows.append(measure(CASES[name], batches=args.batches))
        print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(markdown(rows))


if __name__ == "__main__":
    main()
