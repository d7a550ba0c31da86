"""Peak RSS of one `cim-int4 genai` or `cim-int4 convert` run in a fresh process (for tools and tests)."""

from __future__ import annotations

import os
import subprocess
import sys

# argv: mode ("genai" or "convert"), source, output, external ("1" or "0"). Prints RSS after the imports and VmHWM.
_CHILD = """
import sys
from cim_int4.bench.memory_child import vm_status
from cim_int4.exporter.api import max_ir_version
from cim_int4.exporter.convert import convert_file
from cim_int4.genai import prepare
max_ir_version()  # imports onnxruntime: part of the baseline, not of the conversion
baseline = vm_status()["VmRSS"]
mode, source, output, external = sys.argv[1:5]
if mode == "genai":
    prepare(source, output, quiet=True)
else:
    convert_file(source, output, quiet=True, external_data=external == "1")
print(baseline, vm_status()["VmHWM"])
"""


def conversion_peak(
    mode: str, source: str | os.PathLike, output: str | os.PathLike, external_data: bool = False
) -> tuple[int, int]:
    """(RSS after the imports, peak RSS) in bytes of ``prepare(source, output)`` or ``convert_file`` in a child."""
    if mode not in ("genai", "convert"):
        raise ValueError(f"mode must be 'genai' or 'convert', got {mode!r}")
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, mode, str(source), str(output), "1" if external_data else "0"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return int(out[0]), int(out[1])
