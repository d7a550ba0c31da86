"""Pareto table and plot: bits per weight vs accuracy vs decode speed, mixed widths beside MatMulNBits.

    .venv/bin/python tools/pareto.py --out DIR [--cases llama hf-llama ...] [--batches 8]
        [--widths 2 3 4 5 6 8] [--budgets 3.0 3.5 4.0 4.5] [--llm PPL.json ...] [--speed]
        [--chain-layers 16 --chain-dim 4096 --threads 1 2]

Accuracy (the cases of tests/models/accuracy.py, embedding FP32 and the same layers as
MatMulNBits quantizes): mean and worst output cosine vs FP32 over ``--batches`` evaluation
batches, for every uniform width with float32, float16 and int8 scales (default scale rule), for
``bits="auto"`` at each budget (float16 scales; calibrated on batch 0, never an evaluation
batch), and for MatMulNBits 4-bit (and 8-bit where ORT's quantizer makes it), accuracy level 0.
Ours run with the op library when it runs the model, else as the dequantized-FP32 twin
(tools/dequantized_twin.py: what fp32 compute mode computes, up to summation order); the
``how`` column says which. The scales comparison per case (float16 and int8 against float32, int8
against float16): the difference of mean cosine beside the standard error of a batch's mean cosine
(the noise between draws).

``--llm``: scores.json files of ``tools/widths_real_llm.py score`` add the real-LLM points
(perplexity, and the gap to FP32 as a multiple of MatMulNBits int4 RTN's on the same windows).

``--speed``: M = 1 decode time of a ``--chain-layers`` x ``--chain-dim``^2 MatMul chain per
variant the op library runs (interleaved rounds, median), 1 and 2 threads; a variant it does
not run yet (its kernels are not in the library) is listed as not measured.

Writes DIR/pareto.md, DIR/pareto.json and DIR/pareto.png.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import onnx

HERE = Path(__file__).parent
# Stored scale dtypes compared, and their tag in variant names ("cim 4-bit 16").
SCALE_TAGS = {"float32": "32", "float16": "16", "int8": "i8"}
# (tag, against): the scale comparisons of the noise table.
SCALE_PAIRS = (("16", "32"), ("i8", "32"), ("i8", "16"))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "models"))


def _bits_per_weight_nbits(model: onnx.ModelProto) -> float:
    """Codes, scales and zero points of every MatMulNBits node per weight."""
    inits = {t.name: t for t in model.graph.initializer}
    nbytes = weights = 0
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        attrs = {a.name: a.i for a in node.attribute}
        weights += attrs["K"] * attrs["N"]
        for name in node.input[1:4]:
            if name in inits:
                nbytes += onnx.numpy_helper.to_array(inits[name]).nbytes
    return 8 * nbytes / max(weights, 1)


def _nbits(model: onnx.ModelProto, bits: int) -> onnx.ModelProto | None:
    from cim_int4.bench.variants import nbits_quantizer

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    try:
        q = nbits_quantizer()(copy, bits=bits, block_size=32, is_symmetric=True, accuracy_level=0)
        q.process()
    except Exception as e:  # noqa: BLE001 - ORT's quantizer refuses widths it does not make
        print(f"MatMulNBits {bits}-bit: not made ({str(e)[:120]})", file=sys.stderr)
        return None
    return q.model.model


def _outputs(model: onnx.ModelProto, batches: list[dict]) -> tuple[list[list[np.ndarray]], str]:
    """Outputs on every batch with the op library, else with the dequantized twin; and which it was."""
    import onnxruntime as ort
    from cim_int4.exporter.tune.twin import twin
    from cim_int4.ops.ort_model import proto_session
    from cim_int4.ops.session import session_options

    how = "op"
    try:
        session = proto_session(model, session_options(pin=False))
    except Exception:  # noqa: BLE001 - the library refuses widths/scales it has no kernels for yet
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        session = ort.InferenceSession(twin(copy).SerializeToString(), providers=["CPUExecutionProvider"])
        how = "twin"
    names = {i.name for i in session.get_inputs()}
    return [session.run(None, {k: v for k, v in b.items() if k in names}) for b in batches], how


def accuracy(case_names: list[str], batches: int, widths: list[int], budgets: list[float]) -> list[dict]:
    """One row per case and variant: bits per weight, mean/worst cosine, per-batch mean cosines, how it ran."""
    return [row for name in case_names for row in _case(name, batches, widths, budgets)]


def _case(name: str, batches: int, widths: list[int], budgets: list[float]) -> list[dict]:
    import onnxruntime as ort
    from accuracy import CASES, matmul_nbits
    from cim_int4.exporter import export_with_summary

    from cim_int4.metrics import row_cosines

    rows: list[dict] = []
    case = CASES[name]
    model = case.model()
    calibration = case.feeds(model, 0)
    evaluation = [case.feeds(model, b) for b in range(1, batches + 1)]

    def run_ort(m: onnx.ModelProto) -> list[list[np.ndarray]]:
        session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        names = {i.name for i in session.get_inputs()}
        return [session.run(None, {k: v for k, v in b.items() if k in names}) for b in evaluation]

    reference = run_ort(model)

    def add(variant: str, quantized: onnx.ModelProto, bpw: float, ort_only: bool = False) -> None:
        got, how = (run_ort(quantized), "ort") if ort_only else _outputs(quantized, evaluation)
        per = [row_cosines(r, o) for r, o in zip(reference, got, strict=True)]
        cos = np.concatenate(per)
        rows.append({"case": case.name, "variant": variant, "bits_per_weight": bpw, "how": how,
                     "mean_cosine": float(cos.mean()), "worst_cosine": float(cos.min()),
                     "batch_means": [float(p.mean()) for p in per]})  # fmt: skip
        print(f"{case.name}: {variant} {bpw:.3f} bpw, mean cosine {cos.mean():.6f} ({how})", flush=True)

    nbits4 = matmul_nbits(model)
    left = [n.name for n in nbits4.graph.node if n.op_type in ("MatMul", "Gemm") and n.name]
    common = {"exclude": left, "keep_embedding": True}
    for bits in widths:
        for dtype, tag in SCALE_TAGS.items():
            quantized, summary = export_with_summary(model, bits=bits, scale_dtype=dtype, **common)
            bpw = 8 * summary.bytes_after / sum(r.k * r.n for r in summary.rewritten)
            add(f"cim {bits}-bit {tag}", quantized, bpw)
    for budget in budgets:
        quantized, summary = export_with_summary(
            model, bits="auto", bits_budget=budget, scale_dtype="float16", feeds=calibration, **common
        )
        add(f"cim auto {budget}", quantized, summary.allocation.bits_per_weight)
    add("MatMulNBits 4-bit", nbits4, _bits_per_weight_nbits(nbits4), ort_only=True)
    nbits8 = _nbits(model, 8)
    if nbits8 is not None:
        try:
            add("MatMulNBits 8-bit", nbits8, _bits_per_weight_nbits(nbits8), ort_only=True)
        except Exception as e:  # noqa: BLE001 - ORT has no CPU kernel for every width
            print(f"MatMulNBits 8-bit: not run ({str(e)[:120]})", file=sys.stderr)
    return rows


def scale_dtype_noise(rows: list[dict]) -> list[dict]:
    """Per case, width and SCALE_PAIRS pair: the difference of mean cosine, and the standard error of a batch's mean."""
    out = []
    by = {(r["case"], r["variant"]): r for r in rows}
    for (case, variant), r in by.items():
        width, _, tag = variant.rpartition(" ")
        for this, against in SCALE_PAIRS:
            base = by.get((case, f"{width} {against}"))
            if tag != this or not width.endswith("-bit") or base is None:
                continue
            means = np.array(base["batch_means"])
            paired = np.array(r["batch_means"]) - means
            n = len(means)
            out.append({"case": case, "variant": width, "scales": f"{this} - {against}",
                        "delta": r["mean_cosine"] - base["mean_cosine"],
                        "batch_std_err": float(means.std(ddof=1) / np.sqrt(n)) if n > 1 else None,
                        "paired_std_err": float(paired.std(ddof=1) / np.sqrt(n)) if n > 1 else None})  # fmt: skip
    return out


def llm_points(files: list[str]) -> list[dict]:
    """Real-LLM points: the scores.json files of ``tools/widths_real_llm.py score`` (one row per variant)."""
    return [row for path in files for row in json.loads(Path(path).read_text())]


def speed(layers: int, dim: int, widths: list[int], threads: list[int]) -> list[dict]:
    """Median M = 1 time of the chain per variant and thread count (interleaved rounds); unmeasured ones noted."""
    from cim_int4.exporter import export_with_summary
    from cim_int4.graphs import matmul_chain, random_input

    from cim_int4.bench.runner import bench_session
    from cim_int4.bench.timing import interleaved

    model = matmul_chain(layers, dim)
    feeds = random_input(model, {"M": 1}, seed=0)
    variants: dict[str, tuple[onnx.ModelProto, float]] = {}
    for bits in widths:
        for dtype, tag in SCALE_TAGS.items():
            q, s = export_with_summary(model, bits=bits, scale_dtype=dtype, scale_rule="signed", compute="int8")
            variants[f"cim {bits}-bit {tag} int8"] = (q, 8 * s.bytes_after / (layers * dim * dim))
    from cim_int4.bench.variants import quantize_nbits

    nb = quantize_nbits(model, accuracy_level=4)
    variants["MatMulNBits 4-bit acc4"] = (nb, _bits_per_weight_nbits(nb))
    rows = []
    for t in threads:
        sessions, skipped = {}, []
        for name, (m, _) in variants.items():
            try:
                sessions[name] = bench_session(m, t)
            except Exception:  # noqa: BLE001 - not in the op library yet
                skipped.append(name)
        calls = {n: (lambda s=s: s.run(None, feeds)) for n, s in sessions.items()}
        for call in calls.values():
            call()
        samples = interleaved(calls, min_rounds=10, max_rounds=200, max_time=20.0)
        for name in variants:
            ms = float(np.median(samples[name]) * 1e3) if name in samples else None
            rows.append({"variant": name, "threads": t, "bits_per_weight": variants[name][1], "ms": ms})
    return rows


def _ms(ms: float | None) -> str:
    return "not run here (no kernel yet)" if ms is None else f"{ms:.3f}"


def markdown(rows: list[dict], noise: list[dict], llm: list[dict], speeds: list[dict]) -> str:
    """The tables of DIR/pareto.md."""
    lines = ["| model | variant | bits per weight | mean cosine | worst cosine | run as |", "|---|---|---|---|---|---|"]
    lines = lines if rows else []
    lines += [f"| {r['case']} | {r['variant']} | {r['bits_per_weight']:.3f} | {r['mean_cosine']:.6f} | "
              f"{r['worst_cosine']:.6f} | {r['how']} |" for r in rows]  # fmt: skip
    if noise:
        lines += ["", "| model | width | scales | mean cosine difference | std. error of a batch mean | "
                  "paired std. error |", "|---|---|---|---|---|---|"]  # fmt: skip
        lines += [f"| {n['case']} | {n['variant']} | {n['scales']} | {n['delta']:+.2e} | "
                  f"{n['batch_std_err'] or 0:.2e} | {n['paired_std_err'] or 0:.2e} |" for n in noise]  # fmt: skip
    if llm:
        lines += ["", "| LLM | variant | bits per weight | perplexity | gap / MatMulNBits RTN gap |"]
        lines += ["|---|---|---|---|---|"]
        for p in llm:
            ratio = "-" if p["gap_over_rtn"] is None else f"{p['gap_over_rtn']:.3f}"
            bpw, ppl = f"{p['bits_per_weight']:.3f}", f"{p['perplexity']:.4f}"
            lines.append(f"| {p['model']} | {p['variant']} | {bpw} | {ppl} | {ratio} |")
    if speeds:
        lines += ["", "| chain variant | threads | bits per weight | M=1 ms (median) |", "|---|---|---|---|"]
        lines += [f"| {s['variant']} | {s['threads']} | {s['bits_per_weight']:.3f} | {_ms(s['ms'])} |" for s in speeds]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], llm: list[dict], speeds: list[dict], path: Path) -> None:
    """Bits per weight vs 1 - mean cosine (per case), vs perplexity gap (LLMs), vs decode ms (chain)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 1 + bool(llm) + bool(speeds)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5), squeeze=False)
    ax = axes[0][0]
    for case in dict.fromkeys(r["case"] for r in rows):
        mine = [r for r in rows if r["case"] == case]
        color = None
        for kind, marker, label in (("-bit 16", "o-", "uniform, fp16 scales"), ("auto", "s--", "auto"),
                                    ("MatMulNBits", "x", "MatMulNBits")):  # fmt: skip
            pts = sorted((r["bits_per_weight"], 1 - r["mean_cosine"]) for r in mine if kind in r["variant"])
            if pts:
                (line,) = ax.plot(*zip(*pts, strict=True), marker, color=color, label=f"{case}: {label}")
                color = line.get_color()  # one color per model
    ax.set(xlabel="bits per weight (codes + scales)", ylabel="1 - mean output cosine", yscale="log")
    if rows:
        ax.legend(fontsize=6)
    i = 1
    if llm:
        ax = axes[0][i]
        for model in dict.fromkeys(p["model"] for p in llm):
            pts = sorted((p["bits_per_weight"], p["perplexity"]) for p in llm if p["model"] == model)
            ax.plot(*zip(*pts, strict=True), "o", label=model)
        ax.set(xlabel="bits per weight", ylabel="perplexity")
        ax.legend(fontsize=7)
        i += 1
    if speeds:
        ax = axes[0][i]
        for t in sorted({s["threads"] for s in speeds}):
            pts = [(s["bits_per_weight"], s["ms"]) for s in speeds if s["threads"] == t and s["ms"] is not None]
            if pts:
                ax.plot(*zip(*sorted(pts), strict=True), "o", label=f"{t} thread(s)")
        ax.set(xlabel="bits per weight", ylabel="chain M=1 decode ms")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", nargs="*", default=["llama", "hf-llama", "hf-qwen2", "hf-gpt2"])
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--widths", nargs="*", type=int, default=[2, 3, 4, 5, 6, 8])
    parser.add_argument("--budgets", nargs="*", type=float, default=[3.0, 3.5, 4.0, 4.5])
    parser.add_argument("--llm", nargs="*", default=[])
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--chain-layers", type=int, default=16)
    parser.add_argument("--chain-dim", type=int, default=4096)
    parser.add_argument("--threads", nargs="*", type=int, default=[1, 2])
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = accuracy(args.cases, args.batches, args.widths, args.budgets) if args.cases else []
    noise = scale_dtype_noise(rows)
    llm = llm_points(args.llm)
    speeds = speed(args.chain_layers, args.chain_dim, args.widths, args.threads) if args.speed else []
    (out / "pareto.json").write_text(json.dumps({"accuracy": rows, "scale_dtype": noise, "llm": llm,
                                                 "speed": speeds}, indent=1))  # fmt: skip
    (out / "pareto.md").write_text(markdown(rows, noise, llm, speeds))
    plot(rows, llm, speeds, out / "pareto.png")
    print((out / "pareto.md").read_text())


if __name__ == "__main__":
    main()
