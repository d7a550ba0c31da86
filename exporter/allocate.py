"""``bits="auto"``: a code width per layer from measured sensitivity, under a byte budget or for a target cosine.

The analysis runs on the probe (``exporter.probe``: the model with each candidate layer's
weight overridable, run in plain ONNX Runtime) over the calibration batches:

1. one run per batch with FP32 weights: the reference outputs and, per candidate whose input
   is a main-graph tensor, the per-input-channel power ``E[x_k^2]`` (method ``gptq``: the whole
   ``X^T X``, GPTQ's statistics);
2. a *damage* per layer and width b in ``WIDTHS`` (FP32 has none), with only that layer at b
   bits: when the model has a ``logits`` output (an LLM; its KV-cache outputs would outnumber
   it), the KL divergence of the next-token distributions from FP32's, averaged over every
   position (what perplexity pays: a cosine of a window's logits weighs the whole vocabulary's
   logits alike, and on SmolLM2 it sent the tied LM head to 2 bits at a budget of 3.0, 4.15x
   the 4-bit RTN gap); else ``1 - cosine`` of the outputs, averaged over the calibration rows.
   Two measures:

   * ``exact``: one run per layer and width (``L * len(WIDTHS)`` runs);
   * ``proxy``: no run: the layer's relative output error on its inputs,
     ``sum_k E[x_k^2] sum_n e[k, n]^2 / sum_k E[x_k^2] sum_n w[k, n]^2`` (e the weight error),
     scaled per layer to the exact damage at one *anchor* width (``L`` runs, one per layer), so
     that layers are compared at the model's output and widths by the weight error. The anchor
     (``anchor_width``) is the widest width at or under the budget (3 for a budget of 3.0, 4 for
     4.5; 4 without a budget): the choices a budget leaves open are between the widths next to
     it, and the further the proxy carries a damage the less it holds (a logit's KL grows faster
     than the weight error at 2 bits). With method
     ``gptq`` every width is quantized by GPTQ and the relative error is taken under the
     layer input's whole ``X^T X`` (``tr(E^T H E) / tr(W^T H W)``, the output error GPTQ
     minimises: its codes trade raw weight error for error along the inputs' quiet directions);

   ``BITS_SENSITIVITIES`` (option ``bits_sensitivity``); ``auto`` uses ``exact`` while it costs
   at most ``EXACT_MAX_RUNS`` runs, else the proxy;
3. damages are assumed to add across layers. Each layer's (bytes, damage) points at every
   width and FP32 form a lower convex hull; hull steps of all layers, taken in order of
   damage saved per byte (a Lagrangian relaxation, optimal on the hulls), give the
   allocation for any budget. With ``bits_budget`` the steps are taken while they fit (then
   any smaller upgrade that still fits); without, the fewest steps whose allocation reaches
   ``target_cosine`` in a full run (bisection over the step count, ``log2`` of it runs).

A budget is bits per weight over every candidate layer (codes with K's padding, scales,
32 for a layer left FP32); a tied LM head counts once, with its embedding table, which
takes the head's width. Embedding tables without a tied head are not in the budget: they
get ``DEFAULT_BITS`` (they stream one row per token, not every weight).

With ``gptq`` the damages are measured on the rows GPTQ was fitted on (no held-out split, unlike
``methods.calibrate``'s choice of method): on few calibration rows they come out optimistic,
most at the narrowest widths.

Memory: the probe holds the one FP32 copy of the weights (read once from the file when the
export streams, ``api``); GPTQ's ``X^T X`` of every input go to a temporary folder after the
calibration pass (``calibration.spilled``) and come back an input at a time; one layer's
quantized weight is alive at a time besides the chosen ones (and, in a target-cosine
bisection, the previous step's). The export then keeps the FP32 outputs on disk and drops the
probe's weights before the rewrite and the exported model's check (``Probe.drop_weights``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx

from ..contract import DEFAULT_BITS, SUPPORTED_BITS
from ..metrics import row_kl
from ..ops.reference import dequantize
from .calibration import spilled
from .fold import NotFoldable, Scope
from .memory import release_memory
from .methods import quantize_layer
from .options import BITS_SENSITIVITIES, ExportOptions, Feeds
from .probe import Probe
from .probe_model import Candidate
from .quantize import QuantizedWeight
from .scale_rules import AUTO_CHOICES, auto_rule
from .summary import RuleChoice
from .widths import FP32_BITS, bits_per_weight
from .writer import TensorStore

WIDTHS = SUPPORTED_BITS
# The output an LLM is judged by; when a model has it, damages and cosines are taken on it alone.
LOGITS = "logits"
# ``auto`` measures exactly while that costs at most this many runs of the model over the batches.
EXACT_MAX_RUNS = 400
# relative_error under X^T X goes over output channels in blocks of this many float64 bytes.
_COLUMN_BYTES = 16 << 20


@dataclass(frozen=True)
class LayerWidth:
    """One candidate layer's outcome: its width (None: FP32), weights, and damage per width (measured or proxy)."""

    name: str
    weights: int
    bits: int | None
    damage: Mapping[int, float]
    proxy: Mapping[int, float] = field(default_factory=dict)


@dataclass
class WidthAllocation:
    """What ``bits="auto"`` decided: the width per layer, the budget or target, what the model reached."""

    budget: float | None
    target_cosine: float
    sensitivity: str
    scale_rule: str
    method: str = "rtn"  # how every width was quantized: "rtn" or "gptq"
    layers: list[LayerWidth] = field(default_factory=list)
    bits_per_weight: float = 0.0
    # Worst row and mean, chosen widths, dequantized weights in ORT: measured for a target cosine
    # (its bisection); None under a budget, where the exported model's check is the measurement.
    cosine_probe: float | None = None
    mean_cosine_probe: float | None = None
    cosine_exported: float | None = None
    runs: int = 0
    damage: str = "1 - cosine"  # what a layer's damage measures (the logits' KL for an LLM)
    rank_correlation: float | None = None  # Spearman, proxy vs exact damage at the anchor (when both were measured)
    anchor: int = DEFAULT_BITS  # the width whose damage the proxy measures exactly (anchor_width)
    rule_choice: RuleChoice | None = None  # scale rule "auto": each rule's mean cosine, every layer at 4 bits

    def format(self) -> str:
        """Lines for the export summary."""
        goal = f"budget {self.budget} bits per weight" if self.budget else f"target output cosine {self.target_cosine}"
        counts = {}
        for layer in self.layers:
            counts[layer.bits] = counts.get(layer.bits, 0) + 1
        mix = ", ".join(
            f"{n} at {'FP32' if b is None else f'{b} bits'}"
            for b, n in sorted(counts.items(), key=lambda x: 99 if x[0] is None else x[0])
        )
        lines = [
            f"  bits auto: {goal}, sensitivity {self.sensitivity} ({self.damage}), method {self.method}, "
            f"scale rule {self.scale_rule} ({self.runs} model runs)",
            f"    {len(self.layers)} layer(s): {mix}; {self.bits_per_weight:.3f} bits per weight incl. scales",
        ]
        if self.rule_choice is not None:
            lines.append(f"    scale rule auto: {self.rule_choice.describe('every layer at 4 bits')}")
        if self.cosine_probe is not None and self.mean_cosine_probe is not None:
            lines.append(
                f"    chosen widths: worst cosine {self.cosine_probe:.6f}, mean {self.mean_cosine_probe:.6f} "
                "(dequantized weights in ORT)"
            )
        if self.rank_correlation is not None:
            spearman_at = f"proxy vs exact damage at {self.anchor} bits: Spearman rank correlation"
            lines.append(f"    {spearman_at} {self.rank_correlation:.3f}")
        if self.cosine_exported is not None:
            lines.append(f"    exported model: cosine {self.cosine_exported:.6f}")
        return "\n".join(lines)


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation of two equally long sequences (ties ranked by order; NaN for < 2 items)."""
    if len(a) < 2:
        return float("nan")
    ra = np.argsort(np.argsort(np.asarray(a, dtype=np.float64)))
    rb = np.argsort(np.argsort(np.asarray(b, dtype=np.float64)))
    return float(np.corrcoef(ra, rb)[0, 1])


def relative_error(w: np.ndarray, qw: QuantizedWeight, power: np.ndarray | None) -> float:
    """The relative output error of ``qw`` on inputs of second moments ``power``, e its weight error.

    ``power`` [K] (``E[x_k^2]``): ``sum_k p_k sum_n e_kn^2 / sum_k p_k sum_n w_kn^2``; [K, K]
    (``X^T X``): ``tr(E^T H E) / tr(W^T H W)``; None: p = 1.
    """
    if power is not None and power.ndim == 2:
        h, err, ref = np.asarray(power, dtype=np.float64), 0.0, 0.0  # no copy when the caller made it float64
        step = max(1, _COLUMN_BYTES // (8 * len(w)))  # an LM head's [K, N] error would be hundreds of MB at once
        for n0 in range(0, qw.n, step):
            w64 = w[:, n0 : n0 + step].astype(np.float64)
            part = dequantize(
                qw.packed[n0 : n0 + step], qw.scales[n0 : n0 + step], qw.k, qw.group_size, qw.bits, grid=qw.grid
            )
            e = part - w64
            err += float(np.einsum("kn,kn->", h @ e, e))
            ref += float(np.einsum("kn,kn->", h @ w64, w64))
        return err / max(ref, 1e-30)
    e = dequantize(qw.packed, qw.scales, qw.k, qw.group_size, qw.bits, grid=qw.grid) - w
    err, ref = np.einsum("kn,kn->k", e, e), np.einsum("kn,kn->k", w, w, dtype=np.float64)
    p = np.ones(w.shape[0]) if power is None else power.astype(np.float64)
    return float(p @ err / max(float(p @ ref), 1e-30))


def anchor_width(budget: float | None) -> int:
    """The width the proxy measures exactly: the widest in ``WIDTHS`` at or under ``budget``; DEFAULT_BITS without."""
    if budget is None:
        return DEFAULT_BITS
    return max([b for b in WIDTHS if b <= budget] or [min(WIDTHS)])


def _hull(points: list[tuple[float, float, int | None]]) -> list[tuple[float, float, int | None]]:
    """Lower convex hull of (bytes, damage, width) points, from the cheapest: damage strictly falls along it."""
    pts = sorted(points, key=lambda p: (p[0], p[1]))
    hull: list[tuple[float, float, int | None]] = []
    for p in pts:
        if hull and p[1] >= hull[-1][1]:
            continue  # more bytes for no less damage
        while len(hull) >= 2:
            (x1, y1, _), (x2, y2, _) = hull[-2], hull[-1]
            # drop hull[-1] if it lies on or above the segment hull[-2] -> p
            if (y2 - y1) * (p[0] - x1) >= (p[1] - y1) * (x2 - x1):
                hull.pop()
            else:
                break
        hull.append(p)
    return hull


@dataclass(frozen=True)
class Step:
    """One upgrade of a layer along its hull: to ``bits`` (None: FP32) for ``extra`` bytes, saving ``saved`` damage."""

    layer: int
    bits: int | None
    extra: float
    saved: float


def steps_in_order(
    costs: Sequence[Mapping[int | None, float]], damages: Sequence[Mapping[int | None, float]]
) -> tuple[list[int | None], list[Step]]:
    """Each layer's cheapest hull width and every hull step of every layer, best damage saved per byte first."""
    start, steps = [], []
    for i, (cost, damage) in enumerate(zip(costs, damages, strict=True)):
        hull = _hull([(cost[b], damage[b], b) for b in cost])
        start.append(hull[0][2])
        for (c0, d0, _), (c1, d1, b1) in zip(hull, hull[1:], strict=False):
            steps.append(Step(i, b1, c1 - c0, d0 - d1))
    # Convex hulls: each layer's own steps come out in its order (falling slope).
    steps.sort(key=lambda s: s.saved / s.extra, reverse=True)
    return start, steps


def apply_steps(start: Sequence[int | None], steps: Sequence[Step]) -> list[int | None]:
    """The widths after taking ``steps`` (in order) from ``start``."""
    widths = list(start)
    for s in steps:
        widths[s.layer] = s.bits
    return widths


def within_budget(
    start: Sequence[int | None],
    steps: Sequence[Step],
    costs: Sequence[Mapping[int | None, float]],
    damages: Sequence[Mapping[int | None, float]],
    budget_bytes: float,
) -> list[int | None]:
    """Take hull steps in order while they fit ``budget_bytes``; then spend what is left on single upgrades."""
    widths = list(start)
    spent = sum(c[b] for c, b in zip(costs, widths, strict=True))
    if spent > budget_bytes * (1 + 1e-9):
        raise ValueError(
            f"bits_budget is below the cheapest allocation ({spent * 8 / total_weights(costs):.3f} bits per weight "
            "with every layer at its narrowest width)"
        )
    for s in steps:
        if widths[s.layer] is not None and spent + s.extra <= budget_bytes:
            # steps of one layer come in hull order, so s starts where the layer is
            spent += costs[s.layer][s.bits] - costs[s.layer][widths[s.layer]]
            widths[s.layer] = s.bits
    # Greedy top-up: the upgrade (any wider width) saving most damage per byte that still fits.
    while True:
        best = None
        for i, (c, d) in enumerate(zip(costs, damages, strict=True)):
            for b in c:
                extra = c[b] - c[widths[i]]
                saved = d[widths[i]] - d[b]
                if extra > 0 and saved > 0 and spent + extra <= budget_bytes:
                    if best is None or saved / extra > best[0]:
                        best = (saved / extra, i, b, extra)
        if best is None:
            return widths
        _, i, b, extra = best
        widths[i], spent = b, spent + extra


def carried(proxy: Mapping[int, float], exact: float, anchor: int) -> dict[int, float]:
    """A layer's damage per width from the proxy: its ``exact`` damage at ``anchor``, carried to the other
    widths by the ratio of its relative errors ``proxy`` (per width)."""
    scale = exact / max(proxy[anchor], 1e-30)
    return {b: error * scale for b, error in proxy.items()}


def layer_costs(k: int, n: int, group_size: int, scale_dtype: str) -> dict[int | None, float]:
    """Bytes of a [K, N] layer at each width in ``WIDTHS`` (codes and scales) and in FP32 (None)."""
    cost: dict[int | None, float] = {b: bits_per_weight(k, n, group_size, b, scale_dtype) * k * n / 8 for b in WIDTHS}
    cost[None] = FP32_BITS * k * n / 8
    return cost


def total_weights(costs: Sequence[Mapping[int | None, float]]) -> float:
    """Weights of all layers (FP32 bytes / 4)."""
    return sum(c[None] for c in costs) / 4


def table_of_tied(model: onnx.ModelProto, probe: Probe, tensors: TensorStore | None = None) -> dict[str, str]:
    """Candidate key -> the data input of a main-graph Gather on a constant table whose transpose is its weight.

    The table is resolved as the rewrite resolves it (through Transpose, Identity, ...), so
    a head stored once and read by the Gather through a Transpose is found. ``tensors``: the
    model's weights are in their files (one table read at a time).
    """
    scope = Scope(model.graph, load=tensors.read if tensors is not None else None)
    seen: set[str] = set()
    found: dict[str, str] = {}
    for node in model.graph.node:
        if node.op_type != "Gather" or not node.input or node.input[0] in seen:
            continue
        try:
            folded = scope.resolve(node.input[0], "table")
        except NotFoldable:
            continue
        seen.add(node.input[0])
        if folded.value.ndim != 2 or folded.elem_type != onnx.TensorProto.FLOAT:
            continue
        for c in probe.candidates:
            if folded.value.shape == c.w.shape[::-1] and np.array_equal(folded.value.T, c.w):
                found[c.key] = node.input[0]
    return found


def allocate(
    model: onnx.ModelProto,
    batches: Sequence[Feeds],
    options: ExportOptions,
    sensitivity: str = "auto",
    tensors: TensorStore | None = None,
) -> tuple[dict[str, str], dict[str, QuantizedWeight], dict[str, int], WidthAllocation, Probe]:
    """Layers kept FP32 (key -> reason), the others' quantized weights, tied tables' widths, the report, the probe.

    ``tensors``: ``model``'s weights are in their files, read from there once into the probe.
    """
    if sensitivity not in BITS_SENSITIVITIES:
        raise ValueError(f"sensitivity must be one of {BITS_SENSITIVITIES}, got {sensitivity!r}")
    probe = Probe(model, options, batches, calibrate=True, tensors=tensors)
    candidates = probe.candidates
    report = WidthAllocation(options.bits_budget, options.target_cosine, sensitivity, options.scale_rule)
    if not candidates:
        return {}, {}, {}, report, probe
    gs, dtype = options.group_size, options.scale_dtype
    method = report.method = "gptq" if options.method == "gptq" else "rtn"
    calibration, power = None, {}
    if method == "gptq":  # X^T X per layer input: GPTQ's statistics, and the proxy's weighting
        calibration = probe.calibrate([])[0]
        calibration.stats = spilled(calibration.stats)  # read back an input at a time through the analysis
        release_memory()
    else:
        power = probe.input_power()

    def weighting_of(c: Candidate) -> np.ndarray | None:
        """The proxy's weighting of a layer's error: its input's X^T X (gptq) or E[x^2], float64; None if unknown."""
        if calibration is not None:
            found = calibration.stats[probe.inputs[c.key]].xtx if c.key in probe.measured else None
        else:
            found = power.get(c.key)
        return None if found is None else found.astype(np.float64)

    factors: dict = {}

    def quantized(i: int, bits: int, rule: str) -> QuantizedWeight:
        return quantize_layer(probe, i, method, rule, bits, options, calibration, factors)

    # An LLM's logits, not its KV-cache outputs: those outnumber it and miss the LM head's error entirely.
    scored = [i for i, name in enumerate(probe.outputs) if name == LOGITS] or None

    def mean_damage(weights: Mapping[str, QuantizedWeight], layers: Sequence[int]) -> tuple[float, float]:
        rows = probe.cosines(layers, weights, scored=scored)
        return float(np.mean(1.0 - rows)) if rows.size else 0.0, float(rows.min()) if rows.size else 1.0

    report.damage = "KL of the logits" if scored else "1 - cosine"

    def damage(weights: Mapping[str, QuantizedWeight], layers: Sequence[int]) -> float:
        """The sensitivity's damage of ``layers`` at ``weights``: mean KL of the logits if any, else 1 - cosine."""
        if not scored:
            return mean_damage(weights, layers)[0]
        rows = probe.compared(layers, weights, row_kl, scored=scored)
        return float(np.mean(rows)) if rows.size else 0.0

    rule = options.scale_rule
    if rule == "auto":  # the rule closest to FP32 with every layer at 4 bits (as calibrate's choice)
        tried = {}
        for r in AUTO_CHOICES:
            weights = {c.key: quantized(i, DEFAULT_BITS, r) for i, c in enumerate(candidates)}
            tried[r] = mean_damage(weights, range(len(candidates)))[0]
            del weights
        report.rule_choice = RuleChoice({r: 1.0 - d for r, d in tried.items()}, auto_rule(options.group_size))
        rule = report.rule_choice.chosen
    report.scale_rule = rule

    layers = range(len(candidates))
    mode = sensitivity
    if mode == "auto":
        mode = "exact" if len(candidates) * len(WIDTHS) <= EXACT_MAX_RUNS else "proxy"
    report.sensitivity = mode
    anchor = report.anchor = anchor_width(options.bits_budget)
    proxy: list[dict[int, float]] = [{} for _ in layers]
    measured: list[dict[int, float]] = [{} for _ in layers]
    for i in layers:  # one quantization per layer and width; one run per width measured
        c = candidates[i]
        weighting = weighting_of(c)  # once per layer, not per width
        for b in WIDTHS:
            qw = quantized(i, b, rule)
            proxy[i][b] = relative_error(c.w, qw, weighting)
            if mode == "exact" or b == anchor:
                measured[i][b] = damage({c.key: qw}, [i])
            del qw
    if mode == "proxy":
        for i in layers:
            measured[i] = carried(proxy[i], measured[i][anchor], anchor)
    report.rank_correlation = spearman([measured[i][anchor] for i in layers], [proxy[i][anchor] for i in layers])

    tied = {} if options.keep_embedding else table_of_tied(model, probe, tensors)
    costs = [layer_costs(*c.w.shape, gs, dtype) for c in candidates]
    damages = [{**m, None: 0.0} for m in measured]
    start, steps = steps_in_order(costs, damages)
    weights_total = total_weights(costs)

    last: dict[tuple[int, int], QuantizedWeight] = {}  # the previous allocation's weights (a bisection reuses most)

    def weights_of(widths: Sequence[int | None]) -> dict[str, QuantizedWeight]:
        nonlocal last
        last = {(i, b): last.get((i, b)) or quantized(i, b, rule) for i, b in enumerate(widths) if b is not None}
        return {candidates[i].key: qw for (i, _), qw in last.items()}

    def cosine_of(widths: Sequence[int | None]) -> tuple[float, float, dict[str, QuantizedWeight]]:
        weights = weights_of(widths)
        rows = probe.cosines([i for i, b in enumerate(widths) if b is not None], weights, scored=scored)
        return float(rows.min()), float(rows.mean()), weights

    worst: float | None = None
    mean: float | None = None
    if options.bits_budget is not None:
        # No probe run of the chosen widths: it would hold every layer's dequantized weight at once
        # (the export's peak), and the exported model's check measures the same widths with the op.
        widths = within_budget(start, steps, costs, damages, options.bits_budget * weights_total / 8)
        chosen = weights_of(widths)
    else:
        # The fewest steps (bytes) whose allocation reaches the target: a guess from the damages
        # (assumed to add), then bisection with full runs; taking every step (all FP32) reaches it.
        target = options.target_cosine
        remaining = np.cumsum([s.saved for s in steps][::-1])[::-1].tolist() + [0.0]
        guess = next(j for j in range(len(steps) + 1) if remaining[j] <= 1.0 - target)
        lo, hi, best = -1, len(steps), None
        j = guess
        while True:
            found = cosine_of(apply_steps(start, steps[:j]))
            if found[0] >= target:
                hi, best = j, found
            else:
                lo = j
            if hi - lo <= 1:
                break
            j = (lo + hi) // 2
        widths = apply_steps(start, steps[:hi])
        worst, mean, chosen = best if best is not None else cosine_of(widths)
    if calibration is not None:  # GPTQ's statistics have served: free them before the rewrite and the check
        calibration.stats = {}
    power.clear()
    factors.clear()
    report.cosine_probe, report.mean_cosine_probe = worst, mean
    report.bits_per_weight = 8 * sum(c[b] for c, b in zip(costs, widths, strict=True)) / weights_total
    report.layers = [
        LayerWidth(c.key, int(c.w.size), widths[i], measured[i], proxy[i]) for i, c in enumerate(candidates)
    ]
    report.runs = probe.runs
    keep = {
        c.key: f"kept in FP32 by bits auto (damage at 8 bits {measured[i][8]:.2e})"
        for i, c in enumerate(candidates)
        if widths[i] is None
    }
    table_widths = {tied[c.key]: widths[i] for i, c in enumerate(candidates) if c.key in tied and widths[i]}
    return keep, chosen, table_widths, report, probe
