"""Quantization methods on calibration inputs: round-to-nearest, GPTQ, AWQ, and ``auto`` choosing among them.

* ``rtn``: each group rounded on its own under the scale rule (no calibration needed).
* ``gptq``: ``exporter.gptq`` with each layer's ``X^T X`` from the calibration pass.
* ``awq``: ``exporter.awq`` scales searched per layer input and folded into the model
  (which then computes the same FP32 function), then round-to-nearest.
* ``awq+gptq``: AWQ's scales folded in, then GPTQ on the scaled layers (their statistics follow
  from the scales: ``X^T X / (s s^T)``).
* ``auto``: every method above; without feeds it is ``rtn`` (an export without calibration
  inputs is unchanged).

Scale rule ``auto`` means every rule of ``AUTO_CHOICES`` under each method. When more than
one (method, rule) pair is in play, each quantizes every layer and the model runs once over
the calibration batches per pair; the pair with the best mean output cosine over the
calibration rows wins (``RuleChoice``) if it cuts the default pair's damage (``1 - cosine``)
by ``summary.CHOICE_MARGIN`` (5%) or more; else the default pair stays: the method asked for
(``rtn`` for ``auto``) under the rule asked for (for ``auto`` the one an export without feeds
uses). Costs, in ORT runs of the model over the B batches:
B for the FP32 reference (plus B for the calibration pass when a method needs it: the
statistics are gathered in the reference run's session, a second pass since the reference
outputs are kept apart), then B per pair compared. AWQ needs a second session of the
transformed model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from ..contract import grid_of
from . import awq
from .calibration import Calibration, Feeds, Stats, split
from .gptq import Factor, factor, gptq_quantize
from .options import CALIBRATED, ExportOptions
from .probe import Probe
from .quantize import QuantizedWeight, quantize_weight
from .rewrite import node_label
from .scale_rules import AUTO_CHOICES, auto_rule
from .summary import RuleChoice
from .widths import width_of
from .writer import TensorStore


@dataclass
class Calibrated:
    """The model to rewrite (AWQ scales folded in, or the input), its probe, INT4 weights, the choice."""

    model: onnx.ModelProto
    probe: Probe
    quantized: dict[str, QuantizedWeight]
    choice: RuleChoice | None = None
    calibration: Calibration | None = None
    awq_inputs: int = 0  # layer inputs whose AWQ scale was folded into the chosen model
    other_runs: int = 0  # runs of a probe session not chosen (AWQ's, or the input model's)
    all_int4: np.ndarray | None = None  # the chosen weights' row cosines on every batch, when the choice measured them


def _label(method: str, rule: str, methods: Sequence[str]) -> str:
    return rule if methods == ("rtn",) else f"{method}/{rule}"


def quantize_candidates(
    probe: Probe,
    method: str,
    rule: str,
    options: ExportOptions,
    calibration: Calibration | None,
    factors: dict[str, Factor] | None = None,
    widths: Mapping[str, int] | None = None,
) -> dict[str, QuantizedWeight]:
    """Every candidate of ``probe`` quantized with ``method`` ("rtn" or "gptq") and scale rule ``rule``.

    ``widths`` (key -> bits) overrides the widths of ``options.bits``.

    ``factors`` holds GPTQ's factor of the last layer input (q, k and v share theirs), kept across calls.
    """
    out = {}
    factors = {} if factors is None else factors
    for i, c in enumerate(probe.candidates):
        bits = widths[c.key] if widths is not None else width_of(options.bits, c.key, c.name)  # as the rewrite
        out[c.key] = quantize_layer(probe, i, method, rule, bits, options, calibration, factors)
    return out


def quantize_layer(
    probe: Probe,
    index: int,
    method: str,
    rule: str,
    bits: int,
    options: ExportOptions,
    calibration: Calibration | None,
    factors: dict[str, Factor],
) -> QuantizedWeight:
    """Candidate ``index`` of ``probe`` quantized ``bits`` wide with ``method`` ("rtn" or "gptq") and ``rule``.

    A layer inside an If/Loop/Scan body has no statistics: round-to-nearest. ``factors`` holds
    GPTQ's factor of the last layer input (q, k and v share theirs), kept across calls.
    """
    c = probe.candidates[index]
    if method != "gptq" or c.key not in probe.measured:
        return quantize_weight(c.w, options.group_size, rule, bits, options.scale_dtype, grid_of(options.grid, bits))
    assert calibration is not None
    x = probe.inputs[c.key]
    if x not in factors:
        factors.clear()  # readers of one input come together (q, k, v): one factor alive at a time
        xtx = calibration.stats[x].xtx
        factors[x] = factor(xtx, options.group_size, options.gptq_damp, options.gptq_act_order)
    return gptq_quantize(
        c.w,
        factors[x],
        options.group_size,
        rule,
        block=options.gptq_block,
        scale_dtype=options.scale_dtype,
        bits=bits,
        grid=grid_of(options.grid, bits),
    )


class _Scaled(Mapping[str, Stats]):
    """The statistics of the layer inputs of a model with AWQ scales folded in, derived on access (no copy held)."""

    def __init__(self, stats: Mapping[str, Stats], scales: Mapping[str, np.ndarray]) -> None:
        self.stats, self.scales = stats, scales

    def __getitem__(self, x: str) -> Stats:
        return awq.transformed_stats(self.stats[x], self.scales[x]) if x in self.scales else self.stats[x]

    def __iter__(self) -> Iterator[str]:
        return iter(self.stats)

    def __len__(self) -> int:
        return len(self.stats)


def _awq_model(
    model: onnx.ModelProto, probe: Probe, calibration: Calibration, options: ExportOptions, rule: str
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """``model`` with AWQ scales folded in (searched under ``rule``; ``model`` if none helps), and the scales."""
    keys = {c.key: c for c in probe.candidates}
    readers = {}
    for i, node in enumerate(model.graph.node):
        c = keys.get(node_label(node, i))
        if c is not None and node.op_type == "MatMul" and probe.inputs[c.key] == node.input[0]:
            readers[i] = c
    sites = awq.find_sites(model, {i: c.w.shape[0] for i, c in readers.items()})
    scales = {}
    for site in sites:
        weights = [readers[r].w for r in site.readers]
        s, loss, plain = awq.search(weights, calibration.stats[site.x], options.group_size, rule, options.scale_dtype)
        if loss < plain:
            scales[site.x] = s
    if not scales:
        return model, {}
    return awq.apply_scales(model, sites, scales), scales


def calibrate(
    model: onnx.ModelProto, batches: Sequence[Feeds], options: ExportOptions, tensors: TensorStore | None = None
) -> Calibrated:
    """Quantize every candidate layer of ``model`` with ``options.method`` on the calibration ``batches``.

    ``tensors`` reads ``model``'s weights from their files (no AWQ then: it rewrites initializers).
    """
    methods = ("rtn", "gptq", "awq", "awq+gptq") if options.method == "auto" else (options.method,)
    rules = AUTO_CHOICES if options.scale_rule == "auto" else (options.scale_rule,)
    pairs = [(m, r) for m in methods for r in rules]
    needs_stats = any(m in CALIBRATED for m in methods)
    # Calibrated methods compared on rows they were not fitted on (calibration.split).
    batches = list(batches)
    held = split(batches) if needs_stats and len(pairs) > 1 else []
    probe = Probe(model, options, batches, calibrate=needs_stats, tensors=tensors)
    # One pair and no layer to keep: the FP32 outputs serve once (the exported model's check), so they are
    # run again then rather than held through the export (an LLM's logits: 100 MB and more a window).
    probe.keep_reference = len(pairs) > 1 or options.target_cosine > 0
    result = Calibrated(model, probe, {})
    if not probe.candidates:
        return result
    full = None
    if needs_stats:
        fitted, other = probe.calibrate(held)
        full = fitted
        if other is not None:
            stats = {t: fitted.stats[t] + other.stats[t] for t in fitted.stats}
            full = Calibration(stats, len(batches), 2 * fitted.state_bytes)
            del other
        result.calibration = full
    awq_rule = "mse" if len(rules) > 1 else rules[0]

    cache: dict[int, dict[str, Factor]] = {}
    shifted_cache: dict[int, tuple[Probe, Calibration, int]] = {}

    def build(
        method: str, rule: str, calibration: Calibration | None, final: bool = False
    ) -> tuple[Probe, dict[str, QuantizedWeight]]:
        if not method.startswith("awq"):
            factors = cache.setdefault(id(calibration), {})
            return probe, quantize_candidates(probe, method, rule, options, calibration, factors)
        assert calibration is not None
        if id(calibration) not in shifted_cache:  # one search per calibration, whatever the rule
            shifted, scales = _awq_model(model, probe, calibration, options, awq_rule)
            if final and shifted is not model:
                probe.session = None  # its runs are over: one session of the model in memory, not two
            where = probe if shifted is model else Probe(shifted, options, batches)
            if where is not probe:
                where.share_reference(probe)
                where.model = shifted
            result.other_runs += sum(p.runs for p, _, _ in shifted_cache.values())
            shifted_cache.clear()
            cache.clear()  # factors are keyed by id(): a freed Calibration's id may come back
            scaled = Calibration(_Scaled(calibration.stats, scales), calibration.runs, calibration.state_bytes)
            shifted_cache[id(calibration)] = (where, scaled, len(scales))
        where, scaled, result.awq_inputs = shifted_cache[id(calibration)]
        if method == "awq":
            return where, quantize_candidates(where, "rtn", rule, options, None)
        factors = cache.setdefault(id(scaled), {})
        return where, quantize_candidates(where, "gptq", rule, options, scaled, factors)

    if len(pairs) > 1:
        cosine: dict[str, float] = {}
        rows_of_pair: dict[tuple[str, str], np.ndarray] = {}
        for m, r in pairs:
            where, weights = build(m, r, fitted if needs_stats else None)
            rows = where.cosines(range(len(where.candidates)), weights, held or None)
            cosine[_label(m, r, methods)] = float(np.mean(rows)) if rows.size else 1.0
            if not held:
                rows_of_pair[(m, r)] = rows
            del where, weights
        # The default pair: the method asked for (rtn for "auto") under the rule asked for ("auto": the one an
        # export without feeds uses).
        default_rule = auto_rule(options.group_size) if options.scale_rule == "auto" else options.scale_rule
        default = _label("rtn" if options.method == "auto" else options.method, default_rule, methods)
        result.choice = RuleChoice(cosine, default)
        method, rule = next((m, r) for m, r in pairs if _label(m, r, methods) == result.choice.chosen)
        result.all_int4 = rows_of_pair.get((method, rule))
    else:
        method, rule = pairs[0]
    result.awq_inputs = 0  # the comparison's AWQ pairs set it; only the chosen pair's counts
    result.probe, result.quantized = build(method, rule, full, final=True)
    result.model = result.probe.model or model
    if needs_stats:  # the statistics have served: free them before the runs that follow
        fitted.stats, full.stats = {}, {}
    others = {id(p): p for p, _, _ in shifted_cache.values()} | {id(probe): probe}
    result.other_runs += sum(p.runs for p in others.values() if p is not result.probe)
    return result


__all__ = ["Calibrated", "RuleChoice", "calibrate", "quantize_candidates", "quantize_layer"]
