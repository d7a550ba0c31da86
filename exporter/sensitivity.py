"""Mixed precision: keep the layers whose INT4 weights hurt the outputs most in FP32, until a target is met.

The analysis runs in plain ONNX Runtime on a *probe* copy of the model in which every
candidate MatMul/Gemm reads its weight ``[K, N]`` from an overridable initializer. Feeding
the dequantized INT4 weight of a layer there gives that layer's exact INT4 weight error
(the op computes the same product in its ``fp32`` mode, up to summation order):

1. one run with the FP32 weights: the reference outputs;
2. one run per candidate with only that layer in INT4: its *damage*, ``1 - cosine`` of the
   outputs (the output-level sensitivity, so a layer feeding a sharp softmax counts more
   than its weight error alone says);
3. layers ordered by damage; assuming damages add, the fewest most-damaging layers to keep
   in FP32 for the target is the first guess, then a bisection over that order with full
   runs (every other layer in INT4) finds the fewest that reach the target. Each probe is
   one run: every layer INT4, the guess, then at most ``ceil(log2(L + 1))`` more.

The exported model is then run once with CimInt4MatMul to report the cosine it reaches.
Cosine (``worst_cosine``): per float output and per index of its first axis (the batch),
the worst over all of them.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from ..ops.reference import dequantize
from ..ops.session import session_options
from .options import ExportOptions
from .quantize import QuantizedWeight, quantize_weight
from .rewrite import ExportSummary, probe_model, rewrite_model

DEFAULT_TARGET_COSINE = 0.99
# Models above this go to ORT as a file with external data (protobuf cannot hold 2 GiB).
_IN_MEMORY_LIMIT = 1 << 30

Feeds = Mapping[str, np.ndarray]


def _rows(reference: Sequence[np.ndarray], outputs: Sequence[np.ndarray]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """float64 [rows, -1] views of each float output and its reference, a row per index of the first axis."""
    for ref, out in zip(reference, outputs, strict=True):
        ref, out = np.asarray(ref), np.asarray(out)
        if ref.dtype.kind != "f" or ref.size == 0:
            continue
        rows = 1 if ref.ndim < 2 else ref.shape[0]
        yield ref.astype(np.float64).reshape(rows, -1), out.astype(np.float64).reshape(rows, -1)


def worst_cosine(reference: Sequence[np.ndarray], outputs: Sequence[np.ndarray]) -> float:
    """Worst cosine similarity between float outputs and their references, per index of the first axis."""
    worst = 1.0
    for r, o in _rows(reference, outputs):
        nr, no = np.linalg.norm(r, axis=1), np.linalg.norm(o, axis=1)
        # Two all-zero rows agree; one zero row against a non-zero one does not.
        both = nr * no
        cos = np.where(both > 0, np.einsum("ij,ij->i", r, o) / np.where(both > 0, both, 1.0), (nr == 0) & (no == 0))
        worst = min(worst, float(cos.min()))
    return worst


def worst_rel_l2(reference: Sequence[np.ndarray], outputs: Sequence[np.ndarray]) -> float:
    """Worst ``||out - ref|| / ||ref||`` over float outputs, per index of the first axis."""
    worst = 0.0
    for r, o in _rows(reference, outputs):
        d, n = np.linalg.norm(o - r, axis=1), np.linalg.norm(r, axis=1)
        rel = np.where(n > 0, d / np.where(n > 0, n, 1.0), np.where(d > 0, np.inf, 0.0))
        worst = max(worst, float(rel.max()))
    return worst


def load_feeds(source: str | os.PathLike | Feeds, model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Calibration inputs from an ``.npz`` file or a dict, checked against ``model``'s graph inputs."""
    if isinstance(source, Mapping):
        feeds, where = {k: np.asarray(v) for k, v in source.items()}, "feeds"
    else:
        where = str(source)
        try:
            with np.load(source, allow_pickle=False) as data:
                feeds = {k: data[k] for k in data.files}
        except (OSError, ValueError) as e:
            raise ValueError(f"{where}: not a readable .npz of input arrays ({e})") from e
    initializers = {t.name for t in model.graph.initializer}
    needed = [i.name for i in model.graph.input if i.name not in initializers]
    missing = [n for n in needed if n not in feeds]
    unknown = [n for n in feeds if n not in {i.name for i in model.graph.input}]
    if missing or unknown:
        raise ValueError(f"{where}: model inputs {needed}; missing {missing}, not inputs of the model {unknown}")
    return feeds


def _session(model: onnx.ModelProto, options: ort.SessionOptions) -> ort.InferenceSession:
    if model.ByteSize() < _IN_MEMORY_LIMIT:
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    with tempfile.TemporaryDirectory(prefix="cim_int4_") as tmp:
        path = Path(tmp) / "model.onnx"
        onnx.save_model(model, path, save_as_external_data=True, location="model.onnx.data", convert_attribute=True)
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@dataclass(frozen=True)
class LayerSensitivity:
    """One candidate layer: its output cosine when only it is INT4, and whether it stayed FP32."""

    name: str
    weight_bytes: int
    cosine_alone: float
    kept: bool


@dataclass
class MixedPrecision:
    """What the sensitivity analysis decided: layers by damage, target, cosine reached, runs used."""

    target_cosine: float
    layers: list[LayerSensitivity] = field(default_factory=list)
    cosine_all_int4: float | None = None
    cosine_probe: float = 1.0  # with the kept layers FP32, dequantized weights in ORT
    cosine_exported: float | None = None  # the exported model, CimInt4MatMul
    runs: int = 0

    @property
    def int4_share(self) -> float:
        """Fraction of the candidate layers' FP32 weight bytes that are INT4 in the export."""
        total = sum(x.weight_bytes for x in self.layers)
        return sum(x.weight_bytes for x in self.layers if not x.kept) / total if total else 0.0

    def format(self) -> str:
        """Lines for the export summary."""
        kept = [x for x in self.layers if x.kept]
        lines = [
            f"  mixed precision: target output cosine {self.target_cosine} on the calibration inputs; "
            f"{len(kept)} of {len(self.layers)} layer(s) kept in FP32 ({self.runs} model runs)",
        ]
        if self.cosine_all_int4 is not None:
            lines.append(f"    every layer INT4: cosine {self.cosine_all_int4:.6f}")
        lines.append(f"    with the kept layers FP32: cosine {self.cosine_probe:.6f} (dequantized weights in ORT)")
        if self.cosine_exported is not None:
            lines.append(f"    exported model run with CimInt4MatMul: cosine {self.cosine_exported:.6f}")
            if self.cosine_exported < self.target_cosine:
                # The analysis models the weights only; int8 activations add their own error.
                lines.append(
                    "    below the target: the compute mode adds error the analysis does not model; "
                    "raise --target-cosine or export with --compute fp32"
                )
        total = sum(x.weight_bytes for x in self.layers)
        lines.append(f"    int4 share of weight bytes: {self.int4_share:.1%} of {total:,} quantizable FP32 bytes")
        return "\n".join(lines)


def _keep_reason(rank: int, count: int, layer: LayerSensitivity) -> str:
    return (
        f"kept in FP32 by mixed precision: sensitivity rank {rank} of {count} "
        f"(output cosine {layer.cosine_alone:.6f} with only this layer INT4)"
    )


def plan(
    model: onnx.ModelProto, feeds: Feeds, target_cosine: float, options: ExportOptions
) -> tuple[dict[str, str], dict[str, QuantizedWeight], MixedPrecision]:
    """Which candidate layers to keep FP32 (key -> reason), every candidate's INT4 weight, and the report."""
    if not 0.0 < target_cosine <= 1.0:
        raise ValueError(f"target_cosine must be in (0, 1], got {target_cosine!r}")
    probe, candidates = probe_model(model, options)
    report = MixedPrecision(target_cosine=target_cosine)
    if not candidates:
        return {}, {}, report
    quiet = ort.SessionOptions()
    quiet.log_severity_level = 3  # ORT warns that overridable initializers are not constant-folded
    session = _session(probe, quiet)
    quantized = {c.key: quantize_weight(c.w, options.group_size, options.scale_rule) for c in candidates}

    def int4_weight(i: int) -> np.ndarray:
        qw = quantized[candidates[i].key]
        return dequantize(qw.packed, qw.scales, qw.k, qw.group_size).astype(np.float32)

    def run(int4_layers: Sequence[int]) -> float:
        report.runs += 1
        outs = session.run(None, {**feeds, **{candidates[i].weight_name: int4_weight(i) for i in int4_layers}})
        return worst_cosine(reference, outs)

    reference = session.run(None, dict(feeds))
    report.runs += 1
    alone = [run([i]) for i in range(len(candidates))]
    order = sorted(range(len(candidates)), key=lambda i: alone[i])  # most damaging first
    damage = [max(0.0, 1.0 - alone[i]) for i in order]
    budget = 1.0 - target_cosine
    # guess: the fewest kept (a prefix of `order`) whose remaining damages sum within budget
    guess = next(k for k in range(len(order) + 1) if sum(damage[k:]) <= budget)

    cosine_at: dict[int, float] = {len(order): 1.0}
    lo, hi = -1, len(order)  # a keep-count known to miss (or none), the smallest known to reach
    for k in (0, guess):  # every layer INT4 first, then the guess, then bisection
        if lo < k < hi or (k == 0 and hi > 0):
            cosine_at[k] = run(order[k:])
            lo, hi = (lo, k) if cosine_at[k] >= target_cosine else (k, hi)
    while hi - lo > 1:
        k = (lo + hi) // 2
        cosine_at[k] = run(order[k:])
        lo, hi = (lo, k) if cosine_at[k] >= target_cosine else (k, hi)
    report.cosine_all_int4 = cosine_at.get(0)
    report.cosine_probe = cosine_at[hi]
    kept_set = set(order[:hi])
    report.layers = [LayerSensitivity(c.key, c.w.nbytes, alone[i], i in kept_set) for i, c in enumerate(candidates)]
    keep = {
        candidates[i].key: _keep_reason(rank + 1, len(order), report.layers[i]) for rank, i in enumerate(order[:hi])
    }
    return keep, quantized, report


def export_mixed(
    model: onnx.ModelProto, feeds: str | os.PathLike | Feeds, target_cosine: float, options: ExportOptions
) -> tuple[onnx.ModelProto, ExportSummary]:
    """Rewrite ``model`` keeping its most sensitive layers FP32 so its outputs reach ``target_cosine`` on ``feeds``."""
    feeds = load_feeds(feeds, model)
    keep, quantized, report = plan(model, feeds, target_cosine, options)
    out, summary = rewrite_model(model, options, keep=keep, quantized=quantized)
    summary.mixed_precision = report
    if summary.rewritten:
        fp32 = _session(model, session_options(pin=False))
        int4 = _session(out, session_options(pin=False))
        report.cosine_exported = worst_cosine(fp32.run(None, dict(feeds)), int4.run(None, dict(feeds)))
    return out, summary


__all__ = [
    "DEFAULT_TARGET_COSINE",
    "LayerSensitivity",
    "MixedPrecision",
    "export_mixed",
    "load_feeds",
    "plan",
    "worst_cosine",
    "worst_rel_l2",
]
