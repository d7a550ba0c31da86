"""Where the compiled op library is, and how to hand it to ONNX Runtime."""

from __future__ import annotations

import os
from pathlib import Path

LIBRARY_NAME = "libcim_int4_ops.so"
LIBRARY_ENV = "CIM_INT4_LIBRARY"


def library_path() -> str:
    """Path of the op library for ``SessionOptions.register_custom_ops_library`` (env ``CIM_INT4_LIBRARY`` overrides)."""
    override = os.environ.get(LIBRARY_ENV)
    path = Path(override) if override else Path(__file__).resolve().parent / LIBRARY_NAME
    if not path.is_file():
        where = f"{LIBRARY_ENV}={override}" if override else "the installed cim_int4 package"
        raise FileNotFoundError(
            f"cim-int4 op library not found at {path} ({where}); build and install the package with "
            "'pip install .' from the source tree"
        )
    return str(path)
