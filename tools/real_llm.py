"""Rebuild every real-LLM figure of docs/real-llm.md: perplexity of each scale rule vs MatMulNBits RTN.

Three steps, each reusing what exists under ROOT (default /work/real):

1. Models and text (a heavy virtualenv with torch; never the project's, never CI):

       python3 -m venv VENV && VENV/bin/pip install torch (the CPU wheel) transformers accelerate gguf \\
           onnx "onnxruntime==1.32.*" onnxruntime-genai sentencepiece tokenizers
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
import shutil
import time
from pathlib import Path

RULES = ("signed", "mse", "balanced", "amax8")  # "auto" without feeds is "balanced" (or the default's rule)
GROUPS = (32, 128)
COMPUTES = ("fp32", "int8")
GROUP = 3  # models per perplexity call besides the reference
# Gemma is trained with <bos> first, but the tokenizer transformers saves from its GGUF does not
# add it (llama.cpp does, from the GGUF's add_bos_token): start every window with it.
BOS = {"gemma3": 2}


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


def export_folder(root: Path, name: str, rule: str, group: int) -> Path:
    return root / name / "exports" / f"{rule}-g{group}"


def make_exports(root: Path, name: str, rules: list[str], groups: list[int]) -> None:
    """export_int4 of the builder's FP32 decoder with each rule and group size, as genai folders."""
    from cim_int4.exporter import export_int4

    from cim_int4.genai import copy_folder, model_files
    from cim_int4.genai_bench import decoder_file

    src = root / name / "fp32"
    decoder = decoder_file(src)
    for group in groups:
        for rule in rules:
            out = export_folder(root, name, rule, group)
            if (out / "genai_config.json").is_file():
                continue
            tmp = out.with_name(out.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            copy_folder(src, tmp, model_files(decoder) | {src / "genai_config.json"})
            t0 = time.perf_counter()
            export_int4(decoder, tmp / decoder.name, group_size=group, scale_rule=rule, external_data=True, quiet=True)
            seconds = time.perf_counter() - t0
            shutil.copyfile(src / "genai_config.json", tmp / "genai_config.json")
            (tmp / "export.json").write_text(json.dumps({"rule": rule, "group": group, "seconds": seconds}) + "\n")
            tmp.rename(out)
            print(f"{name}: exported {rule} g{group} in {seconds:.0f} s")


def variants(root: Path, name: str) -> list[tuple[str, Path, str | None]]:
    """(label, folder, compute) of every model to measure; compute None = the model's own."""
    out = [(label, folder, None) for label, folder in builder_folders(root, name).items()]
    for group in GROUPS:
        for rule in RULES:
            folder = export_folder(root, name, rule, group)
            if (folder / "genai_config.json").is_file():
                out += [(f"{rule}-g{group}-{compute}", folder, compute) for compute in COMPUTES]
    return out


def measure(
    root: Path, name: str, max_tokens: int | None, threads: int | None, window: int, only: str | None, group: int
) -> None:
    """Perplexity of every variant vs the FP32 folder, ``group`` models per call; one JSON per model."""
    from cim_int4.contract import DEFAULT_COMPUTE
    from cim_int4.perplexity import perplexity
    from cim_int4.report import write_json

    out_dir = root / name / "ppl"
    out_dir.mkdir(parents=True, exist_ok=True)
    todo = [v for v in variants(root, name) if not (out_dir / f"{v[0]}.json").is_file()]
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


def table(root: Path, name: str) -> str:
    """The markdown table of one model's results."""
    rows, ref, s = load_results(root, name)
    lines = [
        f"{name}: FP32 perplexity {ref['perplexity']:.4f} on {s['scored_tokens']} scored tokens "
        f"({s['windows']} windows of {s['window']}, BOS {s['bos']}, {s['text']}).",
        "",
        "| model | group | compute | perplexity | gap / RTN acc4 gap | gap / RTN acc0 gap | gap / `signed` gap "
        "| KL per token | top-1 agreement |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def ratio(row: dict, base: str) -> str:
        b = rows.get(base)
        if b is None or b["perplexity"] == ref["perplexity"]:
            return "-"
        return f"{(row['perplexity'] - ref['perplexity']) / (b['perplexity'] - ref['perplexity']):.3f}"

    order = sorted(rows, key=lambda k: (int(k.split("-g")[1].split("-")[0]), k))
    for label in order:
        row = rows[label]
        group = int(label.split("-g")[1].split("-")[0])
        if label.startswith("nbits"):
            what, compute = f"MatMulNBits RTN ({label.split('-')[1]})", "acc" + label.split("-")[1][3:]
        else:
            what, compute = f"export_int4 `{label.split('-g')[0]}`", label.rsplit("-", 1)[1]
        lines.append(
            f"| {what} | {group} | {compute} | {row['perplexity']:.4f} | {ratio(row, f'nbits-acc4-g{group}')} | "
            f"{ratio(row, f'nbits-acc0-g{group}')} | {ratio(row, f'signed-g{group}-fp32')} | {row['kl']:.5f} | "
            f"{row['top1_agreement']:.4f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="step", required=True)
    for step in ("exports", "measure", "table"):
        p = sub.add_parser(step)
        p.add_argument("name", nargs="*" if step == "table" else None, default=["gemma3", "smollm2"])
        p.add_argument("--root", type=Path, default=Path("/work/real"))
        if step == "exports":
            p.add_argument("--rules", nargs="+", default=list(RULES))
            p.add_argument("--groups", nargs="+", type=int, default=list(GROUPS))
        if step == "measure":
            p.add_argument("--max-tokens", type=int, default=None)
            p.add_argument("--threads", type=int, default=None)
            p.add_argument("--window", type=int, default=512)
            p.add_argument("--only", default=None, help="only these labels (comma-separated, in this order)")
            p.add_argument("--group", type=int, default=GROUP, help="models per perplexity call")
    args = ap.parse_args()
    if args.step == "exports":
        make_exports(args.root, args.name, args.rules, args.groups)
    elif args.step == "measure":
        measure(args.root, args.name, args.max_tokens, args.threads, args.window, args.only, args.group)
    else:
        print("\n\n".join(table(args.root, n) for n in args.name if (args.root / n / "ppl").is_dir()))


if __name__ == "__main__":
    main()
