"""The protobuf wire format, as far as the lazy model reader and writer walk it (no schema, no copies).

Field numbers are the ONNX schema's (onnx/onnx.proto). ``Malformed`` is raised for bytes that
are not a well-formed message; the callers turn it into a one-line error naming the file.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator

MODEL_GRAPH, GRAPH_INITIALIZER, TENSOR_RAW_DATA = 7, 5, 9


class Malformed(Exception):
    pass


def varint(buf: mmap.mmap | bytes, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise Malformed
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def fields(buf: mmap.mmap | bytes, pos: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(field number, start of the field, start of its value, end) of each field of a protobuf message."""
    while pos < end:
        start = pos
        key, pos = varint(buf, pos, end)
        wire = key & 7
        if wire == 0:
            value, (_, stop) = pos, varint(buf, pos, end)
        elif wire == 1:
            value, stop = pos, pos + 8
        elif wire == 2:
            size, value = varint(buf, pos, end)
            stop = value + size
        elif wire == 5:
            value, stop = pos, pos + 4
        else:
            raise Malformed
        if stop > end or key >> 3 == 0:
            raise Malformed
        yield key >> 3, start, value, stop
        pos = stop


def field_head(field: int, size: int) -> bytes:
    """Key and length of a length-delimited field."""
    out = bytearray()
    for value in ((field << 3) | 2, size):
        while value >= 0x80:
            out.append((value & 0x7F) | 0x80)
            value >>= 7
        out.append(value)
    return bytes(out)


def field_bytes(field: int, payload: bytes) -> bytes:
    return field_head(field, len(payload)) + payload
