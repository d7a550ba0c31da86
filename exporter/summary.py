"""What an export did, for the user: nodes rewritten and skipped, and what the sensitivity analysis kept FP32."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..contract import DEFAULT_BITS, GRID_BITS


@dataclass(frozen=True)
class LayerSensitivity:
    """One candidate layer: its output cosine when only it is INT4, and whether it stayed FP32."""

    name: str
    weight_bytes: int
    cosine_alone: float
    kept: bool


# A (method, rule) pair other than the default replaces it only when its mean damage (1 - cosine) on the
# calibration rows is at least this much smaller: on the repository's accuracy table the pairs that won by
# less (0.4-2.7% on held-out rows of one batch) lost or tied on 16 evaluation batches (qwen2, t5, gpt2),
# those that won by more (19-70%) won there too (the small llama, bert, vit). docs/methods.md.
CHOICE_MARGIN = 0.05


@dataclass(frozen=True)
class RuleChoice:
    """What scale rule or method ``auto`` chose: per candidate, the mean output cosine over the calibration rows.

    ``default``: the candidate an export without feeds uses; another replaces it only by cutting its
    damage by CHOICE_MARGIN or more.
    """

    cosine: dict[str, float]
    default: str | None = None

    @property
    def best(self) -> str:
        """The candidate with the best cosine; on a tie the first tried (AUTO_CHOICES order: balanced)."""
        return max(self.cosine, key=lambda rule: self.cosine[rule])

    @property
    def chosen(self) -> str:
        """``best``, unless it does not cut the default's damage by CHOICE_MARGIN: then the default."""
        best, default = self.best, self.default
        if default is None or default not in self.cosine or best == default:
            return best
        # Damages below 0 are float noise of a perfect cosine; a default with none cannot be beaten.
        damage, damage_default = (max(0.0, 1.0 - self.cosine[c]) for c in (best, default))
        return best if damage <= (1.0 - CHOICE_MARGIN) * damage_default and damage_default > 0 else default

    def describe(self, measured_with: str) -> str:
        """``chosen (mean cosine, <measured_with>: each candidate's; the default kept ...)`` for a summary."""
        tried = ", ".join(f"{rule} {cos:.6f}" for rule, cos in self.cosine.items())
        kept = ""
        if self.chosen != self.best:
            kept = f"; the default kept: {self.best} cut its damage by less than {CHOICE_MARGIN:.0%}"
        return f"{self.chosen} (mean cosine, {measured_with}: {tried}{kept})"


@dataclass
class MixedPrecision:
    """What the sensitivity analysis decided: layers by damage, target, cosine reached, runs used."""

    target_cosine: float
    layers: list[LayerSensitivity] = field(default_factory=list)
    cosine_all_int4: float | None = None
    cosine_probe: float | None = 1.0  # with the kept layers FP32, dequantized weights in ORT (None: not run)
    cosine_exported: float | None = None  # the exported model, CimInt4MatMul
    runs: int = 0
    rule_choice: RuleChoice | None = None  # scale rule or method "auto" only
    method: str = "rtn"
    calibration_runs: int = 0  # runs of the calibration pass (they also give the FP32 reference)
    calibration_bytes: int = 0  # statistics held by the calibration pass
    awq_inputs: int = 0  # layer inputs with an AWQ scale folded into their producer

    @property
    def int4_share(self) -> float:
        """Fraction of the candidate layers' FP32 weight bytes that are INT4 in the export."""
        total = sum(x.weight_bytes for x in self.layers)
        return sum(x.weight_bytes for x in self.layers if not x.kept) / total if total else 0.0

    def format(self) -> str:
        """Lines for the export summary."""
        kept = [x for x in self.layers if x.kept]
        if self.target_cosine == 0.0:
            head = "  calibration inputs: target cosine 0, so no layer kept in FP32"
        else:
            head = (
                f"  mixed precision: target output cosine {self.target_cosine} on the calibration inputs; "
                f"{len(kept)} of {len(self.layers)} layer(s) kept in FP32"
            )
        lines = [f"{head} ({self.runs} model runs)"]
        if self.calibration_runs:
            lines.append(
                f"    method {self.method}: calibration pass of {self.calibration_runs} run(s), "
                f"{self.calibration_bytes / 2**20:.1f} MiB of X^T X statistics"
                + (f"; AWQ scales folded at {self.awq_inputs} layer input(s)" if self.awq_inputs else "")
            )
        if self.rule_choice is not None:
            named = {"rtn": "scale rule auto", "auto": "method auto"}
            what = named.get(self.method, f"method {self.method}, rule auto")
            lines.append(f"    {what}: {self.rule_choice.describe('every layer INT4')}")
        if self.cosine_all_int4 is not None:
            lines.append(f"    every layer INT4: cosine {self.cosine_all_int4:.6f}")
        if self.target_cosine != 0.0 and self.cosine_probe is not None:
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


@dataclass(frozen=True)
class Rewritten:
    """One node that became CimInt4MatMul; ``path`` locates a node of a subgraph (``If 'c'/then_branch/``)."""

    name: str
    op_type: str
    k: int
    n: int
    bytes_before: int
    bytes_after: int
    path: str = ""
    notes: str = ""
    bits: int = DEFAULT_BITS
    tied: bool = False  # reads an embedding table's codes and scales: no weight bytes of its own


@dataclass(frozen=True)
class Skipped:
    """One MatMul/Gemm node left as it was, and why."""

    name: str
    op_type: str
    reason: str
    path: str = ""


@dataclass
class ExportSummary:
    """What the rewrite did: nodes rewritten and skipped, weight bytes before and after, warnings."""

    group_size: int
    scale_rule: str
    compute: str
    grid: str = "uniform"  # the export's grid option (contract.GRIDS): what 2- and 3-bit codes stand for
    rewritten: list[Rewritten] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # Set by a mixed-precision export: an object whose format() explains what stayed FP32.
    mixed_precision: MixedPrecision | None = None
    # Set by a ``bits="auto"`` export (exporter.allocate.WidthAllocation): widths chosen per layer.
    allocation: Any = None
    # Gated MLPs fused into one node each (exporter.gated): "gate label + up label (activation)".
    gated: list[str] = field(default_factory=list)
    # Set by ``rotate=True`` (exporter.rotate.RotationSummary): what the rotation changed.
    rotation: Any = None
    # Set by ``tune_epochs`` (exporter.tune.export.TuneSummary): the scales trained after the export.
    tuning: Any = None

    @property
    def bytes_before(self) -> int:
        return sum(r.bytes_before for r in self.rewritten)

    @property
    def bytes_after(self) -> int:
        return sum(r.bytes_after for r in self.rewritten)

    def format(self) -> str:
        """A human-readable report, one line per node."""
        lines = [
            f"cim-int4: {len(self.rewritten)} node(s) quantized to INT4 (group {self.group_size}, "
            f"scale rule {self.scale_rule}, compute {self.compute}), {len(self.skipped)} skipped"
        ]
        if self.grid != "uniform" and any(r.bits in GRID_BITS for r in self.rewritten):
            lines.append(f"  codes of the 2- and 3-bit layers stand for the {self.grid!r} grid's levels")
        for r in self.rewritten:
            notes = f" ({r.notes})" if r.notes else ""
            lines.append(f"  quantized {r.path}{r.op_type} {r.name!r}: K={r.k} N={r.n} {r.bits}-bit{notes}")
        for s in self.skipped:
            lines.append(f"  skipped   {s.path}{s.op_type} {s.name!r}: {s.reason}")
        if self.rewritten:
            ratio = self.bytes_before / max(self.bytes_after, 1)
            lines.append(f"  weight bytes: {self.bytes_before:,} -> {self.bytes_after:,} ({ratio:.2f}x smaller)")
            counted = [r for r in self.rewritten if not r.tied]  # a tied head's bytes are its table's
            weights = sum(r.k * r.n for r in counted)
            if weights:
                bpw = 8 * sum(r.bytes_after for r in counted) / weights
                widths = sorted({r.bits for r in self.rewritten})
                lines.append(
                    f"  bits per weight of the quantized layers: {bpw:.3f} (codes, scales and biases; widths "
                    f"{', '.join(map(str, widths))})"
                )
        if self.gated:
            lines.append(
                f"  gated MLPs: {len(self.gated)} fused, each gate and up projection with its activation and "
                "product in one node (fuse_gated=False keeps them apart)"
            )
        if self.rotation is not None:
            lines.append(f"  {self.rotation.format()}")
        if self.mixed_precision is not None:
            lines.append(self.mixed_precision.format())
        if self.allocation is not None:
            lines.append(self.allocation.format())
        if self.tuning is not None:
            lines.append(self.tuning.format())
        lines.extend(f"  warning: {w}" for w in self.warnings)
        return "\n".join(lines)
