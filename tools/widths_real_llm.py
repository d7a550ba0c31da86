"""Export a real LLM (a genai builder FP32 folder) at mixed widths and score each export's dequantized twin.

    python tools/widths_real_llm.py export FP32_FOLDER OUT_DIR --calib calib.txt --windows 2 \
        --variant NAME '{"bits": "auto", "bits_budget": 4.5, "scale_dtype": "float16", "scale_rule": "signed"}'

Each variant is exported in a child process that reports wall time and peak RSS (appended to
``OUT_DIR/times.json``) into ``OUT_DIR/NAME/``, then turned into its dequantized-FP32 twin
(``tools/dequantized_twin.py``) in ``OUT_DIR/NAME-twin/`` with the folder's genai config and
tokenizer, so ``cim-int4 perplexity FP32_FOLDER OUT_DIR/NAME-twin ...`` scores it before the
kernels for every width are in the op library. Calibration windows: the first ``--windows``
512-token windows of ``--calib`` (tools/measure_methods.py), never the evaluation text.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
SIDE_FILES = ("genai_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "chat_template.jinja", "tokenizer.model")  # fmt: skip


def _child(args: argparse.Namespace) -> None:
    import resource

    sys.path.insert(0, str(HERE))
    from cim_int4.exporter import export_int4
    from measure_methods import calibration_windows

    folder, out = Path(args.folder), Path(args.out)
    options = json.loads(args.options)
    # "feeds": false exports without calibration inputs (a uniform width needs none)
    feeds = calibration_windows(folder, Path(args.calib), args.windows) if options.pop("feeds", True) else None
    # "tune_windows": N trains the scales on the first N windows (exporter.tune); the method saw the first --windows
    tune = options.pop("tune_windows", None)
    if tune:
        options["tune_feeds"] = calibration_windows(folder, Path(args.calib), tune)
    model = folder / json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]["filename"]
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    export_int4(model, out / model.name, feeds=feeds, quiet=False, external_data=True, **options)
    seconds = time.perf_counter() - start
    for side in SIDE_FILES:
        if (folder / side).exists():
            shutil.copy(folder / side, out / side)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    fp32_bytes = sum(p.stat().st_size for p in folder.glob("model.onnx*"))
    bpw = model_bits_per_weight(out / model.name)
    options.pop("tune_feeds", None)
    print(json.dumps({"variant": out.name, "options": options, "windows": args.windows,
                      "tune_windows": tune, "seconds": seconds, "peak_rss": peak, "fp32_bytes": fp32_bytes,
                      "peak_over_fp32": peak / fp32_bytes, "bits_per_weight": bpw}))  # fmt: skip


def model_bits_per_weight(path: Path) -> float:
    """Bits per weight over every MatMul/Gemm weight of an exported model: codes and scales, 32 for FP32 ones.

    A tied head's weights are its table's (counted once, with the CimInt4Gather that shares them).
    """
    import onnx

    from cim_int4.contract import GATHER, MATMUL_SHARED, Int4Node, is_op_node

    model = onnx.load(path)
    inits = {t.name: t for t in model.graph.initializer}
    bits = weights = 0.0
    shared_counted: set[str] = set()
    for node in model.graph.node:
        if is_op_node(node) and len(node.input) == 1:
            n = Int4Node.from_node(node)
            bits += 8 * n.nbytes - 8 * (0 if n.bias is None else n.bias.nbytes)  # codes and stored scales
            weights += n.k * n.n
        elif is_op_node(node, MATMUL_SHARED) or is_op_node(node, GATHER):
            attrs = {a.name: a.i for a in node.attribute}
            packed, scales = (node.input[0], node.input[2]) if is_op_node(node, GATHER) else node.input[1:3]
            if packed in shared_counted:
                continue
            shared_counted.add(packed)
            rows = inits[packed].dims[0]
            tensors = (packed, scales, *node.input[3:4])  # int8 scales: their super-scales too
            bits += 8 * sum(onnx.numpy_helper.to_array(inits[t]).nbytes for t in tensors if t)
            weights += rows * attrs["K"]
        elif node.op_type in ("MatMul", "Gemm") and len(node.input) > 1 and node.input[1] in inits:
            t = inits[node.input[1]]
            size = int(np.prod(t.dims))
            bits, weights = bits + 32 * size, weights + size
    return bits / max(weights, 1)


def score(args: argparse.Namespace) -> None:
    """``cim-int4 perplexity`` of FP32, the builder's MatMulNBits int4 and each variant's twin, a few per call."""
    out_dir = Path(args.out_dir)
    times = {}
    if (out_dir / "times.json").exists():
        for line in (out_dir / "times.json").read_text().splitlines():
            times[json.loads(line)["variant"]] = json.loads(line)
    names = args.names
    rows = []
    for i in range(0, len(names), args.per_call):
        group = names[i : i + args.per_call]
        result = out_dir / f"ppl-{'-'.join(group)}.json"
        cmd = [args.cli, "perplexity", args.folder, args.rtn, *[str(out_dir / f"{n}-twin") for n in group],
               "--text", args.text, "--max-tokens", str(args.max_tokens), "--threads", str(args.threads),
               "--json", str(result), "-q", *args.extra]  # fmt: skip
        subprocess.run(cmd, check=True)
        data = json.loads(result.read_text())
        fp32, rtn, *mine = data["models"]
        base, yardstick = fp32["perplexity"], rtn["perplexity"] - fp32["perplexity"]
        for n, m in zip(group, mine, strict=True):
            bpw = times.get(n, {}).get("bits_per_weight") or model_bits_per_weight(out_dir / n / "model.onnx")
            rows.append({"model": Path(args.folder).parent.name, "variant": n, "bits_per_weight": bpw,
                         "perplexity": m["perplexity"], "fp32": fp32["perplexity"], "rtn": rtn["perplexity"],
                         "gap_over_rtn": (m["perplexity"] - base) / yardstick,
                         "kl": m["kl"], "tokens": m["tokens"]})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    path = out_dir / "scores.json"  # merged with earlier calls' rows (a variant scored again replaces its row)
    earlier = json.loads(path.read_text()) if path.exists() else []
    scored = {r["variant"] for r in rows}
    path.write_text(json.dumps([r for r in earlier if r["variant"] not in scored] + rows, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("export")
    p.add_argument("folder")
    p.add_argument("out_dir")
    p.add_argument("--calib", required=True)
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--variant", nargs=2, action="append", metavar=("NAME", "OPTIONS_JSON"), required=True)
    p = sub.add_parser("score")
    p.add_argument("folder", help="the FP32 genai folder (the reference)")
    p.add_argument("out_dir")
    p.add_argument("names", nargs="+", help="variants exported into OUT_DIR (their -twin folders are scored)")
    p.add_argument("--rtn", required=True, help="the builder's MatMulNBits int4 folder (the gap's yardstick)")
    p.add_argument("--text", required=True)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--per-call", type=int, default=3, help="twins per perplexity call (every session is held at once)")
    p.add_argument("--cli", default=str(Path(sys.executable).parent / "cim-int4"))
    p.add_argument("--extra", nargs="*", default=[], help="more perplexity flags (e.g. --bos 2)")
    p = sub.add_parser("_child")
    p.add_argument("folder")
    p.add_argument("out")
    p.add_argument("--calib", required=True)
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--options", required=True)
    args = parser.parse_args()
    if args.cmd == "_child":
        _child(args)
        return
    if args.cmd == "score":
        score(args)
        return
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, options in args.variant:
        target = out_dir / name
        cmd = [sys.executable, __file__, "_child", args.folder, str(target), "--calib", args.calib,
               "--windows", str(args.windows), "--options", options]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True)
        (out_dir / f"{name}.log").write_text(run.stdout + run.stderr)
        if run.returncode:
            print(f"{name}: export failed, see {out_dir / name}.log", file=sys.stderr)
            continue
        result = json.loads(run.stdout.strip().splitlines()[-1])
        with (out_dir / "times.json").open("a") as f:
            f.write(json.dumps(result) + "\n")
        print(json.dumps(result))
        twin = out_dir / f"{name}-twin"
        subprocess.run([sys.executable, str(HERE / "dequantized_twin.py"), str(target / "model.onnx"),
                        str(twin / "model.onnx")], check=True)  # fmt: skip


if __name__ == "__main__":
    main()
