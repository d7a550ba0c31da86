"""Model files out, in bounded memory: weights read one at a time, atomic outputs.

``OutputFiles`` writes ``<out>.data`` and ``<out>`` under temporary names in the output folder,
with the umask's permissions, and renames them last (data first, model last); a failure leaves
nothing behind. ``TensorStore`` reads the weights that ``exporter.io.read_model`` left in their
files, one at a time, and moves new tensors to the output's data file.
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np
import onnx
from onnx import helper, numpy_helper

from . import protowire
from .io import ModelFileError, external_info, external_span, iter_tensors, set_external

# Protobuf cannot serialise 2 GiB; above this the output keeps its tensors in <output>.data.
EXTERNAL_DATA_THRESHOLD = 1 << 30
# Output tensors at least this big go to <output>.data when the output uses external data (as onnx.save).
EXTERNAL_MIN_BYTES = 1024
# A progress bar is shown when the tensors read or copied add up to this much.
PROGRESS_MIN_BYTES = 256 << 20
_COPY_CHUNK = 16 << 20
_EXTERNAL = onnx.TensorProto.EXTERNAL


class Progress:
    """A tqdm bar over bytes read or copied, shown only when ``total`` is big and not ``quiet``."""

    def __init__(self, total: int, quiet: bool, label: str = "cim-int4 export") -> None:
        self._bar = None
        if not quiet and total >= PROGRESS_MIN_BYTES:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="B", unit_scale=True, desc=label, file=sys.stderr, leave=False)

    def update(self, nbytes: int) -> None:
        if self._bar is not None:
            self._bar.update(nbytes)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class TensorStore:
    """Reads weights one at a time from their files; with a sink, moves new tensors to the output's data file."""

    def __init__(self, sink: OutputFiles | None = None, progress: Progress | None = None) -> None:
        self.sink = sink
        self.progress = progress or Progress(0, True)

    def _path(self, location: str) -> str:
        if os.path.isabs(location):
            return location
        if self.sink is None or location != self.sink.data_name:
            raise ModelFileError(f"external data {location!r} is not a file of this export")
        return str(self.sink.tmp_data)

    def read_bytes(self, tensor: onnx.TensorProto) -> bytes:
        """The raw bytes of an external ``tensor``."""
        location, offset, length = external_span(tensor)
        if self.sink is not None and self.sink._data is not None and location == self.sink.data_name:
            self.sink._data.flush()  # read back what this export has written so far
        with open(self._path(location), "rb") as f:
            f.seek(offset)
            data = f.read(length)
        self.progress.update(len(data))
        return data

    def read(self, tensor: onnx.TensorProto) -> np.ndarray:
        """``tensor`` as an array, read from its file when it is external (the proto is left as it is)."""
        if tensor.data_location != _EXTERNAL:
            return numpy_helper.to_array(tensor)
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
        if dtype.kind not in "fiub":
            raise ModelFileError(f"tensor {tensor.name!r}: external data of type {dtype} is not supported")
        location, offset, _ = external_info(tensor)
        count = int(np.prod(tensor.dims, dtype=np.int64))
        array = np.fromfile(self._path(location), dtype=dtype.newbyteorder("<"), count=count, offset=offset)
        if array.size != count:
            raise ModelFileError(f"tensor {tensor.name!r}: {location} ends before the tensor's {count} elements")
        self.progress.update(array.nbytes)
        return array.astype(dtype, copy=False).reshape(tuple(tensor.dims))

    def write(self, tensor: onnx.TensorProto) -> None:
        """Move a new tensor's bytes to the output's data file now (no-op without a sink or for small tensors)."""
        if self.sink is not None and len(tensor.raw_data) >= EXTERNAL_MIN_BYTES:
            offset = self.sink.append(tensor.raw_data)
            set_external(tensor, self.sink.data_name, offset, len(tensor.raw_data))

    def copy_to(self, tensor: onnx.TensorProto, dst: BinaryIO) -> None:
        """Write the bytes of an external ``tensor`` to ``dst`` in chunks."""
        location, offset, length = external_span(tensor)
        with open(self._path(location), "rb") as src:
            _copy(src, offset, length, dst.write, self.progress)

    def inline_tensor(self, tensor: onnx.TensorProto) -> None:
        """Read an external ``tensor`` back into the proto."""
        data = self.read_bytes(tensor)
        del tensor.external_data[:]
        tensor.ClearField("data_location")
        tensor.raw_data = data

    def inline(self, model: onnx.ModelProto, *, graph_initializers: bool = True) -> None:
        """Read every external tensor of ``model`` back into the proto (the main graph's initializers if asked)."""
        tensors = iter_tensors(model.graph)
        if not graph_initializers:  # iter_tensors yields them first
            tensors = itertools.islice(tensors, len(model.graph.initializer), None)
        for tensor in tensors:
            if tensor.data_location == _EXTERNAL:
                self.inline_tensor(tensor)

    def externalize(self, model: onnx.ModelProto) -> None:
        """Copy input-file tensors and big inline tensors of ``model`` into the output's data file."""
        assert self.sink is not None
        for tensor in iter_tensors(model.graph):
            if tensor.data_location == _EXTERNAL:
                location, offset, length = external_info(tensor)
                if not os.path.isabs(location):
                    continue  # already in the output's data file
                if (length or 0) < EXTERNAL_MIN_BYTES:
                    # The same rule as for inline tensors: the output does not depend on where the input kept it.
                    self.inline_tensor(tensor)
                    continue
                with open(location, "rb") as src:
                    new_offset = self.sink.copy_from(src, offset, length or 0, self.progress)
                set_external(tensor, self.sink.data_name, new_offset, length or 0)
            else:
                if not tensor.raw_data and tensor.ByteSize() >= EXTERNAL_MIN_BYTES:
                    # float_data and friends: store as raw bytes so the tensor can move out too.
                    tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor), tensor.name))
                self.write(tensor)

    def external_bytes(self, model: onnx.ModelProto) -> int:
        """Bytes of ``model``'s tensors held outside the proto."""
        total = 0
        for tensor in iter_tensors(model.graph):
            if tensor.data_location == _EXTERNAL:
                total += external_span(tensor)[2]
        return total


def without(message, names: tuple[str, ...]):  # noqa: ANN001, ANN201 - any protobuf message
    """A copy of ``message`` without the fields ``names`` (which are not copied at all)."""
    head = type(message)()
    for fd, value in message.ListFields():
        if fd.name in names:
            continue
        if getattr(fd, "is_repeated", None) or getattr(fd, "label", None) == fd.LABEL_REPEATED:  # protobuf 7 / older
            getattr(head, fd.name).extend(value)
        elif fd.message_type is not None:
            getattr(head, fd.name).CopyFrom(value)
        else:
            setattr(head, fd.name, value)
    return head


def _split_fields(data: bytes, *bounds: int) -> list[bytes]:
    """``data``'s fields cut into runs by field number: below bounds[0], between bounds..., above the last."""
    runs = [bytearray() for _ in range(len(bounds) + 1)]
    for field, start, _, stop in protowire.fields(data, 0, len(data)):
        runs[sum(field > b for b in bounds)] += data[start:stop]
    return [bytes(r) for r in runs]


def _inline_parts(tensor: onnx.TensorProto) -> tuple[bytes, bytes, int]:
    """(fields up to raw_data's head, fields after raw_data, data length) of external ``tensor`` serialized inline."""
    length = external_span(tensor)[2]
    plain = without(tensor, ("raw_data", "external_data", "data_location"))
    before, after = _split_fields(plain.SerializeToString(), protowire.TENSOR_RAW_DATA)
    return before + protowire.field_head(protowire.TENSOR_RAW_DATA, length), after, length


def _item_size(item: onnx.NodeProto | onnx.TensorProto, streamed: bool) -> int:
    """Serialized size of a node or initializer (an external initializer as if inline when ``streamed``)."""
    if streamed and isinstance(item, onnx.TensorProto) and item.data_location == _EXTERNAL:
        before, after, length = _inline_parts(item)
        return len(before) + length + len(after)
    return item.ByteSize()


def _graph_size(graph: onnx.GraphProto, streamed: bool = False) -> int:
    """``graph.ByteSize()`` one node and initializer at a time (upb's ByteSize serializes the whole message)."""
    size = without(graph, ("node", "initializer")).ByteSize()
    for field, items in ((1, graph.node), (protowire.GRAPH_INITIALIZER, graph.initializer)):
        for item in items:
            n = _item_size(item, streamed)
            size += len(protowire.field_head(field, n)) + n
    return size


def model_size(model: onnx.ModelProto) -> int:
    """``model.ByteSize()`` without a serialized copy of the whole model in memory."""
    if not model.HasField("graph"):
        return model.ByteSize()
    graph = _graph_size(model.graph)
    return without(model, ("graph",)).ByteSize() + len(protowire.field_head(protowire.MODEL_GRAPH, graph)) + graph


def write_model(f: BinaryIO, model: onnx.ModelProto, store: TensorStore | None = None) -> None:
    """Write ``model.SerializeToString()`` to ``f`` holding one node's or initializer's bytes at a time.

    With ``store``, the main graph's external initializers are written inline, copied from their
    file in chunks (never held whole); without, the model's tensors must be inline.
    """
    graph = model.graph
    streamed = store is not None
    # Protobuf writes fields in field-number order: ModelProto.graph is 7; GraphProto.node 1, initializer 5.
    before, after = _split_fields(without(model, ("graph",)).SerializeToString(), protowire.MODEL_GRAPH)
    graph_bytes = without(graph, ("node", "initializer")).SerializeToString()
    _, middle, rest = _split_fields(graph_bytes, 1, protowire.GRAPH_INITIALIZER)
    f.write(before + protowire.field_head(protowire.MODEL_GRAPH, _graph_size(graph, streamed)))
    for node in graph.node:
        f.write(protowire.field_head(1, node.ByteSize()) + node.SerializeToString())
    f.write(middle)
    for tensor in graph.initializer:
        if store is not None and tensor.data_location == _EXTERNAL:
            head, tail, length = _inline_parts(tensor)
            f.write(protowire.field_head(protowire.GRAPH_INITIALIZER, len(head) + length + len(tail)) + head)
            store.copy_to(tensor, f)
            f.write(tail)
        else:
            data = tensor.SerializeToString()
            f.write(protowire.field_head(protowire.GRAPH_INITIALIZER, len(data)))
            f.write(data)  # not joined to its head: that would be a second copy of a big tensor
            del data
    f.write(rest + after)


def _copy(src: BinaryIO, offset: int, length: int, write: Callable[[bytes], object], progress: Progress) -> None:
    """Pass ``length`` bytes of ``src`` from ``offset`` to ``write`` in chunks."""
    src.seek(offset)
    left = length
    while left:
        chunk = src.read(min(left, _COPY_CHUNK))
        if not chunk:
            raise ModelFileError(f"{src.name} ends before the tensor's {length} bytes at offset {offset}")
        write(chunk)
        progress.update(len(chunk))
        left -= len(chunk)


def _create(path: Path) -> BinaryIO:
    # os.open's mode goes through the umask, unlike mkstemp's fixed 0600.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    return os.fdopen(fd, "wb")


class OutputFiles:
    """``<out>`` and ``<out>.data`` written under temporary names in the output folder, renamed by ``commit``."""

    def __init__(self, output: str | os.PathLike, input_files: Sequence[str] = ()) -> None:
        self.out = Path(output)
        self.data_name = f"{self.out.name}.data"
        self.final_data = self.out.with_name(self.data_name)
        check_output(self.out, self.final_data, input_files)
        tag = f"{os.getpid()}.{id(self):x}"
        self.tmp_data = self.out.with_name(f".{self.data_name}.{tag}.tmp")
        self.tmp_model = self.out.with_name(f".{self.out.name}.{tag}.tmp")
        self._data: BinaryIO | None = None
        self._size = 0

    def __enter__(self) -> OutputFiles:
        try:
            self._data = _create(self.tmp_data)
        except OSError as e:
            raise ModelFileError(f"{self.out}: cannot write in folder {self.out.parent} ({e.strerror})") from e
        return self

    def __exit__(self, *exc: object) -> None:
        if self._data is not None:
            self._data.close()
        for tmp in (self.tmp_data, self.tmp_model):
            tmp.unlink(missing_ok=True)

    def append(self, data: bytes | memoryview) -> int:
        """Append ``data`` to the data file; its offset."""
        assert self._data is not None
        offset = self._size
        self._data.write(data)
        self._size += len(data)
        return offset

    def copy_from(self, src: BinaryIO, offset: int, length: int, progress: Progress) -> int:
        """Append ``length`` bytes of ``src`` from ``offset``, in chunks; the offset in the data file."""
        start = self._size
        _copy(src, offset, length, self.append, progress)
        return start

    def commit(
        self, model: onnx.ModelProto, store: TensorStore, *, external_data: bool = False, consume: bool = False
    ) -> bool:
        """Write ``model`` (with ``<out>.data`` when big or ``external_data``), rename into place; True if external.

        Without external data, ``model`` ends complete (its tensors read in), unless ``consume``
        (the caller drops it): then its initializers are copied from their files, never held.
        """
        assert self._data is not None
        external = external_data or model_size(model) + store.external_bytes(model) > EXTERNAL_DATA_THRESHOLD
        self._data.flush()
        stream = consume and not external
        if external:
            store.externalize(model)
        else:
            store.inline(model, graph_initializers=not stream)
        with _create(self.tmp_model) as f:
            write_model(f, model, store if stream else None)
        self._data.close()
        if external:
            os.replace(self.tmp_data, self.final_data)
        os.replace(self.tmp_model, self.out)
        return external


def _same(a: str | os.PathLike, b: str) -> bool:
    if os.path.realpath(a) == b:
        return True
    try:
        return os.path.exists(a) and os.path.samefile(a, b)
    except OSError:
        return False


def check_output(out: Path, data: Path, input_files: Sequence[str]) -> None:
    """Raise ModelFileError unless ``out`` (and its ``data`` file) can be written without touching an input file.

    ``input_files``: real paths, the input model first (as read_model gives them).
    """
    for path in (out, data):
        for i, used in enumerate(input_files):
            if not _same(path, used):
                continue
            if path == out and i == 0:
                raise ModelFileError(f"{out}: output path is the input file; choose another output path")
            what = "output path is" if path == out else "the output's data file is"
            raise ModelFileError(f"{path}: {what} a file the input model reads ({used}); choose another output path")
    if out.is_dir():
        raise ModelFileError(f"{out}: is a folder; give a file name for the output")
    if not out.parent.is_dir():
        raise ModelFileError(f"{out}: folder {out.parent} does not exist")
    if data.is_dir():
        raise ModelFileError(f"{data}: is a folder; the output's data file would go there")
