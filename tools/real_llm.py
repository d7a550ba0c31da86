"""Rebuild every real-LLM figure of docs/real-llm.md: perplexity of each scale rule vs MatMulNBits RTN.

Three steps, each reusing what exists under ROOT (default /work/real):

1. Models and text (a heavy virtualenv with torch; never the project's, never CI):

       python3 -m venv VENV && VENV/bin/pip install torch (the CPU wheel) transformers accelerate gguf \\
           onnx onnx-ir "onnxruntime==1.32.*" onnxruntime-genai sentencepiece tokenizers
       VENV/bin/python tools/real_llm_models.py gemma3 --root ROOT     # and smollm2
       python3 tools/real_llm_text.py ROOT/text

2. Exports and perplexity (the project's .venv: cim-int4, onnxruntime):

       .venv/bin/python tools/real_llm.py exports gemma3 --root ROOT
       .venv/bin/python tools/real_llm.py measure gemma3 --root ROOT --max-tokens 4096 --threads 2

   ``exports`` writes ROOT/NAME/exports/RULE-gG (a genai folder: the builder's FP32 folder with
   its decoder replaced by ``export_int4(..., scale_rule=RULE, group_size=G)``, default options
   otherwise). ``measure`` runs ``cim-int4 perplexity``'s function with the FP32 folder as the
   reference on groups of at most GROUP models (sessions of one group are loaded at once), and
   writes one JSON per group under ROOT/NAME/ppl/.

3. ``.venv/bin/python tools/real_llm.py table --root ROOT`` prints the markdown tables: perplexity,
   gap to FP32 as a multiple of MatMulNBits RTN's gap (accuracy_level 4, the builder's default,
   at the same group size; and of level 0; the builder's int4 also quantizes the tied
   embedding) and of export_int4 ``signed``'s (round-to-nearest through the same export,
   embedding FP32), KL per token and top-1 agreement.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

# "auto" without feeds is "balanced" at group 32; balanced@W: the balanced rule with weight W on the running sum.
RULES = ("signed", "mse", "balanced", "balanced@0.03", "balanced@0.003", "amax8", "autofeeds", "methodauto")
GROUPS = (32, 128)
COMPUTES = ("fp32", "int8")
GROUP = 3  # models per perplexity call besides the reference
# Gemma is trained with <bos> first, but the tokenizer transformers saves from its GGUF does not
# add it (llama.cpp does, from the GGUF's add_bos_token): start every window with it.
BOS = {"gemma3": 2}
# "auto" with feeds: windows of the calibration text. The probe keeps the FP32 logits of every
# window (tokens x vocabulary floats): Gemma's 262k vocabulary gets shorter windows.
AUTO_FEEDS = "autofeeds"
METHOD_AUTO = "methodauto"  # method="auto" (rtn, gptq, awq, awq+gptq under every rule) on the same feeds
FEED_WINDOWS = 4
FEED_WINDOW = {"smollm2": 512, "gemma3": 256}
BOOTSTRAP_DRAWS = 4000


def builder_folders(root: Path, name: str) -> dict[str, Path]:
    """The genai builder's folders: label -> folder (absent ones are left out)."""
    base = root / name
    folders = {
        "nbits-acc4-g32": base / "int4",
        "nbits-acc0-g32": base / "int4-acc0",
        "nbits-acc4-g128": base / "int4-g128",
        "nbits-acc0-g128": base / "int4-g128-acc0",
    }
    return {k: v for k, v in folders.items() if (v / "genai_config.json").is_file()}


def export_folder(out: Path, name: str, rule: str, group: int) -> Path:
    return out / name / "exports" / f"{rule}-g{group}"


def make_exports(
    root: Path, name: str, rules: list[str], groups: list[int], out_root: Path, feed_windows: int = FEED_WINDOWS
) -> None:
    """export_int4 of the builder's FP32 decoder with each rule and group size, as genai folders under OUT.

    The rule AUTO_FEEDS is ``scale_rule="auto"`` with feeds: the first ``feed_windows`` windows of
    ROOT/text/calib.txt (never the evaluation text), every layer INT4 (``target_cosine=0``);
    METHOD_AUTO is ``method="auto"`` and ``scale_rule="auto"`` on the same feeds.
    ``balanced@W`` is ``balanced`` with ``scale_rules.BALANCE`` set to W for that export (how the
    weight was chosen; not an export option).
    """
    from cim_int4.exporter import export_int4, export_with_summary, load_model, save_model, scale_rules

    from cim_int4.genai import copy_folder, model_files
    from cim_int4.genai_bench import decoder_file

    src = root / name / "fp32"
    decoder = decoder_file(src)
    for group in groups:
        for rule in rules:
            out = export_folder(out_root, name, rule, group)
            if (out / "genai_config.json").is_file():
                continue
            tmp = out.with_name(out.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            copy_folder(src, tmp, model_files(decoder) | {src / "genai_config.json"})
            t0 = time.perf_counter()
            info: dict = {"rule": rule, "group": group}
            if rule in (AUTO_FEEDS, METHOD_AUTO):
                sys.path.insert(0, str(Path(__file__).parent))
                from measure_methods import calibration_windows

                calib = root / "text" / "calib.txt"
                feeds = calibration_windows(src, calib, feed_windows, FEED_WINDOW[name], BOS.get(name))
                method = "auto" if rule == METHOD_AUTO else "rtn"
                quantized, summary = export_with_summary(
                    load_model(decoder), group_size=group, scale_rule="auto", method=method, feeds=feeds,
                    target_cosine=0.0,
                )  # fmt: skip
                save_model(quantized, tmp / decoder.name, external_data=True, consume=True)
                choice = summary.mixed_precision.rule_choice
                info |= {"windows": len(feeds), "window": FEED_WINDOW[name], "chosen": choice.chosen,
                         "cosine": choice.cosine, "summary": summary.format()}  # fmt: skip
                del quantized, feeds
            else:
                base, _, weight = rule.partition("@")
                default_weight = scale_rules.BALANCE
                if weight:
                    if base != "balanced":
                        raise SystemExit(f"{rule}: only balanced takes @WEIGHT")
                    scale_rules.BALANCE = float(weight)
                    info["balance"] = float(weight)
                try:
                    export_int4(
                        decoder, tmp / decoder.name, group_size=group, scale_rule=base, external_data=True, quiet=True
                    )
                finally:
                    scale_rules.BALANCE = default_weight
            info["seconds"] = time.perf_counter() - t0
            shutil.copyfile(src / "genai_config.json", tmp / "genai_config.json")
            (tmp / "export.json").write_text(json.dumps(info) + "\n")
            seconds = info["seconds"]
            tmp.rename(out)
            print(f"{name}: exported {rule} g{group} in {seconds:.0f} s")


def variants(root: Path, name: str, out_root: Path) -> list[tuple[str, Path, str | None]]:
    """(label, folder, compute) of every model to measure; compute None = the model's own."""
    out = [(label, folder, None) for label, folder in builder_folders(root, name).items()]
    exports = out_root / name / "exports"
    for folder in sorted(exports.iterdir()) if exports.is_dir() else []:
        if (folder / "genai_config.json").is_file():
            out += [(f"{folder.name}-{compute}", folder, compute) for compute in COMPUTES]
    return out


def measure(
    root: Path,
    name: str,
    max_tokens: int | None,
    threads: int | None,
    window: int,
    only: str | None,
    group: int,
    out_root: Path,
) -> None:
    """Perplexity of every variant vs the FP32 folder, ``group`` models per call; one JSON per model under OUT."""
    from cim_int4.contract import DEFAULT_COMPUTE
    from cim_int4.perplexity import perplexity
    from cim_int4.report import write_json

    out_dir = out_root / name / "ppl"
    out_dir.mkdir(parents=True, exist_ok=True)
    todo = [v for v in variants(root, name, out_root) if not (out_dir / f"{v[0]}.json").is_file()]
    if only:
        wanted = only.split(",")
        todo = sorted((v for v in todo if v[0] in wanted), key=lambda v: wanted.index(v[0]))
    by_compute: dict[str | None, list] = {}
    for v in todo:
        # The exports' nodes carry the default compute (fp32): no override needed, so they
        # share a call (and its reference run) with the builder's folders.
        by_compute.setdefault(None if v[2] == DEFAULT_COMPUTE else v[2], []).append(v)
    text = root / "text" / "eval.txt"
    for compute, items in by_compute.items():
        for i in range(0, len(items), group):
            batch = items[i : i + group]
            t0 = time.perf_counter()
            report = perplexity(
                root / name / "fp32",
                [folder for _, folder, _ in batch],
                text=text,
                window=window,
                threads=threads,
                compute=compute,
                max_tokens=max_tokens,
                bos=BOS.get(name, "auto"),
            )
            print(report.format_table(), f"({time.perf_counter() - t0:.0f} s)", flush=True)
            for (label, _, _), row in zip(batch, report.rows[1:], strict=True):
                single = type(report)([report.rows[0], {**row, "label": label}], report.settings)
                write_json(single.to_json(), out_dir / f"{label}.json")


def load_results(root: Path, name: str) -> tuple[dict[str, dict], dict, dict]:
    """label -> row, the FP32 row and the settings, from ROOT/NAME/ppl/*.json."""
    rows, ref, settings = {}, None, None
    for path in sorted((root / name / "ppl").glob("*.json")):
        data = json.loads(path.read_text())
        fp32, row = data["models"]
        if ref is not None and abs(fp32["perplexity"] - ref["perplexity"]) > 1e-9 * ref["perplexity"]:
            raise SystemExit(f"{path}: FP32 perplexity {fp32['perplexity']} differs from {ref['perplexity']}")
        ref, settings = fp32, data["settings"]
        rows[row["label"]] = row
    if ref is None:
        raise SystemExit(f"{root / name / 'ppl'}: no results")
    return rows, ref, settings


def gap_ratio_interval(
    nll: list[float], ref: list[float], base: list[float], draws: int = BOOTSTRAP_DRAWS
) -> tuple[float, float]:
    """5th and 95th percentile of the gap ratio (model - FP32) / (base - FP32) over windows drawn with replacement.

    The three lists are per-window mean NLLs on the same windows (equal scored tokens), so a
    draw keeps the pairing: what it measures is which windows the text happens to hold.
    """
    import numpy as np

    m, r, b = (np.asarray(v, dtype=np.float64) for v in (nll, ref, base))
    idx = np.random.default_rng(0).integers(0, len(r), size=(draws, len(r)))
    pr = np.exp(r[idx].mean(axis=1))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = (np.exp(m[idx].mean(axis=1)) - pr) / (np.exp(b[idx].mean(axis=1)) - pr)
    lo, hi = np.percentile(ratios, [5, 95])
    return float(lo), float(hi)


def table(root: Path, name: str) -> str:
    """The markdown table of one model's results."""
    rows, ref, s = load_results(root, name)
    lines = [
        f"{name}: FP32 perplexity {ref['perplexity']:.4f} on {s['scored_tokens']} scored tokens "
        f"({s['windows']} windows of {s['window']}, BOS {s['bos']}, {s['text']}).",
        "",
        "| model | group | compute | perplexity | gap / RTN acc4 gap (90% bootstrap) | gap / RTN acc0 gap "
        "| gap / `signed` gap | KL per token | top-1 agreement |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def ratio(row: dict, base: str, spread: bool = False) -> str:
        b = rows.get(base)
        if b is None or b["perplexity"] == ref["perplexity"]:
            return "-"
        text = f"{(row['perplexity'] - ref['perplexity']) / (b['perplexity'] - ref['perplexity']):.3f}"
        if spread and row is not b and "window_nll" in row and "window_nll" in b:
            lo, hi = gap_ratio_interval(row["window_nll"], ref["window_nll"], b["window_nll"])
            text += f" ({lo:.3f}-{hi:.3f})"
        return text

    order = sorted(rows, key=lambda k: (int(k.split("-g")[1].split("-")[0]), k))
    for label in order:
        row = rows[label]
        group = int(label.split("-g")[1].split("-")[0])
        if label.startswith("nbits"):
            what, compute = f"MatMulNBits RTN ({label.split('-')[1]})", "acc" + label.split("-")[1][3:]
        else:
            what, compute = f"export_int4 `{label.split('-g')[0]}`", label.rsplit("-", 1)[1]
        lines.append(
            f"| {what} | {group} | {compute} | {row['perplexity']:.4f} | "
            f"{ratio(row, f'nbits-acc4-g{group}', spread=True)} | "
            f"{ratio(row, f'nbits-acc0-g{group}')} | {ratio(row, f'signed-g{group}-fp32')} | {row['kl']:.5f} | "
            f"{row['top1_agreement']:.4f} |"
        )
    return "\n".join(lines)


def llama_bench_tg(llama_bin: Path, gguf: Path, threads: int, tokens: int) -> float:
    """llama.cpp's ``llama-bench`` generation tokens/s (tg ``tokens``) of ``gguf`` at ``threads``."""
    cmd = [str(llama_bin / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", str(tokens), "-t", str(threads),
           "-r", "3", "-o", "json"]  # fmt: skip
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return float(json.loads(text[text.find("[") : text.rfind("]") + 1])[0]["avg_ts"])


def decode(root: Path, name: str, out_root: Path, threads: list[int], rounds: int, steps: int, llama: Path) -> None:
    """Genai greedy decode tokens/s: FP32, MatMulNBits acc4, ``cim-int4 genai`` of the FP32 folder (the default:
    compute int8, float16 scales; float32 scales; compute fp32), interleaved per round; llama.cpp Q4_0
    ``llama-bench`` tg in the same rounds. One JSON per round."""
    sys.path.insert(0, str(Path(__file__).parent))
    from embed_real import decode as genai_decode

    from cim_int4.genai import prepare

    base = out_root / name / "genai"
    base.mkdir(parents=True, exist_ok=True)
    made = {"int8": {"compute": "auto"}, "fp32": {"compute": "fp32"}, "int8-f32": {"scale_dtype": "float32"}}
    for folder, kwargs in made.items():
        if not (base / folder / "genai_config.json").is_file():
            prepare(root / name / "fp32", base / folder, quiet=True, **kwargs)
    folders = {
        "FP32": root / name / "fp32",
        "MatMulNBits acc4": root / name / "int4",
        "cim-int4 genai (default: int8 compute, int8 scales)": base / "int8",
        "cim-int4 genai --scale-dtype float32": base / "int8-f32",
        "cim-int4 genai --compute fp32": base / "fp32",
    }
    gguf = root / "llama.cpp" / name / "Q4_0.gguf"
    for r in range(rounds):
        result = {"name": name, "round": r, "steps": steps, "load": os.getloadavg(), "tokens_per_s": {}}
        for t in threads:
            row = genai_decode(folders, [t], steps, repeats=3, rounds=1)[str(t)]
            if gguf.is_file() and (llama / "llama-bench").is_file():
                row["llama.cpp Q4_0 (llama-bench tg)"] = llama_bench_tg(llama, gguf, t, steps)
            result["tokens_per_s"][str(t)] = row
            print(name, "round", r, "threads", t, json.dumps(row), flush=True)
        write = out_root / name / "decode" / f"round{r}-{time.strftime('%H%M%S')}.json"
        write.parent.mkdir(parents=True, exist_ok=True)
        write.write_text(json.dumps(result, indent=1) + "\n")


def decode_table(out_root: Path, name: str) -> str:
    """Markdown: genai decode tokens/s per variant and thread count, median over rounds, and the median of the
    per-round ratios to MatMulNBits acc4 (each round runs every variant interleaved)."""
    import statistics

    runs = [json.loads(p.read_text()) for p in sorted((out_root / name / "decode").glob("round*.json"))]
    if not runs:
        return ""
    base = "MatMulNBits acc4"
    lines = [
        f"{name}: decode tokens/s, {len(runs)} rounds (load averages {[round(r['load'][0], 1) for r in runs]})",
        "",
    ]
    lines += ["| variant | threads | tokens/s (median) | x MatMulNBits acc4 (median of rounds) |", "|---|---|---|---|"]
    for t in runs[0]["tokens_per_s"]:
        for label in runs[0]["tokens_per_s"][t]:
            values = [r["tokens_per_s"][t][label] for r in runs if label in r["tokens_per_s"].get(t, {})]
            ratios = [r["tokens_per_s"][t][label] / r["tokens_per_s"][t][base] for r in runs]
            lines.append(f"| {label} | {t} | {statistics.median(values):.1f} | {statistics.median(ratios):.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="step", required=True)
    for step in ("exports", "measure", "table", "decode"):
        p = sub.add_parser(step)
        p.add_argument("name", nargs="*" if step == "table" else None, default=["gemma3", "smollm2"])
        p.add_argument("--root", type=Path, default=Path("/work/real"))
        p.add_argument("--out", type=Path, default=None, help="where exports/ and ppl/ go (default: ROOT)")
        if step == "exports":
            p.add_argument("--rules", nargs="+", default=list(RULES))
            p.add_argument("--groups", nargs="+", type=int, default=list(GROUPS))
            feeds_help = f"windows of calib.txt for {AUTO_FEEDS}"
            p.add_argument("--feed-windows", type=int, default=FEED_WINDOWS, help=feeds_help)
        if step == "measure":
            p.add_argument("--max-tokens", type=int, default=None)
            p.add_argument("--threads", type=int, default=None)
            p.add_argument("--window", type=int, default=512)
            p.add_argument("--only", default=None, help="only these labels (comma-separated, in this order)")
            p.add_argument("--group", type=int, default=GROUP, help="models per perplexity call")
        if step == "decode":
            p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
            p.add_argument("--rounds", type=int, default=3)
            p.add_argument("--steps", type=int, default=32, help="new tokens per greedy run (and llama-bench tg)")
            p.add_argument("--llama", type=Path, default=Path("/work/real/llama.cpp/src/build/bin"))
    args = ap.parse_args()
    out = args.out or args.root
    if args.step == "exports":
        make_exports(args.root, args.name, args.rules, args.groups, out, args.feed_windows)
    elif args.step == "decode":
        decode(args.root, args.name, out, args.threads, args.rounds, args.steps, args.llama)
    elif args.step == "measure":
        measure(args.root, args.name, args.max_tokens, args.threads, args.window, args.only, args.group, out)
    else:
        print("\n\n".join(table(out, n) for n in args.name if (out / n / "ppl").is_dir()))
        for n in args.name:
            print("\n" + decode_table(out, n))


if __name__ == "__main__":
    main()
