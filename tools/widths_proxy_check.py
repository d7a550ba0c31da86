"""Is bits="auto"'s model of the damage what misses 3.0 bits per weight? (docs/widths.md, "The allocation's model")

On SmolLM2 FP32 (unrotated), RTN ``mse``, group 64, int8 scales, normal grid at 2/3 bits, 2 calibration
windows: per layer and width 2/3/4, the exact KL of the logits with that layer alone quantized and the
proxy's relative error under E[x^2]. Then (1) how well the proxy anchored at 3 bits predicts the exact
2- and 4-bit damages, (2) the allocations at a budget of 3.0 from the proxy and from the exact damages,
each measured jointly (every chosen layer at once) beside the sum of its layers' damages.

    python tools/widths_proxy_check.py [ROOT] [OUT_JSON]    # defaults /work/real, ROOT/widths-proxy-check.json

~25 min alone on a 2-vCPU Zen 4 (151 layers, 3 quantizations and runs of 2 windows each).
"""

import json
import sys
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).parent))
from cim_int4.exporter import ExportOptions  # noqa: E402
from cim_int4.exporter.allocate import (  # noqa: E402
    carried,
    layer_costs,
    relative_error,
    spearman,
    steps_in_order,
    total_weights,
    within_budget,
)
from cim_int4.exporter.methods import quantize_layer  # noqa: E402
from cim_int4.exporter.probe import Probe  # noqa: E402
from measure_methods import calibration_windows  # noqa: E402

from cim_int4.metrics import row_kl  # noqa: E402

WIDTHS = (2, 3, 4)  # of allocate.WIDTHS, the ones a budget of 3.0 chooses between
ANCHOR = 3
BUDGET = 3.0


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "/work/real")
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else root / "widths-proxy-check.json"
    folder = root / "smollm2" / "fp32"
    feeds = calibration_windows(folder, root / "text" / "calib.txt", 2)
    options = ExportOptions(group_size=64, scale_rule="mse", scale_dtype="int8", grid="normal")
    probe = Probe(onnx.load(folder / "model.onnx"), options, feeds, calibrate=True)
    power = probe.input_power()
    scored = [probe.outputs.index("logits")]

    def quantized(i: int, b: int):
        return quantize_layer(probe, i, "rtn", "mse", b, options, None, {})

    def kl(layers: list[int], weights: dict) -> float:
        return float(np.mean(probe.compared(layers, weights, row_kl, scored=scored)))

    rows = []
    for i, c in enumerate(probe.candidates):
        p = power.get(c.key)
        row = {"key": c.key, "k": int(c.w.shape[0]), "n": int(c.w.shape[1]), "exact": {}, "rel": {}}
        for b in WIDTHS:
            qw = quantized(i, b)
            row["rel"][b] = relative_error(c.w, qw, None if p is None else p.astype(np.float64))
            row["exact"][b] = kl([i], {c.key: qw})
        rows.append(row)
        print(i, c.key, {b: round(row["exact"][b], 4) for b in WIDTHS}, flush=True)

    predicted = [carried(r["rel"], r["exact"][ANCHOR], ANCHOR) for r in rows]  # per row, per width

    report: dict = {"rows": rows}
    for b in (2, 4):
        exact, proxy = [r["exact"][b] for r in rows], [p[b] for p in predicted]
        ratio = np.array(exact) / np.maximum(np.array(proxy), 1e-30)
        found = {"spearman": spearman(exact, proxy), **{f"p{q}": float(np.percentile(ratio, q)) for q in (10, 50, 90)}}
        report[f"proxy_at_{b}"] = found
        print(f"{b} bits, exact / proxy from {ANCHOR}: " + ", ".join(f"{k} {v:.3f}" for k, v in found.items()))

    costs = [
        {b: cost for b, cost in layer_costs(r["k"], r["n"], options.group_size, options.scale_dtype).items()
         if b is None or b in WIDTHS}
        for r in rows
    ]  # fmt: skip
    total = total_weights(costs)
    damages = {
        "proxy": [{**p, None: 0.0} for p in predicted],
        "exact": [{**r["exact"], None: 0.0} for r in rows],
    }
    for name, damage in damages.items():
        start, steps = steps_in_order(costs, damage)
        widths = within_budget(start, steps, costs, damage, BUDGET * total / 8)
        chosen = [i for i, b in enumerate(widths) if b is not None]
        joint = kl(chosen, {probe.candidates[i].key: quantized(i, widths[i]) for i in chosen})
        found = {
            "widths": widths,
            "counts": {str(b): widths.count(b) for b in sorted(set(widths), key=str)},
            "bits_per_weight": 8 * sum(c[b] for c, b in zip(costs, widths, strict=True)) / total,
            "joint_kl": joint,
            "sum_of_exact_kl": sum(rows[i]["exact"][widths[i]] for i in chosen),
            "head": widths[-1] if "lm_head" in rows[-1]["key"] else None,
        }
        report[f"allocation_{name}"] = found
        print(name, {k: v for k, v in found.items() if k != "widths"}, flush=True)
    out.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
