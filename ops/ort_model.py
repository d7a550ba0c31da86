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
def ort_source(model: onnx.ModelProto, via_file: bool = False, consume: bool = False) -> Iterator[bytes | str]:
    """What ORT loads ``model`` from: its bytes, or from IN_MEMORY_LIMIT on a temporary file (valid inside the block).

    ORT has read the file by the time a session exists, so a session made inside the block
    outlives it. ``model`` itself is left whole (a copy is saved) unless ``consume``: then its
    tensors' bytes move to the file (no copy, and none held beside the session). ``via_file``:
    a temporary file at any size (the bytes are then never in memory twice: proto and string).
    """
    if not via_file and model.ByteSize() < IN_MEMORY_LIMIT:
        yield model.SerializeToString()
        return
    if not consume:
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        model = copy
    with tempfile.TemporaryDirectory(prefix="cim_int4_") as tmp:
        path = Path(tmp) / "model.onnx"
        onnx.save_model(model, path, save_as_external_data=True, location="model.onnx.data", convert_attribute=True)
        yield str(path)


def proto_session(
    model: onnx.ModelProto, options: ort.SessionOptions, via_file: bool = False, consume: bool = False
) -> ort.InferenceSession:
    """The one way this package turns a ModelProto into a CPU InferenceSession (any size; see ``ort_source``)."""
    with ort_source(model, via_file, consume) as source:
        return ort.InferenceSession(source, sess_options=options, providers=["CPUExecutionProvider"])
