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
    print(json.dumps({"variant": out.name, "options": options, "windows": args.windows, "seconds": seconds,
                      "peak_rss": peak, "fp32_bytes": fp32_bytes, "peak_over_fp32": peak / fp32_bytes}))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("export")
    p.add_argument("folder")
    p.add_argument("out_dir")
    p.add_argument("--calib", required=True)
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--variant", nargs=2, action="append", metavar=("NAME", "OPTIONS_JSON"), required=True)
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
