"""Where the compiled op library is, and how to hand it to ONNX Runtime."""

from __future__ import annotations

import os
import sys
from pathlib import Path

LIBRARY_NAME = "libcim_int4_ops.so"
LIBRARY_ENV = "CIM_INT4_LIBRARY"


def library_path() -> str:
    """Path of the op library for ``SessionOptions.register_custom_ops_library`` (``CIM_INT4_LIBRARY`` overrides)."""
    override = os.environ.get(LIBRARY_ENV)
    if override:
        if not Path(override).is_file():
            raise FileNotFoundError(f"cim-int4 op library not found at {override} (set by {LIBRARY_ENV})")
        return override
    # An editable install splits the package over the source tree and site-packages
    # (where CMake installed the library); search every folder of the package.
    folders = list(getattr(sys.modules[__package__], "__path__", [])) or [str(Path(__file__).parent)]
    for folder in folders:
        path = Path(folder) / LIBRARY_NAME
        if path.is_file():
            return str(path)
    raise FileNotFoundError(
        f"cim-int4 op library {LIBRARY_NAME} not found in {folders}; build and install the package "
        "with 'pip install .' from the source tree"
    )
