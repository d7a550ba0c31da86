"""The probe: a session of the probe model (``exporter.probe_model``), run with some layers' INT4 weights.

``Probe`` holds one ORT session of a probe model, the calibration batches, and the FP32
reference outputs (a ``ReferenceStore``: in memory while small, else in a temporary folder;
recomputed with each comparison when even that is too big), and counts its runs. With
``calibrate=True`` every candidate's input tensor is also a graph output, for the
calibration pass (``exporter.calibration``). In a streamed export the FP32 weights are mapped
from a temporary file (``exporter.weightfile``), so that a run with many layers dequantized
holds one copy of the weights, not two.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import numpy as np
import onnx
import onnxruntime as ort

from ..contract import unpack
from ..metrics import row_cosines
from ..ops.ort_model import proto_session
from .calibration import Calibration, Feeds, Part, batch_rows, collect, expose, rows_of
from .memory import ReferenceStore, release_memory
from .options import ExportOptions
from .probe_model import Candidate, probe_model
from .quantize import QuantizedWeight
from .subgraph import all_graphs
from .weightfile import WeightFile, map_weights
from .writer import TensorStore

# A streamed export's probe weights past this size are mapped from a temporary file (exporter.weightfile),
# and a run that quantizes more than this of them first drops the FP32 pages from the process.
MAP_WEIGHTS_BYTES = 64 << 20


class WeightFeeding:
    """A probe session that feeds every candidate's FP32 weight (a graph input) unless the feeds override it.

    The weights stay in the candidates' arrays, handed to ORT per run without a copy: the probe
    model holds none, so there is one copy of the weights instead of three (model, proto, session).
    """

    def __init__(self, session: ort.InferenceSession, weights: Mapping[str, np.ndarray]) -> None:
        self.session, self.weights = session, weights

    def run(self, outputs: Sequence[str] | None, feeds: Mapping[str, object]) -> list:
        """``InferenceSession.run`` with the FP32 weights under ``feeds``."""
        return self.session.run(outputs, {**self.weights, **feeds})

    def get_inputs(self) -> list:
        """The session's inputs."""
        return self.session.get_inputs()


def _feeds_of(c: Candidate, qw: QuantizedWeight, codes: bool = True, tables: bool = True) -> dict[str, np.ndarray]:
    """What a run feeds to give candidate ``c`` the weight ``qw``: its codes (``Codes``) if asked and possible,
    else its float32 weight; with ``tables``, the tied embedding tables that read ``c``'s weight its float32 weight
    too (the export gives such a table the layer's codes)."""
    k, n = c.w.shape
    tied = c.tables if tables else ()
    w = weight32(qw) if tied else None
    fed = _table_feeds(tied, w) if w is not None else {}
    if not codes or c.codes is None or qw.group_size != c.codes.group_size or (qw.k, qw.n) != (k, n):
        return {c.weight_name: weight32(qw) if w is None else w, **fed}
    return {  # K is whole groups here (``Codes``): no padding to cut
        c.codes.select: np.array(True),
        c.codes.q: np.ascontiguousarray(unpack(qw.packed, qw.bits, qw.grid).T),  # [K, N] int8
        c.codes.scales: np.ascontiguousarray(qw.scales.astype(np.float32).T[:, None, :]),  # [G, 1, N]
        **fed,
    }


def _table_feeds(tables: Sequence[tuple[str, bool]], w: np.ndarray) -> dict[str, np.ndarray]:
    """Each tied table's feed of weight ``w`` [K, N]: ``w`` itself, or a contiguous ``w.T`` where it is transposed."""
    t = np.ascontiguousarray(w.T) if any(transposed for _, transposed in tables) else None
    return {name: t if transposed else w for name, transposed in tables}


def weight32(qw: QuantizedWeight) -> np.ndarray:
    """``ops.reference.dequantize(...)`` rounded to float32, computed in float32 (the same bits: a code times a
    scale is exact in float64, so its one rounding is float32's multiply), without float64 temporaries."""
    w = unpack(qw.packed, qw.bits, qw.grid).astype(np.float32)  # [N, K_padded]
    w *= np.repeat(qw.scales.astype(np.float32), qw.group_size, axis=1)
    return np.ascontiguousarray(w[:, : qw.k].T)


class Probe:
    """One probe session of ``model``: run it over the batches with some layers' INT4 weights, get row cosines."""

    def __init__(
        self,
        model: onnx.ModelProto,
        options: ExportOptions,
        batches: Sequence[Feeds],
        calibrate: bool = False,
        tensors: TensorStore | None = None,
    ) -> None:
        probe, self.candidates = probe_model(model, options, tensors)
        # A tied embedding table takes its head's codes in the export unless the embedding stays FP32: runs
        # that quantize the head feed the table the same weight (its error reaches the logits twice).
        self.tied_tables = not options.keep_embedding
        self.outputs = [o.name for o in probe.graph.output]
        readers = {
            n.input[1]: n.input[0]
            for g in all_graphs(probe.graph)
            for n in g.node
            if n.op_type == "MatMul" and len(n.input) == 2
        }
        # The tensor each candidate's product reads (after the export's Cast/Transpose, as the op will);
        # only those of the main graph can be graph outputs, so only their statistics are gathered.
        self.inputs = {c.key: readers[c.weight_name] for c in self.candidates}
        # A product of the main graph: its If reads the select input there, or its MatMul the weight (unique names).
        read = {i for n in probe.graph.node for i in n.input}
        self.measured = {c.key for c in self.candidates if (c.codes.select if c.codes else c.weight_name) in read}
        if calibrate:
            expose(probe, dict.fromkeys(self.inputs[k] for k in self.measured))
        self._weight_file: WeightFile | None = None
        if tensors is not None and sum(c.w.nbytes for c in self.candidates) > MAP_WEIGHTS_BYTES:
            self._weight_file = map_weights([c.w for c in self.candidates])
            if self._weight_file is not None:  # the arrays in memory go now (release_memory below)
                arrays = self._weight_file.arrays
                self.candidates = [replace(c, w=arrays[i]) for i, c in enumerate(self.candidates)]
        quiet = ort.SessionOptions()
        quiet.log_severity_level = 3
        # No arena: it would keep the largest run's activations (an LLM's attention and logits) for good.
        quiet.enable_cpu_mem_arena = False
        # Nor one block planned for all of a run's intermediates: measured on a 0.1B LLM, a run's peak
        # is ~120 MB lower without it, and no slower (a one-layer comparison 3.2-3.9 s either way).
        quiet.enable_mem_pattern = False
        weights = {name: c.w for c in self.candidates for name in (c.weight_name, *c.also)}
        for c in self.candidates:  # a table held transposed: its FP32 feed is a copy (the probe model has none)
            weights.update({n: np.ascontiguousarray(c.w.T) for n, transposed in c.tables if transposed})
        self.session = WeightFeeding(proto_session(probe, quiet), weights) if self.candidates else None
        del probe
        release_memory()
        self.batches = list(batches)
        self.runs = 0
        self._reference: ReferenceStore | None = None
        self._too_big = False  # the FP32 outputs do not fit REFERENCE_BYTES: run again when asked for
        self.keep_reference = True  # False: FP32 outputs are run again when asked for (when used once)
        self.model: onnx.ModelProto | None = None  # set by whoever needs the probed model back

    def _run(
        self, batch: Feeds, weights: Mapping[str, np.ndarray] | None = None, outputs: Sequence[str] | None = None
    ) -> list[np.ndarray]:
        assert self.session is not None
        self.runs += 1
        return self.session.run(self.outputs if outputs is None else outputs, {**batch, **(weights or {})})

    def cosines(
        self,
        layers: Sequence[int],
        weights: Mapping[str, QuantizedWeight],
        parts: Sequence[Part] | None = None,
        scored: Sequence[int] | None = None,
    ) -> np.ndarray:
        """Each output row's cosine vs FP32 over the batches, ``layers`` in INT4 (``weights``), the rest FP32.

        ``scored``: the indices of the outputs compared (default: every output).
        """
        return self.compared(layers, weights, row_cosines, parts, scored)

    def compared(
        self,
        layers: Sequence[int],
        weights: Mapping[str, QuantizedWeight],
        measure: Callable[[Sequence[np.ndarray], Sequence[np.ndarray]], np.ndarray],
        parts: Sequence[Part] | None = None,
        scored: Sequence[int] | None = None,
    ) -> np.ndarray:
        """``measure(reference, outputs)`` of each batch, concatenated; ``layers`` in INT4 as in ``cosines``."""
        int4 = {}
        codes = len(layers) > 1  # one layer: its float32 weight (ORT's in-graph dequantization holds two copies)
        for i in layers:
            int4.update(_feeds_of(self.candidates[i], weights[self.candidates[i].key], codes, self.tied_tables))
        if self._weight_file is not None and sum(self.candidates[i].w.nbytes for i in layers) > MAP_WEIGHTS_BYTES:
            self._weight_file.evict()  # the run reads back only the FP32 weights it is fed
            release_memory()  # and finds no heap the earlier runs left free but resident
        found = []
        names = self.outputs if scored is None else [self.outputs[i] for i in scored]  # only those are fetched
        for b, rows in [(b, None) for b in range(len(self.batches))] if parts is None else parts:
            reference = self.reference(b)
            if scored is not None:
                reference = [reference[i] for i in scored]
            outputs = self._run(self.batches[b], int4, names)
            if rows is not None:  # the rows of the first axis asked for, in every output that has them
                n = batch_rows(self.batches[b])
                reference, outputs = [rows_of(r, rows, n) for r in reference], [rows_of(o, rows, n) for o in outputs]
            found.append(measure(reference, outputs))
            del reference, outputs  # not alive beside the next batch's (an LLM's logits: 100 MB and more each)
        return np.concatenate(found) if found else np.ones(0)

    def reference(self, index: int) -> list[np.ndarray]:
        """The FP32 outputs of batch ``index`` (kept when those of every batch fit REFERENCE_BYTES)."""
        kept = self._reference.get(index) if self._reference is not None else None
        if kept is not None:
            return kept
        outs = self._run(self.batches[index])
        self._keep(index, outs)
        return outs

    def _keep(self, index: int, outs: list[np.ndarray]) -> None:
        if not self.keep_reference or self._too_big:
            return
        if self._reference is None:
            try:
                self._reference = ReferenceStore.for_outputs(len(self.batches), outs)
            except OSError:  # no temporary folder: run them again when asked for
                self._reference = None
            if self._reference is None:
                self._too_big = True
                return
        if not self._reference.put(index, outs):
            self._too_big = True  # the disk is full: keep no more (those kept stay usable)

    def calibrate(self, held: Sequence[Part]) -> tuple[Calibration, Calibration | None]:
        """``calibration.collect`` over the batches for every candidate's input; the FP32 outputs kept too, if asked."""
        assert self.session is not None
        tensors = {self.inputs[c.key]: c.w.shape[0] for c in self.candidates if c.key in self.measured}
        self.runs += len(self.batches)
        # Not kept: not fetched either (an LLM's logits and KV cache would be made and dropped every run).
        outputs = self.outputs if self.keep_reference else []
        found = collect(self.session, tensors, self.batches, held, outputs, self._keep)
        release_memory()
        return found

    def input_power(self) -> dict[str, np.ndarray]:
        """Candidate key -> ``E[x_k^2]`` per input channel over the batches (``calibrate=True``; main graph only).

        One run per batch, which also keeps the FP32 outputs; float64 sums, one batch's inputs alive at a time.
        """
        assert self.session is not None
        names = list(dict.fromkeys(self.inputs[c.key] for c in self.candidates if c.key in self.measured))
        sums: dict[str, np.ndarray] = {}
        counts = dict.fromkeys(names, 0)
        known = {i.name for i in self.session.get_inputs()}
        for b, batch in enumerate(self.batches):
            self.runs += 1
            values = self.session.run([*self.outputs, *names], {k: v for k, v in batch.items() if k in known})
            self._keep(b, values[: len(self.outputs)])
            for name, x in zip(names, values[len(self.outputs) :], strict=True):
                rows = np.nan_to_num(x.reshape(-1, x.shape[-1]).astype(np.float64), posinf=0.0, neginf=0.0)
                sums[name] = sums.get(name, 0) + np.einsum("rk,rk->k", rows, rows)
                counts[name] += rows.shape[0]
            del values
        return {
            c.key: sums[self.inputs[c.key]] / max(counts[self.inputs[c.key]], 1)
            for c in self.candidates
            if c.key in self.measured
        }

    def release_session(self) -> None:
        """Drop the session (its copy of the weights) when the FP32 outputs of every batch are kept."""
        if self._holds_every_reference():
            self.session = None

    def _holds_every_reference(self) -> bool:
        return self._reference is not None and len(self._reference) == len(self.batches)

    def drop_weights(self) -> bool:
        """Free the FP32 weights (candidates and session) once every batch's FP32 outputs are kept; say if done.

        The outputs not kept yet are run now and kept (on disk when large, ``ReferenceStore``), so
        that the exported model's check needs no FP32 run. False, and nothing dropped, when they do not
        fit ``REFERENCE_BYTES`` or the disk: the check then runs them again in this probe.
        """
        if self.session is None or not self.candidates:
            return self._holds_every_reference()
        self.keep_reference = True
        for i in range(len(self.batches)):
            if self._too_big:
                return False
            if self._reference is None or i not in self._reference:
                self.reference(i)
        if not self._holds_every_reference():
            if self._weight_file is not None:  # kept for the check's reruns, but off the resident set meanwhile
                self._weight_file.evict()
            return False
        self.session, self.candidates, self._weight_file = None, [], None
        release_memory()
        return True

    def share_reference(self, other: Probe) -> None:
        """Use ``other``'s kept FP32 outputs (the same function, e.g. a model with AWQ scales folded in)."""
        self._reference, self._too_big = other._reference, other._too_big
