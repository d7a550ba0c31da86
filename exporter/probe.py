"""Running a model with chosen layers' INT4 weights (dequantized, in plain ORT) and comparing its outputs to FP32.

A *probe* copy of the model (``rewrite.probe_model``) reads every candidate layer's weight
from an overridable initializer: feeding a layer's dequantized INT4 weight there gives that
layer's exact INT4 weight error. ``Probe`` holds one ORT session of it, the calibration
batches, and the FP32 reference outputs (kept while they fit in ``REFERENCE_BYTES``, else
recomputed with each comparison), and counts its runs.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from ..ops.reference import dequantize
from .calibration import Calibration, Feeds, Part, batch_rows, collect, expose, rows_of
from .options import ExportOptions
from .quantize import QuantizedWeight
from .rewrite import Candidate, probe_model
from .subgraph import all_graphs

# Models above this go to ORT as a file with external data (protobuf cannot hold 2 GiB).
_IN_MEMORY_LIMIT = 1 << 30
# FP32 reference outputs kept across comparisons up to this size (an LLM's logits are 0.5 GB a window).
REFERENCE_BYTES = 512 << 20  # (as float16 where that is needed to fit and exact enough: see _compact)


def _rows(reference: Sequence[np.ndarray], outputs: Sequence[np.ndarray]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """float64 [rows, -1] views of each float output and its reference, a row per index of the first axis."""
    for ref, out in zip(reference, outputs, strict=True):
        ref, out = np.asarray(ref), np.asarray(out)
        if ref.dtype.kind != "f" or ref.size == 0:
            continue
        rows = 1 if ref.ndim < 2 else ref.shape[0]
        yield ref.astype(np.float64).reshape(rows, -1), out.astype(np.float64).reshape(rows, -1)


def row_cosines(reference: Sequence[np.ndarray], outputs: Sequence[np.ndarray]) -> np.ndarray:
    """Cosine similarity of every row (index of the first axis) of every float output with its reference."""
    found = []
    for r, o in _rows(reference, outputs):
        nr, no = np.linalg.norm(r, axis=1), np.linalg.norm(o, axis=1)
        # Two all-zero rows agree; one zero row against a non-zero one does not.
        both = nr * no
        cos = np.einsum("ij,ij->i", r, o) / np.where(both > 0, both, 1.0)
        found.append(np.where(both > 0, cos, (nr == 0) & (no == 0)))
    return np.concatenate(found) if found else np.ones(0)


def row_rel_l2(reference: Sequence[np.ndarray], outputs: Sequence[np.ndarray]) -> np.ndarray:
    """``||out - ref|| / ||ref||`` of every row (index of the first axis) of every float output."""
    found = []
    for r, o in _rows(reference, outputs):
        d, n = np.linalg.norm(o - r, axis=1), np.linalg.norm(r, axis=1)
        found.append(np.where(n > 0, d / np.where(n > 0, n, 1.0), np.where(d > 0, np.inf, 0.0)))
    return np.concatenate(found) if found else np.zeros(0)


def make_session(model: onnx.ModelProto, options: ort.SessionOptions) -> ort.InferenceSession:
    """A CPU session of ``model`` (through a temporary file with external data above 1 GiB); ``model`` is untouched."""
    if model.ByteSize() < _IN_MEMORY_LIMIT:
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    # Saving with external data moves the tensors out of the proto it is given: save a copy,
    # the caller's model (the user's, in export_mixed) must stay whole.
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    with tempfile.TemporaryDirectory(prefix="cim_int4_") as tmp:
        path = Path(tmp) / "model.onnx"
        onnx.save_model(copy, path, save_as_external_data=True, location="model.onnx.data", convert_attribute=True)
        del copy
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _compact(x: np.ndarray) -> np.ndarray:
    """A float32 output as float16 when that keeps it finite (a cosine near 1 moves by ~1e-7), else as it is."""
    if x.dtype != np.float32 or x.size == 0 or not np.all(np.abs(x) < 6e4):
        return x
    return x.astype(np.float16)


class Probe:
    """One probe session of ``model``: run it over the batches with some layers' INT4 weights, get row cosines."""

    def __init__(
        self, model: onnx.ModelProto, options: ExportOptions, batches: Sequence[Feeds], calibrate: bool = False
    ) -> None:
        probe, self.candidates = probe_model(model, options)
        self.outputs = [o.name for o in probe.graph.output]
        readers = {
            n.input[1]: (n.input[0], g is probe.graph)
            for g in all_graphs(probe.graph)
            for n in g.node
            if n.op_type == "MatMul" and len(n.input) == 2
        }
        # The tensor each candidate's product reads (after the export's Cast/Transpose, as the op will);
        # only those of the main graph can be graph outputs, so only their statistics are gathered.
        self.inputs = {c.key: readers[c.weight_name][0] for c in self.candidates}
        self.measured = {c.key for c in self.candidates if readers[c.weight_name][1]}
        if calibrate:
            expose(probe, dict.fromkeys(self.inputs[k] for k in self.measured))
        quiet = ort.SessionOptions()
        quiet.log_severity_level = 3  # ORT warns that overridable initializers are not constant-folded
        self.session = make_session(probe, quiet) if self.candidates else None
        del probe
        self.batches = list(batches)
        self.runs = 0
        self._reference: dict[int, list[np.ndarray]] | None = None
        self._compact = False
        self.model: onnx.ModelProto | None = None  # set by whoever needs the probed model back

    def _run(self, batch: Feeds, weights: Mapping[str, np.ndarray] | None = None) -> list[np.ndarray]:
        assert self.session is not None
        self.runs += 1
        return self.session.run(self.outputs, {**batch, **(weights or {})})

    def cosines(
        self, layers: Sequence[int], weights: Mapping[str, QuantizedWeight], parts: Sequence[Part] | None = None
    ) -> np.ndarray:
        """Each output row's cosine vs FP32 over the batches, ``layers`` in INT4 (``weights``), the rest FP32."""
        int4 = {}
        for i in layers:
            c = self.candidates[i]
            qw = weights[c.key]
            int4[c.weight_name] = dequantize(qw.packed, qw.scales, qw.k, qw.group_size).astype(np.float32)
        found = []
        for b, rows in [(b, None) for b in range(len(self.batches))] if parts is None else parts:
            reference, outputs = self.reference(b), self._run(self.batches[b], int4)
            if rows is not None:  # the rows of the first axis asked for, in every output that has them
                n = batch_rows(self.batches[b])
                reference, outputs = [rows_of(r, rows, n) for r in reference], [rows_of(o, rows, n) for o in outputs]
            found.append(row_cosines(reference, outputs))
        return np.concatenate(found) if found else np.ones(0)

    def reference(self, index: int) -> list[np.ndarray]:
        """The FP32 outputs of batch ``index`` (kept when those of every batch fit in REFERENCE_BYTES)."""
        if self._reference is not None and index in self._reference:
            return self._reference[index]
        outs = self._run(self.batches[index])
        self._keep(index, outs)
        return outs

    def _keep(self, index: int, outs: list[np.ndarray]) -> None:
        if self._reference is None:
            # As they are when all fit, else as float16 (an LLM's logits) when that fits, else not kept.
            size = sum(o.nbytes for o in outs) * len(self.batches)
            self._compact = size > REFERENCE_BYTES
            if size <= REFERENCE_BYTES or sum(_compact(o).nbytes for o in outs) * len(self.batches) <= REFERENCE_BYTES:
                self._reference = {}
        if self._reference is not None:
            self._reference[index] = [_compact(o) for o in outs] if self._compact else outs

    def calibrate(self, held: Sequence[Part]) -> tuple[Calibration, Calibration | None]:
        """``calibration.collect`` over the batches for every candidate's input; the FP32 outputs are kept too."""
        assert self.session is not None
        tensors = {self.inputs[c.key]: c.w.shape[0] for c in self.candidates if c.key in self.measured}
        self.runs += len(self.batches)
        return collect(self.session, tensors, self.batches, held, self.outputs, self._keep)

    def share_reference(self, other: Probe) -> None:
        """Use ``other``'s kept FP32 outputs (the same function, e.g. a model with AWQ scales folded in)."""
        self._reference, self._compact = other._reference, other._compact


__all__ = ["REFERENCE_BYTES", "Candidate", "Probe", "make_session", "row_cosines", "row_rel_l2"]
