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

Before step 2, ``exporter.methods.calibrate`` quantizes every layer: with scale rule or
method ``auto`` it runs the model with every layer INT4 under each (method, rule) pair and
keeps the pair with the better *mean* cosine over the calibration rows (the worst row of a
small batch is too noisy to choose by) if it cuts the default pair's damage by 5%
(``summary.CHOICE_MARGIN``); GPTQ and AWQ first gather each layer's input statistics
(``exporter.calibration``). ``target_cosine=0`` keeps no layer FP32 and makes no
probe run with INT4 weights: the exported model's check (below) is the every-layer-INT4 cosine.

The calibration inputs are one batch (a dict, an ``.npz``) or several (an iterable of dicts):
every run goes over all of them, and cosines are taken per row of each.

The exported model is then run once with CimInt4MatMul to report the cosine it reaches.
Cosine (``cim_int4.metrics.worst_cosine``, with its rule for non-finite values): per float
output and per index of its first axis (the batch), the worst over all of them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np
import onnx

from ..metrics import row_cosines, worst
from ..ops.ort_model import proto_session
from ..ops.session import session_options
from .allocate import allocate
from .calibration import feed_batches
from .memory import release_memory
from .methods import calibrate
from .options import DEFAULT_TARGET_COSINE, ExportOptions, Feeds
from .probe import Probe
from .quantize import QuantizedWeight
from .rewrite import rewrite_model
from .scale_rules import AUTO_CHOICES
from .summary import ExportSummary, LayerSensitivity, MixedPrecision, RuleChoice
from .widths import AUTO
from .writer import TensorStore


def calibration_feeds(source: str | os.PathLike | Feeds, model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """One batch of calibration inputs from an ``.npz`` file or a dict, checked against ``model``'s inputs."""
    return feed_batches(source, model)[0]


def _keep_reason(rank: int, count: int, layer: LayerSensitivity) -> str:
    return (
        f"kept in FP32 by mixed precision: sensitivity rank {rank} of {count} "
        f"(output cosine {layer.cosine_alone:.6f} with only this layer INT4)"
    )


def plan(
    model: onnx.ModelProto, feeds: Feeds | Sequence[Feeds], options: ExportOptions
) -> tuple[onnx.ModelProto, dict[str, str], dict[str, QuantizedWeight], MixedPrecision]:
    """The model to rewrite, the layers to keep FP32 (key -> reason), every candidate's INT4 weight, the report.

    ``feeds``: one batch (a dict) or a sequence of batches. The model returned is ``model``, or
    a copy with AWQ scales folded in when that method was chosen.
    """
    return _plan(model, feeds, options)[:4]


def _plan(
    model: onnx.ModelProto, feeds: Feeds | Sequence[Feeds], options: ExportOptions, tensors: TensorStore | None = None
) -> tuple[onnx.ModelProto, dict[str, str], dict[str, QuantizedWeight], MixedPrecision, Probe]:
    """``plan``, and the probe it ran (its FP32 outputs serve the exported model's check)."""
    target_cosine = options.target_cosine
    if not 0.0 <= target_cosine <= 1.0:
        raise ValueError(f"target_cosine must be in [0, 1] (0: keep no layer FP32), got {target_cosine!r}")
    batches = [feeds] if isinstance(feeds, Mapping) else list(feeds)
    chosen = calibrate(model, batches, options, tensors)
    probe, candidates, quantized = chosen.probe, chosen.probe.candidates, chosen.quantized
    report = MixedPrecision(target_cosine=target_cosine, rule_choice=chosen.choice, awq_inputs=chosen.awq_inputs)
    report.method = options.method
    if chosen.calibration is not None:
        report.calibration_runs = chosen.calibration.runs
        report.calibration_bytes = chosen.calibration.state_bytes
    if not candidates:
        return chosen.model, {}, {}, report, probe

    def run(int4_layers: Sequence[int]) -> float:
        return worst(probe.cosines(int4_layers, quantized))

    everyone = range(len(candidates))
    cosine_at: dict[int, float] = {len(candidates): 1.0}  # keep-count (a prefix of `order`) -> cosine
    if chosen.all_int4 is not None:
        cosine_at[0] = worst(chosen.all_int4)

    def finish() -> None:
        report.runs = probe.runs + chosen.other_runs

    if target_cosine == 0.0:
        # Unless the method choice measured it, the exported model's check gives this cosine
        # (export_mixed): no probe run feeding every dequantized weight (a second FP32-sized copy).
        report.cosine_all_int4 = report.cosine_probe = cosine_at.get(0)
        report.layers = [LayerSensitivity(c.key, c.w.nbytes, float("nan"), False) for c in candidates]
        finish()
        return chosen.model, {}, quantized, report, probe
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
    finish()
    return chosen.model, keep, quantized, report, probe


def choose_rule(cosine: Mapping[str, float]) -> RuleChoice:
    """The choice for the mean output cosine of every rule in AUTO_CHOICES (every layer INT4)."""
    return RuleChoice({rule: float(cosine[rule]) for rule in AUTO_CHOICES})


def export_mixed(
    model: onnx.ModelProto, options: ExportOptions, owned: bool = False, tensors: TensorStore | None = None
) -> tuple[onnx.ModelProto, ExportSummary]:
    """Rewrite ``model`` keeping its most sensitive layers FP32 so its outputs reach the target cosine on the feeds.

    ``owned``: the caller is done with ``model``, which is then rewritten in place (no second copy of its weights).
    ``tensors``: ``model``'s weights stay in their files, read from there (and the output's written) as in
    ``rewrite_model``; the probe then holds the only copy of them in memory.
    """
    if options.feeds is None:
        raise ValueError("a mixed-precision export needs feeds (the calibration inputs)")
    batches = feed_batches(options.feeds, model)
    if options.bits == AUTO:
        return _export_auto_widths(model, batches, options, in_place=owned, tensors=tensors)
    chosen, keep, quantized, report, probe = _plan(model, batches, options, tensors)
    # The FP32 outputs kept (on disk when large) and the probe's FP32 weights dropped before the
    # rewrite and the exported model's session; when they do not fit, the check runs them again.
    before = probe.runs
    probe.drop_weights()
    report.runs += probe.runs - before
    in_place = owned or chosen is not model
    out, summary = rewrite_model(chosen, options, keep=keep, quantized=quantized, tensors=tensors, in_place=in_place)
    del chosen, model
    release_memory()
    summary.mixed_precision = report
    if report.rule_choice is not None:
        summary.scale_rule = f"auto: {report.rule_choice.chosen}"
    elif options.method != "rtn" or options.scale_rule == "auto":
        summary.scale_rule = f"{options.method} {summary.scale_rule}"
    if summary.rewritten:
        before = probe.runs
        report.cosine_exported = _exported_cosine(out, probe, summary, tensors)
        report.runs += probe.runs - before
        if report.cosine_probe is None:  # target 0: the exported model is the every-layer-INT4 model
            report.cosine_all_int4 = report.cosine_probe = report.cosine_exported
    return out, summary


def _exported_cosine(
    out: onnx.ModelProto, probe: Probe, summary: ExportSummary, tensors: TensorStore | None = None
) -> float | None:
    """Worst cosine of the exported model (run with the op library) vs the FP32 outputs on the probe's batches.

    The FP32 outputs are the probe's (kept, or run again in its session: no second FP32
    session). With ``tensors`` (a streamed export) ``out``'s weights are in their files: a copy
    with them read back is run. None, with a warning in ``summary``, when the op library on this
    machine does not run the model (widths or scale types whose kernels it does not have yet).
    """
    probe.release_session()
    release_memory()
    check, own = out, tensors is not None
    if own:  # the int4 tensors come back from the output's data file, into a copy ORT then takes from a file
        check = onnx.ModelProto()
        check.CopyFrom(out)
        tensors.inline(check)
    try:
        int4 = proto_session(check, session_options(pin=False), via_file=own, consume=own)
    except Exception as e:  # noqa: BLE001 - ORT raises several types for a node the library refuses
        summary.warnings.append(f"exported model not run here (ONNX Runtime: {str(e).splitlines()[0][:240]})")
        return None
    del check
    cos = [row_cosines(probe.reference(i), int4.run(probe.outputs, dict(b))) for i, b in enumerate(probe.batches)]
    return worst(np.concatenate(cos))


def _export_auto_widths(
    model: onnx.ModelProto,
    batches: Sequence[Feeds],
    options: ExportOptions,
    in_place: bool = False,
    tensors: TensorStore | None = None,
) -> tuple[onnx.ModelProto, ExportSummary]:
    """``bits="auto"``: widths per layer (exporter.allocate), the rewrite, and the exported model's cosine.

    ``tensors``: as in ``export_mixed`` (the probe holds the one FP32 copy of the weights in memory).
    """
    keep, quantized, table_widths, allocation, probe = allocate(
        model, batches, options, options.bits_sensitivity, tensors
    )
    probe.drop_weights()  # as export_mixed: no FP32 weights beside the rewrite and the check
    out, summary = rewrite_model(
        model, options, keep=keep, quantized=quantized, table_widths=table_widths, tensors=tensors, in_place=in_place
    )
    del quantized, model
    release_memory()
    summary.allocation = allocation
    summary.scale_rule = f"auto: {allocation.scale_rule}" if options.scale_rule == "auto" else options.scale_rule
    if summary.rewritten:
        allocation.cosine_exported = _exported_cosine(out, probe, summary, tensors)
    allocation.runs = probe.runs  # with the outputs kept for the check, or its FP32 reruns
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
