"""Train the scales of a real LLM's export (a genai folder) against its FP32 folder, then write it and its twin.

    python tools/tune_real_llm.py FP32_FOLDER EXPORTED_FOLDER OUT_FOLDER --calib calib.txt --windows 32 \
        [--held-out 2] [--epochs 4] [--lr 2e-3] [--skip 0]

Calibration windows: 512-token windows of ``--calib`` (tools/measure_methods.py), the last
``--held-out`` of them watched, never the evaluation text; ``--skip`` windows are passed over first
(to train on other windows than the export's GPTQ saw). OUT_FOLDER gets the tuned model with the
exported folder's side files, and ``OUT_FOLDER-twin`` its dequantized twin for
``cim-int4 perplexity`` (widths the op library has no kernels for). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("fp32")
    parser.add_argument("exported")
    parser.add_argument("out")
    parser.add_argument("--calib", required=True)
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--held-out", type=int, default=2)
    parser.add_argument("--skip", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-3)
    args = parser.parse_args()

    sys.path.insert(0, str(HERE))
    import onnx
    import onnxruntime as ort
    from cim_int4.exporter.tune.scales import TuneOptions, tune_scales
    from cim_int4.exporter.tune.twin import twin
    from measure_methods import calibration_windows

    fp32, exported, out = Path(args.fp32), Path(args.exported), Path(args.out)
    config = json.loads((fp32 / "genai_config.json").read_text())["model"]["decoder"]["filename"]
    windows = calibration_windows(fp32, Path(args.calib), args.skip + args.windows)[args.skip :]
    teacher_session = ort.InferenceSession(str(fp32 / config), providers=["CPUExecutionProvider"])
    names = {i.name for i in teacher_session.get_inputs()}
    teacher = lambda feeds: teacher_session.run(["logits"], {k: v for k, v in feeds.items() if k in names})[0]  # noqa: E731
    model = onnx.load(exported / "model.onnx")
    start = time.time()
    result = tune_scales(
        model,
        windows,
        teacher,
        TuneOptions(args.epochs, args.lr, args.held_out),
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )
    twinned = onnx.ModelProto()
    twinned.CopyFrom(model)  # before saving: a save to external data empties the saved model's tensors
    twinned = twin(twinned)
    out.mkdir(parents=True, exist_ok=True)
    onnx.save(model, out / "model.onnx", save_as_external_data=True, location="model.onnx.data")
    for f in exported.iterdir():
        if f.is_file() and not f.name.startswith("model.onnx"):
            shutil.copy(f, out / f.name)
    twin_dir = out.parent / f"{out.name}-twin"
    twin_dir.mkdir(parents=True, exist_ok=True)
    onnx.save(twinned, twin_dir / "model.onnx", save_as_external_data=True, location="model.onnx.data")
    for f in exported.iterdir():
        if f.is_file() and not f.name.startswith("model.onnx"):
            shutil.copy(f, twin_dir / f.name)
    print(json.dumps({"held_out_kl_before": result.kl_before, "held_out_kl_after": result.kl_after,
                      "tune_seconds": round(result.seconds), "wall_seconds": round(time.time() - start),
                      "scales": result.params, **vars(args)}))  # fmt: skip


if __name__ == "__main__":
    main()
