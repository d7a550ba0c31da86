"""Peak RSS of `export_int4` on a big FP32 chain saved with external data (docs/guide.md: bounded export memory).

Usage: .venv/bin/python tools/measure_export_memory.py FOLDER [--layers 32] [--dim 4096]
Writes FOLDER/chain.onnx + chain.data (32 x 4096x4096 = 2 GiB), exports it in a child
process, prints its VmHWM, then deletes what it wrote. Check the free disk space first.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
from cim_int4.graphs import matmul_chain

CHILD = """
import sys, time
from cim_int4 import export_int4
t0 = time.perf_counter()
export_int4(sys.argv[1], sys.argv[2], quiet=True)
seconds = time.perf_counter() - t0
hwm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(hwm, seconds)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--dim", type=int, default=4096)
    args = parser.parse_args()
    work = args.folder / "cim-int4-export-memory"
    work.mkdir(parents=True)
    try:
        onnx.save(
            matmul_chain(args.layers, args.dim), work / "chain.onnx", save_as_external_data=True, location="chain.data"
        )
        size = (work / "chain.data").stat().st_size
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(work / "chain.onnx"), str(work / "out.onnx")],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        hwm, seconds = int(out[0]), float(out[1])
        print(
            f"model {size / 2**30:.2f} GiB: peak RSS {hwm / 2**30:.2f} GiB ({hwm / size:.2f}x), {seconds:.1f} s; "
            f"output {(work / 'out.onnx').stat().st_size / 2**20:.0f} MiB"
        )
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
