"""A ModelProto handed to ONNX Runtime: the one size guard (protobuf holds < 2 GiB) and the one session helper."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import onnx
import onnxruntime as ort

# Protobuf cannot serialise 2 GiB: a ModelProto at least this big goes to ORT as a file with external data.
IN_MEMORY_LIMIT = 1 << 30


@contextmanager
def ort_source(model: onnx.ModelProto) -> Iterator[bytes | str]:
    """What ORT loads ``model`` from: its bytes, or from IN_MEMORY_LIMIT on a temporary file (valid inside the block).

    ORT has read the file by the time a session exists, so a session made inside the block
    outlives it. ``model`` itself is left whole (a copy is saved).
    """
    if model.ByteSize() < IN_MEMORY_LIMIT:
        yield model.SerializeToString()
        return
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    with tempfile.TemporaryDirectory(prefix="cim_int4_") as tmp:
        path = Path(tmp) / "model.onnx"
        onnx.save_model(copy, path, save_as_external_data=True, location="model.onnx.data", convert_attribute=True)
        yield str(path)


def proto_session(model: onnx.ModelProto, options: ort.SessionOptions) -> ort.InferenceSession:
    """The one way this package turns a ModelProto into a CPU InferenceSession (any size)."""
    with ort_source(model) as source:
        return ort.InferenceSession(source, sess_options=options, providers=["CPUExecutionProvider"])
