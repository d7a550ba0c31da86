"""Accuracy of the two compute modes: the table of docs/accuracy.md behind the default ``compute``.

    .venv/bin/python tests/models/compute_modes.py     (prints the Markdown table)

For every case of accuracy.py (the repository's graphs and the random-init transformers of
tests/models) and every model of tests/zoo: export once with the default scale rule, run
with ``cim_int4.compute`` = fp32 and = int8, and MatMulNBits (same layers) at accuracy
levels 0 and 4; worst final-output cosine vs FP32 for each. The default mode is int8 only
if int8 stays within 0.001 cosine of fp32 on every one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from cim_int4.exporter import export_with_summary
from cim_int4.graphs import random_input
from cim_int4.ops import session_options

from cim_int4.bench.variants import quantize_nbits
from cim_int4.contract import COMPUTE_CONFIG
from cim_int4.metrics import worst_cosine

sys.path.insert(0, str(Path(__file__).parent))
from accuracy import CASES, Case  # noqa: E402

ZOO = Path(__file__).parent.parent / "zoo"
RULE = 0.001  # int8 is the default only within this cosine of fp32 everywhere


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], compute: str | None = None) -> list[np.ndarray]:
    so = session_options(pin=False, config={COMPUTE_CONFIG: compute} if compute else None)
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in feeds.items() if k in names})


def _zoo_case(path: Path) -> Case:
    return Case(f"zoo {path.stem}", lambda: onnx.load(path), lambda m: random_input(m, {}, seed=1))


def measure(case: Case) -> dict[str, float]:
    """Worst output cosine vs FP32 of cim-int4 fp32/int8 and MatMulNBits acc0/acc4, same layers."""
    model = case.model()
    feeds = case.feeds(model)
    reference = _run(model, feeds)
    row = {}
    for level in (0, 4):
        row[f"nbits acc{level}"] = worst_cosine(reference, _run(quantize_nbits(model, accuracy_level=level), feeds))
    nbits = quantize_nbits(model, accuracy_level=0)
    left = [n.name for n in nbits.graph.node if n.op_type in ("MatMul", "Gemm") and n.name]
    quantized, _ = export_with_summary(model, exclude=left)
    for mode in ("fp32", "int8"):
        row[f"cim {mode}"] = worst_cosine(reference, _run(quantized, feeds, mode))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    cases = list(CASES.values()) + [_zoo_case(p) for p in sorted(ZOO.glob("*.onnx"))]
    cols = ("cim fp32", "cim int8", "nbits acc0", "nbits acc4")
    print("| model | " + " | ".join(cols) + " | int8 - fp32 |")
    print("|---|" + "---|" * (len(cols) + 1))
    worst = 0.0
    for case in cases:
        r = measure(case)
        delta = r["cim int8"] - r["cim fp32"]
        worst = min(worst, delta)
        print(f"| {case.name} | " + " | ".join(f"{r[c]:.5f}" for c in cols) + f" | {delta:+.5f} |", flush=True)
    print(json.dumps({"worst int8 - fp32": worst, "int8 within rule": worst >= -RULE}))


if __name__ == "__main__":
    main()
