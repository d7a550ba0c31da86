"""Peak RSS of `cim-int4 genai` and `cim-int4 convert` on an onnxruntime-genai folder (docs/guide.md: convert memory).

Usage: .venv/bin/python tools/measure_convert_memory.py GENAI_FOLDER WORK_FOLDER [--keep]
Runs each conversion in a fresh child process (genai on the folder; convert on its decoder
file, with and without --external-data), prints its VmHWM (and the child's RSS after the
imports) over the int4 bytes (B + scales of the MatMulNBits nodes), then deletes what it wrote
under WORK_FOLDER/cim-int4-convert-memory (unless --keep: to compare outputs of two versions).
GENAI_FOLDER is only read.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from cim_int4.exporter.convert import int4_bytes

from cim_int4.bench.convert_memory import conversion_peak
from cim_int4.genai_bench import decoder_file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("work", type=Path)
    parser.add_argument("--keep", action="store_true", help="keep the outputs")
    args = parser.parse_args()
    work = args.work / "cim-int4-convert-memory"
    work.mkdir(parents=True)
    decoder = decoder_file(args.folder)
    weights = int4_bytes(decoder)
    print(f"{decoder}: int4 bytes (B + scales) {weights / 1e6:.1f} MB")
    runs = [
        ("genai", args.folder, work / "genai", False),
        ("convert", decoder, work / "model.onnx", False),
        ("convert", decoder, work / "model-ext.onnx", True),
    ]
    try:
        for mode, source, output, external in runs:
            base, hwm = conversion_peak(mode, source, output, external)
            label = f"{mode}{' --external-data' if external else ''}"
            print(
                f"{label:24s} peak RSS {hwm / 1e6:7.0f} MB ({hwm / weights:.2f}x int4), "
                f"after imports {base / 1e6:.0f} MB, peak - imports {(hwm - base) / weights:.2f}x int4"
            )
    finally:
        if not args.keep:
            shutil.rmtree(work)


if __name__ == "__main__":
    main()
