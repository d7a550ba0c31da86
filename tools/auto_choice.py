"""What ``method="auto"`` sees and what it would win: every (method, rule) pair on the small accuracy cases.

    .venv/bin/python tools/auto_choice.py [CASE ...] [--json OUT]

Per case of tests/models/accuracy.py SMALL_CASES: the mean cosine of each pair on the held-out rows
of the calibration batch (what the choice compares), its damage (1 - cosine) relative to the default
pair's (round-to-nearest under the rule an export without feeds uses), and the mean cosine of each
pair's export on 16 evaluation batches. The evidence for ``summary.CHOICE_MARGIN`` (docs/methods.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from cim_int4.exporter import export_with_summary  # noqa: E402
from cim_int4.exporter import probe as probe_module  # noqa: E402
from models.accuracy import SMALL_CASES, _run, _session, matmul_nbits  # noqa: E402

from cim_int4.metrics import row_cosines  # noqa: E402

BATCHES = 16


def held_out_rows(model, feeds, exclude) -> tuple[dict[str, np.ndarray], str, str]:
    """Each pair's row cosines on the held-out calibration rows, the default pair, the pair chosen."""
    found: list[np.ndarray] = []
    original = probe_module.Probe.cosines

    def recording(self, layers, weights, parts=None, scored=None):
        rows = original(self, layers, weights, parts, scored)
        if parts is not None:  # the choice's runs (the calibration pass and the check pass no parts)
            found.append(rows)
        return rows

    probe_module.Probe.cosines = recording
    try:
        _, summary = export_with_summary(
            model, method="auto", scale_rule="auto", feeds=feeds, target_cosine=0.0, exclude=exclude,
            keep_embedding=True,
        )
    finally:
        probe_module.Probe.cosines = original
    choice = summary.mixed_precision.rule_choice
    if len(found) != len(choice.cosine):
        raise SystemExit("the choice compared no held-out rows: a calibration batch of 2 rows or more is needed")
    return dict(zip(choice.cosine, found, strict=True)), choice.default, choice.chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", default=list(SMALL_CASES), choices=list(SMALL_CASES))
    parser.add_argument("--json", default=None, help="also write every row cosine here")
    args = parser.parse_args()
    results = {}
    for name in args.cases:
        case = SMALL_CASES[name]
        model = case.model()
        calibration = case.feeds(model, 0)
        evaluation = [case.feeds(model, b) for b in range(1, BATCHES + 1)]
        fp32 = _session(model)
        reference = [_run(fp32, f) for f in evaluation]
        exclude = [n.name for n in matmul_nbits(model).graph.node if n.op_type in ("MatMul", "Gemm") and n.name]
        held, default, chosen = held_out_rows(model, calibration, exclude)
        print(f"== {case.name}: {len(held[default])} held-out row(s), default {default}, chosen {chosen}")
        results[name] = {"default": default, "chosen": chosen, "pairs": {}}
        for label, rows in held.items():
            method, rule = label.split("/")
            exported, _ = export_with_summary(
                model, method=method, scale_rule=rule, feeds=calibration, target_cosine=0.0, exclude=exclude,
                keep_embedding=True,
            )
            session = _session(exported)
            cos = np.concatenate([row_cosines(r, _run(session, f)) for r, f in zip(reference, evaluation, strict=True)])
            damage = (1 - rows.mean()) / max(1 - held[default].mean(), 1e-12)
            results[name]["pairs"][label] = {"held": rows.tolist(), "evaluation": float(cos.mean())}
            print(f"  {label:18s} held-out {rows.mean():.5f} (damage x{damage:.3f})  evaluation {cos.mean():.5f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
