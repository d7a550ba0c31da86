"""Request bodies of ``/v1/infer`` to feeds and back, checked against the model's inputs; batching by rows.

A body is JSON (``{"inputs": {name: nested lists}}``, answered with ``{"outputs": ...}``) or
an ``.npz`` archive (answered with one). Every problem is a ``RequestError`` whose one-line
message names the input and what was expected. Batching concatenates requests along axis 0
(the batch/row dimension) when everything else about their inputs is equal.
"""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

# ORT's input type names for the element types a request may carry.
ORT_DTYPES = {
    "tensor(float)": np.float32,
    "tensor(double)": np.float64,
    "tensor(float16)": np.float16,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int16)": np.int16,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
}
NPZ_MEDIA_TYPE = "application/x-npz"
DEFAULT_MAX_BODY = 64 << 20
# JSON number kinds (as NumPy reads them) accepted for each element kind of an input.
JSON_KINDS = {"f": "fiu", "i": "iu", "u": "iu", "b": "b"}


class RequestError(ValueError):
    """A bad request: ``status`` is the HTTP code, the message one line for the client."""

    status = 400


class BodyTooLarge(RequestError):
    """The body is over the configured limit."""

    status = 413


@dataclass(frozen=True)
class InputSpec:
    """One model input: element type and shape (None for a symbolic dimension)."""

    name: str
    dtype: np.dtype
    shape: tuple[int | None, ...]

    @property
    def batchable(self) -> bool:
        """Whether axis 0 is symbolic, so requests can be concatenated along it."""
        return len(self.shape) >= 1 and self.shape[0] is None

    def describe(self) -> str:
        dims = ", ".join("?" if d is None else str(d) for d in self.shape)
        return f"{self.dtype.name} [{dims}]"


def input_specs(session) -> dict[str, InputSpec]:  # noqa: ANN001 - an onnxruntime.InferenceSession
    """The inputs of an ORT session as InputSpecs; refuses element types a request cannot carry."""
    specs = {}
    for arg in session.get_inputs():
        if arg.type not in ORT_DTYPES:
            raise ValueError(f"input {arg.name!r}: element type {arg.type} cannot be served")
        shape = tuple(d if isinstance(d, int) and d >= 0 else None for d in arg.shape)
        specs[arg.name] = InputSpec(arg.name, np.dtype(ORT_DTYPES[arg.type]), shape)
    return specs


def check_size(length: int, limit: int) -> None:
    """Refuse a body of ``length`` bytes over ``limit``."""
    if length > limit:
        raise BodyTooLarge(f"request body is {length} bytes; the limit is {limit}")


def is_npz(body: bytes, content_type: str) -> bool:
    """Whether a body is an .npz archive (by media type, or by its zip signature)."""
    return "npz" in content_type or "octet-stream" in content_type or body[:2] == b"PK"


def _from_json_value(value: object, spec: InputSpec) -> np.ndarray:
    try:
        raw = np.asarray(value)
    except ValueError as e:  # ragged nesting
        raise RequestError(f"input {spec.name!r}: not a rectangular nested list ({e})") from None
    if raw.size and raw.dtype.kind not in JSON_KINDS[spec.dtype.kind]:
        found = "text" if raw.dtype.kind in "US" else "mixed or nested values" if raw.dtype.kind == "O" else raw.dtype
        raise RequestError(f"input {spec.name!r}: expected {spec.dtype.name} values, got {found}")
    array = raw.astype(spec.dtype)
    if spec.dtype.kind in "iu" and raw.dtype.kind in "iu" and not np.array_equal(array, raw):
        raise RequestError(f"input {spec.name!r}: values out of range for {spec.dtype.name}")
    return array


def load_json(body: bytes) -> object:
    """The JSON document of a body; RequestError if it is not JSON."""
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(f"body is not valid JSON ({' '.join(str(e).split())})") from None


def parse_json(body: bytes, specs: Mapping[str, InputSpec]) -> dict[str, np.ndarray]:
    """Feeds from a JSON body ``{"inputs": {name: nested lists}}``, cast to each input's element type."""
    doc = load_json(body)
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), dict):
        raise RequestError('body must be a JSON object {"inputs": {name: nested lists}}')
    unknown(doc["inputs"], specs)
    return {name: _from_json_value(value, specs[name]) for name, value in doc["inputs"].items()}


def parse_npz(body: bytes, specs: Mapping[str, InputSpec]) -> dict[str, np.ndarray]:
    """Feeds from an .npz body (arrays named by input); element types must match the model's exactly."""
    try:
        with np.load(io.BytesIO(body), allow_pickle=False) as archive:
            unknown(archive.files, specs)
            feeds = {name: archive[name] for name in archive.files}
    except RequestError:
        raise
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, KeyError) as e:
        raise RequestError(f"body is not a valid .npz archive ({' '.join(str(e).split())})") from None
    for name, array in feeds.items():
        if array.dtype != specs[name].dtype:
            raise RequestError(f"input {name!r}: expected {specs[name].dtype.name}, got {array.dtype.name}")
    return feeds


def unknown(names: object, specs: Mapping[str, InputSpec]) -> None:
    """Refuse names that are not inputs of the model."""
    for name in names:  # type: ignore[attr-defined]
        if name not in specs:
            raise RequestError(f"input {name!r}: not an input of the model (inputs: {', '.join(specs)})")


def check_feeds(feeds: Mapping[str, np.ndarray], specs: Mapping[str, InputSpec]) -> None:
    """Every input present once, with the model's rank and fixed dimensions (and >= 1 row when batched)."""
    unknown(feeds, specs)
    for name, spec in specs.items():
        if name not in feeds:
            raise RequestError(f"input {name!r}: missing (expected {spec.describe()})")
        shape = feeds[name].shape
        fixed = all(d is None or d == s for d, s in zip(spec.shape, shape, strict=False))
        if len(shape) != len(spec.shape) or not fixed or (spec.batchable and shape[0] == 0):
            raise RequestError(f"input {name!r}: expected shape {spec.describe()}, got {list(shape)}")


def parse_request(body: bytes, content_type: str, specs: Mapping[str, InputSpec]) -> tuple[dict[str, np.ndarray], bool]:
    """Checked feeds of a request body and whether it was an .npz (else JSON)."""
    npz = is_npz(body, content_type)
    feeds = parse_npz(body, specs) if npz else parse_json(body, specs)
    check_feeds(feeds, specs)
    return feeds, npz


def encode_outputs(names: Sequence[str], arrays: Sequence[np.ndarray], npz: bool) -> tuple[bytes, str]:
    """A response body (and its media type) for the outputs: .npz if the request was one, else JSON."""
    if npz:
        buffer = io.BytesIO()
        np.savez(buffer, **dict(zip(names, arrays, strict=True)))
        return buffer.getvalue(), NPZ_MEDIA_TYPE
    doc = {"outputs": {name: array.tolist() for name, array in zip(names, arrays, strict=True)}}
    return json.dumps(doc).encode(), "application/json"


def batch_key(feeds: Mapping[str, np.ndarray]) -> tuple:
    """Requests with equal keys differ only in their row counts and can run as one call."""
    return tuple(sorted((name, a.dtype.str, a.shape[1:]) for name, a in feeds.items()))


def rows(feeds: Mapping[str, np.ndarray]) -> int:
    """The request's row count (axis 0 of its first input)."""
    return next(iter(feeds.values())).shape[0]


def concat(requests: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One feed dict with each input's requests stacked along axis 0."""
    return {name: np.concatenate([r[name] for r in requests]) for name in requests[0]}


def split(outputs: Sequence[np.ndarray], sizes: Sequence[int]) -> list[list[np.ndarray]] | None:
    """Each request's share of the outputs of a concatenated run; None if an output is not row-major in the batch."""
    total = sum(sizes)
    if any(o.ndim == 0 or o.shape[0] != total for o in outputs):
        return None
    cuts = np.cumsum(sizes)[:-1]
    parts = [np.split(o, cuts) for o in outputs]
    return [[p[i] for p in parts] for i in range(len(sizes))]
