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

With scale rule ``auto``, two runs before step 2 choose the rule (``choose_rule``): every
layer INT4 with ``balanced``, then with ``signed`` (round-to-nearest, what MatMulNBits does);
the one with the better *mean* cosine over the calibration rows quantizes every layer (the
worst row of a small batch is too noisy to choose by). ``target_cosine=0`` stops there: no layer
is kept FP32 and no per-layer run is made.

The exported model is then run once with CimInt4MatMul to report the cosine it reaches.
Cosine (``cim_int4.metrics.worst_cosine``, with its rule for non-finite values): per float
output and per index of its first axis (the batch), the worst over all of them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort

from ..graphs.feeds import load_feeds
from ..metrics import row_cosines, worst, worst_cosine
from ..ops.ort_model import proto_session
from ..ops.reference import dequantize
from ..ops.session import session_options
from .options import DEFAULT_TARGET_COSINE, ExportOptions, Feeds
from .probe import probe_model
from .quantize import QuantizedWeight, quantize_weight
from .rewrite import rewrite_model
from .scale_rules import AUTO_CHOICES
from .summary import ExportSummary, LayerSensitivity, MixedPrecision, RuleChoice


def calibration_feeds(source: str | os.PathLike | Feeds, model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Calibration inputs from an ``.npz`` file (graphs.load_feeds) or a dict, checked against ``model``'s inputs."""
    if isinstance(source, Mapping):
        feeds, where = {k: np.asarray(v) for k, v in source.items()}, "feeds"
    else:
        feeds, where = load_feeds(source), str(source)
    initializers = {t.name for t in model.graph.initializer}
    needed = [i.name for i in model.graph.input if i.name not in initializers]
    missing = [n for n in needed if n not in feeds]
    unknown = [n for n in feeds if n not in {i.name for i in model.graph.input}]
    if missing or unknown:
        raise ValueError(f"{where}: model inputs {needed}; missing {missing}, not inputs of the model {unknown}")
    return feeds


def _keep_reason(rank: int, count: int, layer: LayerSensitivity) -> str:
    return (
        f"kept in FP32 by mixed precision: sensitivity rank {rank} of {count} "
        f"(output cosine {layer.cosine_alone:.6f} with only this layer INT4)"
    )


def plan(
    model: onnx.ModelProto, feeds: Feeds, options: ExportOptions
) -> tuple[dict[str, str], dict[str, QuantizedWeight], MixedPrecision]:
    """Which candidate layers to keep FP32 (key -> reason), every candidate's INT4 weight, and the report."""
    target_cosine = options.target_cosine
    if not 0.0 <= target_cosine <= 1.0:
        raise ValueError(f"target_cosine must be in [0, 1] (0: keep no layer FP32), got {target_cosine!r}")
    probe, candidates = probe_model(model, options)
    report = MixedPrecision(target_cosine=target_cosine)
    if not candidates:
        return {}, {}, report
    quiet = ort.SessionOptions()
    quiet.log_severity_level = 3  # ORT warns that overridable initializers are not constant-folded
    session = proto_session(probe, quiet)

    def quantize_all(rule: str) -> dict[str, QuantizedWeight]:
        return {c.key: quantize_weight(c.w, options.group_size, rule) for c in candidates}

    def cosines(int4_layers: Sequence[int], weights: Mapping[str, QuantizedWeight]) -> np.ndarray:
        """Every output row's cosine vs FP32 with ``int4_layers`` INT4 (``weights``) and the rest FP32."""
        report.runs += 1
        int4 = {}
        for i in int4_layers:
            qw = weights[candidates[i].key]
            int4[candidates[i].weight_name] = dequantize(qw.packed, qw.scales, qw.k, qw.group_size).astype(np.float32)
        return row_cosines(reference, session.run(None, {**feeds, **int4}))

    def run(int4_layers: Sequence[int]) -> float:
        return worst(cosines(int4_layers, quantized))

    reference = session.run(None, dict(feeds))
    report.runs += 1
    everyone = range(len(candidates))
    cosine_at: dict[int, float] = {len(candidates): 1.0}  # keep-count (a prefix of `order`) -> cosine
    if options.scale_rule == "auto":
        tried = {rule: quantize_all(rule) for rule in AUTO_CHOICES}
        rows = {rule: cosines(everyone, weights) for rule, weights in tried.items()}
        report.rule_choice = choose_rule({rule: float(np.mean(c)) if c.size else 1.0 for rule, c in rows.items()})
        quantized = tried[report.rule_choice.chosen]
        cosine_at[0] = worst(rows[report.rule_choice.chosen])
    else:
        quantized = quantize_all(options.scale_rule)
    if target_cosine == 0.0:
        if 0 not in cosine_at:
            cosine_at[0] = run(everyone)
        report.cosine_all_int4 = report.cosine_probe = cosine_at[0]
        report.layers = [LayerSensitivity(c.key, c.w.nbytes, float("nan"), False) for c in candidates]
        return {}, quantized, report
    alone = [run([i]) for i in everyone]
    order = sorted(range(len(candidates)), key=lambda i: alone[i])  # most damaging first
    damage = [max(0.0, 1.0 - alone[i]) for i in order]
    budget = 1.0 - target_cosine
    # guess: the fewest kept (a prefix of `order`) whose remaining damages sum within budget
    guess = next(k for k in range(len(order) + 1) if sum(damage[k:]) <= budget)

    lo, hi = -1, len(order)  # a keep-count known to miss (or none), the smallest known to reach
    for k in (0, guess):  # every layer INT4 first, then the guess, then bisection
        if lo < k < hi or (k == 0 and hi > 0):
            if k not in cosine_at:
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


def choose_rule(cosine: Mapping[str, float]) -> RuleChoice:
    """The RuleChoice for the mean output cosine of every rule in AUTO_CHOICES (every layer INT4)."""
    return RuleChoice({rule: float(cosine[rule]) for rule in AUTO_CHOICES})


def export_mixed(model: onnx.ModelProto, options: ExportOptions) -> tuple[onnx.ModelProto, ExportSummary]:
    """Rewrite ``model`` keeping its most sensitive layers FP32 so its outputs reach the target cosine on the feeds."""
    if options.feeds is None:
        raise ValueError("a mixed-precision export needs feeds (the calibration inputs)")
    feeds = calibration_feeds(options.feeds, model)
    keep, quantized, report = plan(model, feeds, options)
    out, summary = rewrite_model(model, options, keep=keep, quantized=quantized)
    summary.mixed_precision = report
    if report.rule_choice is not None:
        summary.scale_rule = f"auto: {report.rule_choice.chosen}"
    if summary.rewritten:
        fp32 = proto_session(model, session_options(pin=False))
        int4 = proto_session(out, session_options(pin=False))
        report.cosine_exported = worst_cosine(fp32.run(None, dict(feeds)), int4.run(None, dict(feeds)))
    return out, summary


__all__ = [
    "DEFAULT_TARGET_COSINE",
    "LayerSensitivity",
    "MixedPrecision",
    "RuleChoice",
    "choose_rule",
    "export_mixed",
    "calibration_feeds",
    "plan",
]
