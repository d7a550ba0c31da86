"""Model files in, in bounded memory: lazy weights and checked external data (writing: exporter.writer).

``read_model`` parses a model file without its weights. Every external-data location
is checked (relative, no ``..``, no symlink, a readable file long enough), and big inline
tensors are turned into references into the model file itself, so that one weight at a time
is read, by ``TensorStore.read``, only when the rewrite needs it. Internally a reference to an
input file has an absolute location; a relative location is the output's own data file.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from . import protowire

# Inline tensors at least this big are read lazily from the model file; smaller ones stay parsed.
LAZY_MIN_BYTES = 4096

_EXTERNAL = onnx.TensorProto.EXTERNAL


class ModelFileError(Exception):
    """A model file, its external data or an output path is unusable; the message names it."""


def iter_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every tensor of ``graph`` and its subgraphs: initializers and tensor attributes (Constant values too)."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from iter_tensors(attr.g)
            for g in attr.graphs:
                yield from iter_tensors(g)


def external_info(tensor: onnx.TensorProto) -> tuple[str, int, int | None]:
    """(location, offset, length or None) of a tensor stored as external data."""
    info = {e.key: e.value for e in tensor.external_data}
    length = info.get("length")
    return info.get("location", ""), int(info.get("offset", 0) or 0), None if length is None else int(length)


def external_span(tensor: onnx.TensorProto) -> tuple[str, int, int]:
    """(location, offset, length) of an external tensor, the length from its shape when the entry has none."""
    location, offset, length = external_info(tensor)
    return location, offset, tensor_nbytes(tensor) if length is None else length


def set_external(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    """Make ``tensor`` refer to ``length`` bytes at ``offset`` of ``location`` instead of holding them."""
    tensor.ClearField("raw_data")
    del tensor.external_data[:]
    tensor.data_location = _EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        tensor.external_data.add(key=key, value=value)


def tensor_nbytes(tensor: onnx.TensorProto) -> int:
    """Bytes of ``tensor``'s values, from its shape and type (whether inline or external)."""
    count = int(np.prod(tensor.dims, dtype=np.int64))
    return count * np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize


# ---------------------------------------------------------------- reading


def _lazy_tensor(buf: mmap.mmap, start: int, end: int, path: str) -> bytes:
    """A serialized TensorProto whose big raw_data becomes a reference into the model file at ``path``."""
    parts, raw = [], None
    for field, fstart, value, stop in protowire.fields(buf, start, end):
        if field == protowire.TENSOR_RAW_DATA:
            raw = (value, stop - value)
        else:
            parts.append(buf[fstart:stop])
    if raw is None or raw[1] < LAZY_MIN_BYTES:
        return buf[start:end]
    tensor = onnx.TensorProto.FromString(b"".join(parts))
    set_external(tensor, path, raw[0], raw[1])
    return tensor.SerializeToString()


def _lazy_model_bytes(buf: mmap.mmap, path: str) -> bytes:
    parts = []
    for field, start, value, stop in protowire.fields(buf, 0, len(buf)):
        if field != protowire.MODEL_GRAPH:
            parts.append(buf[start:stop])
            continue
        graph = []
        for gfield, gstart, gvalue, gstop in protowire.fields(buf, value, stop):
            if gfield == protowire.GRAPH_INITIALIZER:
                graph.append(protowire.field_bytes(gfield, _lazy_tensor(buf, gvalue, gstop, path)))
            else:
                graph.append(buf[gstart:gstop])
        parts.append(protowire.field_bytes(field, b"".join(graph)))
    return b"".join(parts)


def _check_external(tensor: onnx.TensorProto, model_path: Path, base: str) -> str:
    """The absolute path of the file holding ``tensor``'s external data, after checking its location."""
    location, offset, length = external_info(tensor)
    where = f"{model_path}: tensor {tensor.name!r}: external data location {location!r}"
    if not location:
        raise ModelFileError(f"{model_path}: tensor {tensor.name!r} is external but has no location")
    if os.path.isabs(location):
        raise ModelFileError(f"{where} is absolute; it must be relative to the model's folder")
    if ".." in Path(location).parts:
        raise ModelFileError(f"{where} contains '..'; it must stay inside the model's folder")
    full = os.path.join(base, location)
    if os.path.realpath(full) != os.path.normpath(full):
        raise ModelFileError(f"{where} is or goes through a symlink; external data must be a plain file")
    if not os.path.isfile(full):
        raise ModelFileError(f"{where}: no such file {full}")
    try:
        with open(full, "rb"):
            pass
    except OSError as e:
        raise ModelFileError(f"{where}: cannot read {full} ({e.strerror})") from e
    need = offset + (tensor_nbytes(tensor) if length is None else length)
    if offset < 0 or (length is not None and length != tensor_nbytes(tensor)):
        raise ModelFileError(f"{where}: offset {offset} / length {length} do not fit shape {list(tensor.dims)}")
    if need > os.path.getsize(full):
        raise ModelFileError(f"{where}: {full} has {os.path.getsize(full)} bytes, the tensor needs {need}")
    return full


def read_model(path: str | os.PathLike) -> tuple[onnx.ModelProto, list[str]]:
    """The model at ``path`` without its weights (read later by TensorStore) and the real paths of the files it reads.

    The model file itself comes first in that list.

    Raises ModelFileError naming the file for an unreadable model or bad external data.
    """
    p = Path(path)
    if not p.is_file():
        raise ModelFileError(f"{p}: no such file")
    real = os.path.realpath(p)
    try:
        with open(p, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise ModelFileError(f"{p}: not an ONNX model (empty file)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                model = onnx.ModelProto.FromString(_lazy_model_bytes(buf, real))
    except (protowire.Malformed, ValueError, RuntimeError) as e:
        raise ModelFileError(f"{p}: not a readable ONNX model ({type(e).__name__}: {e})") from e
    except OSError as e:
        raise ModelFileError(f"{p}: cannot read ({e.strerror or e})") from e
    except Exception as e:  # protobuf's DecodeError
        raise ModelFileError(f"{p}: not a readable ONNX model ({type(e).__name__}: {e})") from e
    if model.ir_version == 0 or not model.HasField("graph"):
        raise ModelFileError(f"{p}: not an ONNX model (no IR version or no graph)")
    base = os.path.dirname(real)
    files = [real]
    for tensor in iter_tensors(model.graph):
        if tensor.data_location != _EXTERNAL:
            continue
        location, offset, length = external_span(tensor)
        if os.path.isabs(location) and location == real:
            continue  # a lazy inline tensor of the model file itself
        full = _check_external(tensor, p, base)
        set_external(tensor, full, offset, length)
        if full not in files:
            files.append(full)
    return model, files
