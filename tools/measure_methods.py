"""Export a real LLM (a genai builder FP32 folder) with each method and time it; ORT's GPTQ beside it.

    python tools/measure_methods.py FP32_FOLDER OUT_DIR --calib calib.txt [--windows 8] [--group 32]
        [--variants rtn:signed rtn:mse gptq:mse awq:mse auto:auto] [--ort-gptq]

Calibration: the first ``--windows`` non-overlapping ``--window``-token windows (512) of ``--calib``
(tokenized by the folder's own tokenizer, a BOS first when it adds one or ``--bos`` names it), fed
with empty past key/values.
Each variant is exported (all layers INT4, ``target_cosine=0``) in a child process that reports
its wall time and peak RSS, into ``OUT_DIR/<method>-<rule>-g<G>/`` with the folder's genai
config and tokenizer, so that ``cim-int4 perplexity FP32_FOLDER OUT_DIR/...`` can score it.
``--ort-gptq`` runs onnxruntime's MatMulNBitsQuantizer with GPTQWeightOnlyQuantConfig (block
``--group``, symmetric) on the same windows into ``OUT_DIR/ort-gptq-g<G>/`` (slow: run it once).
Results are appended to ``OUT_DIR/times.json``.
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

import numpy as np

SIDE_FILES = ("genai_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "chat_template.jinja", "tokenizer.model")  # fmt: skip


def calibration_windows(
    folder: Path, text: Path, count: int, window: int = 512, bos: int | None = None
) -> list[dict[str, np.ndarray]]:
    """``count`` feed dicts of one ``window``-token window each, from ``text``, empty past key/values.

    ``bos``: a token id every window starts with although the tokenizer adds none (Gemma 3: 2).
    """
    import onnx
    import onnxruntime_genai as og

    config = json.loads((folder / "genai_config.json").read_text())["model"]
    decoder = config["decoder"]
    tok = og.Tokenizer(og.Config(str(folder)))
    probe = [int(t) for t in tok.encode("a")]
    if bos is None:
        bos = config.get("bos_token_id")
        adds_bos = isinstance(bos, int) and len(probe) > 1 and probe[0] == bos
    else:
        adds_bos = True
    ids = [int(t) for t in tok.encode(text.read_text(encoding="utf-8"))]
    if adds_bos and ids and ids[0] == bos:
        ids = ids[1:]
    span = window - adds_bos
    model = onnx.load(folder / decoder["filename"], load_external_data=False)
    inputs = [i.name for i in model.graph.input]
    kv = (1, decoder["num_key_value_heads"], 0, decoder["head_size"])
    feeds = []
    for start in range(0, len(ids) - span + 1, span):
        body = np.array(([bos] if adds_bos else []) + ids[start : start + span], dtype=np.int64)[None, :]
        feed = {}
        for name in inputs:
            if name == "input_ids":
                feed[name] = body
            elif name == "attention_mask":
                feed[name] = np.ones_like(body)
            elif name == "position_ids":
                feed[name] = np.arange(body.shape[1], dtype=np.int64)[None, :]
            else:
                feed[name] = np.zeros(kv, dtype=np.float32)
        feeds.append(feed)
        if len(feeds) == count:
            break
    return feeds


def _child(args: argparse.Namespace) -> None:
    import resource

    folder = Path(args.folder)
    feeds = calibration_windows(folder, Path(args.calib), args.windows, args.window, args.bos)
    out = Path(args.out)
    method, rule = args.variant.split(":")
    start = time.perf_counter()
    if method == "ort-gptq":
        _ort_gptq(folder, feeds, out, args.group)
    else:
        from cim_int4.exporter import export_int4

        model = folder / json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]["filename"]
        export_int4(model, out / model.name, group_size=args.group, scale_rule=rule, method=method, feeds=feeds,
                    target_cosine=0.0, quiet=False, external_data=True)  # fmt: skip
    seconds = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_SELF)
    peak = usage.ru_maxrss * 1024
    cpu = usage.ru_utime + usage.ru_stime
    print(json.dumps({"variant": args.variant, "group": args.group, "windows": args.windows,
                      "seconds": seconds, "cpu_seconds": cpu, "peak_rss": peak}))  # fmt: skip


def _ort_gptq(folder: Path, feeds: list[dict[str, np.ndarray]], out: Path, group: int) -> None:
    from onnx.external_data_helper import load_external_data_for_model
    from onnxruntime.quantization import CalibrationDataReader
    from onnxruntime.quantization.matmul_nbits_quantizer import GPTQWeightOnlyQuantConfig, MatMulNBitsQuantizer

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.items = iter(feeds)

        def get_next(self) -> dict | None:
            return next(self.items, None)

        def __deepcopy__(self, memo: dict) -> Reader:
            return Reader()

        def __iter__(self):  # noqa: ANN204 - ORT iterates the reader it deep-copies
            return iter(feeds)

    config = GPTQWeightOnlyQuantConfig(calibration_data_reader=Reader())
    here = os.getcwd()
    os.chdir(folder)  # ORT's quantizer reads external data relative to the working directory
    try:
        quant = MatMulNBitsQuantizer(
            str(folder / "model.onnx"), block_size=group, is_symmetric=True, algo_config=config
        )
        quant.process()
        # The tensors it never loaded (the embedding, norms) still point into the input's data file: read them
        # in, or the saved model would point into its own data file at the input's offsets.
        load_external_data_for_model(quant.model.model, str(folder))
        out.mkdir(parents=True, exist_ok=True)
        os.chdir(out)  # onnx checks for an existing "model.onnx.data" in the working directory: not the input's
        quant.model.save_model_to_file(str(out / "model.onnx"), use_external_data_format=True)
    finally:
        os.chdir(here)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder")
    p.add_argument("out_dir")
    p.add_argument("--calib", required=True)
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--group", type=int, default=32)
    p.add_argument("--window", type=int, default=512, help="tokens per calibration window (Gemma 3: 256)")
    p.add_argument("--bos", type=int, default=None, help="a token every window starts with (Gemma 3: 2)")
    p.add_argument("--variants", nargs="*", default=["rtn:signed", "rtn:mse", "gptq:mse", "awq:mse", "auto:auto"])
    p.add_argument("--ort-gptq", action="store_true", help="also run ORT's GPTQ (slow)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.variant, args.out = args.child.split("@", 1)
        _child(args)
        return
    out_dir = Path(args.out_dir)
    variants = [*args.variants, *(["ort-gptq:signed"] if args.ort_gptq else [])]
    for variant in variants:
        method, rule = variant.split(":")
        name = f"ort-gptq-g{args.group}" if method == "ort-gptq" else f"{method}-{rule}-g{args.group}"
        out = out_dir / name
        if (out / "model.onnx").exists():
            print(f"{name}: exists, skipped", flush=True)
            continue
        out.mkdir(parents=True, exist_ok=True)
        for side in SIDE_FILES:
            if (Path(args.folder) / side).exists():
                shutil.copy(Path(args.folder) / side, out / side)
        cmd = [sys.executable, __file__, args.folder, str(out_dir), "--calib", args.calib, "--windows",
               str(args.windows), "--group", str(args.group), "--window", str(args.window),
               *(["--bos", str(args.bos)] if args.bos is not None else []), "--child", f"{variant}@{out}"]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True)
        (out / "export.log").write_text(run.stdout + run.stderr)
        if run.returncode:
            print(f"{name}: failed ({run.stderr.strip().splitlines()[-1:]})", flush=True)
            continue
        last = run.stdout.strip().splitlines()[-1]
        result = json.loads(last[last.index("{") :])  # ORT's GPTQ ends its progress bar without a newline
        print(f"{name}: {result['seconds']:.0f} s, peak RSS {result['peak_rss'] / 2**20:.0f} MiB", flush=True)
        times = out_dir / "times.json"
        rows = json.loads(times.read_text()) if times.exists() else []
        times.write_text(json.dumps([*rows, {"name": name, **result}], indent=1))


if __name__ == "__main__":
    main()
