"""The probe: the export's rewrite with ``x @ W`` in place of CimInt4MatMul, W fed per run; and a session of it.

``Probe`` holds one ORT session of a probe model, the calibration batches, and the FP32
reference outputs (a ``ReferenceStore``: in memory while small, else in a temporary folder;
recomputed with each comparison when even that is too big), and counts its runs. With
``calibrate=True`` every candidate's input tensor is also a graph output, for the
calibration pass (``exporter.calibration``). In a streamed export the FP32 weights are mapped
from a temporary file (``exporter.weightfile``), so that a run with many layers dequantized
holds one copy of the weights, not two.
"""

from __future__ import annotations

import ctypes
import gc
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from google.protobuf.message import Message
from onnx import helper, numpy_helper

from ..contract import unpack
from ..metrics import row_cosines
from ..ops.ort_model import proto_session
from ..ops.reference import dequantize
from .calibration import Calibration, Feeds, Part, batch_rows, collect, expose, rows_of
from .operands import Plan
from .options import ExportOptions
from .quantize import QuantizedWeight
from .rewrite import Rewriter, run_rewrite
from .subgraph import all_graphs
from .weightfile import WeightFile, map_weights
from .writer import TensorStore

# Probe weights are named from this prefix.
PROBE_PREFIX = "cim_int4.probe."
# FP32 reference outputs of all batches are kept across comparisons up to this size (float32;
# an LLM's logits are 0.1-0.5 GB a window): in memory up to REFERENCE_RAM_BYTES, else on disk.
REFERENCE_BYTES = 4 << 30
REFERENCE_RAM_BYTES = 64 << 20
# Over this size (float32) they are kept as float16 where that stays finite.
REFERENCE_COMPACT_BYTES = 512 << 20
# A streamed export's probe weights past this size are mapped from a temporary file (exporter.weightfile),
# and a run feeding more than this in dequantized weights first drops the FP32 pages from the process.
MAP_WEIGHTS_BYTES = 64 << 20


@dataclass(frozen=True)
class Candidate:
    """An eligible MatMul/Gemm of a probe model: its key, probe weight name, weight [K, N] and bias [N] (or None)."""

    key: str  # subgraph path + label, as in the summary; unique in the model
    weight_name: str
    w: np.ndarray
    bias: np.ndarray | None
    also: tuple[str, ...] = ()  # other graph inputs fed with ``w`` (a tied embedding table's initializer)
    sources: tuple[str, ...] = ()  # the names the weight was read through
    name: str = ""  # the node's own name (its output's when unnamed), which a ``bits`` mapping also matches
    codes: Codes | None = None  # the inputs that make the product dequantize in the graph (None: feed W only)
    product: str = ""  # the product's output (before a bias Add)


@dataclass(frozen=True)
class Codes:
    """Inputs of a probe product that dequantizes in ORT: ``x @ reshape(q [G, gs, N] * scales [G, 1, N], [K, N])``.

    ``select`` (bool, default False) picks that branch of an If around the product; ``q`` (int8
    [K, N], default empty) holds the signed codes and ``scales`` (float32 [K / gs, 1, N]) the group
    scales. Fed a layer's codes (1 byte a weight), a run holds no float32 copy of its weight: ORT makes
    one for the node and frees it, so a run with every layer quantized holds a quarter of the bytes.
    The product is the float32 rounding of ``q * scale``, as ``ops.reference.dequantize`` gives.
    """

    select: str
    q: str
    scales: str
    group_size: int


class ProbeRewriter(Rewriter):
    """Emits ``MatMul(x, W) [+ bias]`` where the export writes CimInt4MatMul, W a main-graph input per node."""

    quantizes_tables = False  # the probe measures MatMuls only; embeddings stay as they are

    def __init__(self, model: onnx.ModelProto, options: ExportOptions, tensors: _Originals | None = None) -> None:
        super().__init__(model, options, tensors=tensors)
        self.candidates: list[Candidate] = []
        self.probe_weights: list[onnx.ValueInfoProto] = []  # graph inputs, fed the candidates' arrays
        self.probe_defaults: list[onnx.TensorProto] = []  # the defaults of the inputs of ``Codes``

    def core(
        self,
        base: str,
        key: str,
        x: str,
        out: str,
        plan: Plan,
        initializers: list[onnx.TensorProto],
        table: object = None,
    ) -> tuple[list[onnx.NodeProto], int | None]:
        index = len(self.candidates)
        w_name = self.fresh(f"{PROBE_PREFIX}{index}.weight")
        w = np.ascontiguousarray(plan.w, dtype=np.float32)
        self.probe_weights.append(helper.make_tensor_value_info(w_name, onnx.TensorProto.FLOAT, list(w.shape)))
        product = out if plan.bias is None else self.fresh(f"{out}/matmul")
        codes = self._codes(index, w.shape) if self.opset >= 11 else None
        if codes is None:
            node = helper.make_node("MatMul", [x, w_name], [product], name=base)
        else:
            node = self._select(codes, x, w_name, w.shape, product, base)
        self.candidates.append(
            Candidate(key, w_name, w, plan.bias, sources=tuple(plan.sources), name=base, codes=codes, product=product)
        )
        if plan.bias is None:
            return [node], None
        b_name = self.fresh(f"{w_name[: -len('weight')]}bias")
        initializers.append(numpy_helper.from_array(plan.bias, b_name))
        return [node, helper.make_node("Add", [product, b_name], [out], name=f"{base}/bias")], None

    def _codes(self, index: int, shape: tuple[int, ...]) -> Codes | None:
        """A candidate's ``Codes`` inputs (main-graph inputs with empty defaults); None when K is not whole groups."""
        k, n = shape
        gs = self.options.group_size
        if k % gs:
            return None  # the padded codes would need a Slice: such a layer is fed its float32 weight
        codes = Codes(*(self.fresh(f"{PROBE_PREFIX}{index}.{part}") for part in ("dequantize", "codes", "scales")), gs)
        T = onnx.TensorProto
        self.probe_weights += [
            helper.make_tensor_value_info(codes.select, T.BOOL, []),
            helper.make_tensor_value_info(codes.q, T.INT8, [None, None]),
            helper.make_tensor_value_info(codes.scales, T.FLOAT, [None, None, None]),
        ]
        self.probe_defaults += [
            numpy_helper.from_array(np.array(False), codes.select),
            numpy_helper.from_array(np.zeros((0, 0), np.int8), codes.q),
            numpy_helper.from_array(np.zeros((0, 0, 0), np.float32), codes.scales),
        ]
        return codes

    def _select(
        self, codes: Codes, x: str, w_name: str, shape: tuple[int, ...], product: str, base: str
    ) -> onnx.NodeProto:
        """``If(select)``: then ``x @ dequantized codes``, else ``x @ W``; the dequantized W lives in the node only."""
        k, n = shape
        T = onnx.TensorProto
        grouped, flat, qf, q3, w3, w, y, yw = (
            self.fresh(f"{product}/{part}") for part in ("grouped", "flat", "qf", "q3", "w3", "w", "y", "yw")
        )
        gs = codes.group_size
        shapes = [numpy_helper.from_array(np.array(dims, np.int64)) for dims in ([k // gs, gs, n], [k, n])]
        then = helper.make_graph(
            [
                helper.make_node("Constant", [], [grouped], value=shapes[0]),
                helper.make_node("Constant", [], [flat], value=shapes[1]),
                helper.make_node("Cast", [codes.q], [qf], to=T.FLOAT),
                helper.make_node("Reshape", [qf, grouped], [q3]),
                helper.make_node("Mul", [q3, codes.scales], [w3]),
                helper.make_node("Reshape", [w3, flat], [w]),
                helper.make_node("MatMul", [x, w], [y]),
            ],
            f"{base}/dequantized",
            [],
            [helper.make_tensor_value_info(y, T.FLOAT, None)],
        )
        fp32 = [helper.make_node("MatMul", [x, w_name], [yw])]
        other = helper.make_graph(fp32, f"{base}/fp32", [], [helper.make_tensor_value_info(yw, T.FLOAT, None)])
        return helper.make_node("If", [codes.select], [product], name=base, then_branch=then, else_branch=other)


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


class _Originals:
    """The main-graph initializers of the model being probed, read by name from it (no copy of their bytes).

    With ``store`` (the model's weights left in their files, exporter.writer) they are read from there.
    """

    def __init__(self, model: onnx.ModelProto, store: TensorStore | None = None) -> None:
        self.tensors = {t.name: t for t in model.graph.initializer}
        self.store = store

    def read(self, tensor: onnx.TensorProto) -> np.ndarray:
        """The values of the original of ``tensor`` (a stub of the same name, or a tensor of a subgraph)."""
        original = self.tensors.get(tensor.name)
        source = original if original is not None and not tensor.raw_data else tensor
        return self.store.read(source) if self.store is not None else numpy_helper.to_array(source)

    def write(self, tensor: onnx.TensorProto) -> None:
        """Nothing to do: the probe writes no attribute tensors."""

    def fill(self, model: onnx.ModelProto) -> None:
        """Give the stubs left in ``model`` (initializers the probe still reads: norms, tables) their data.

        From a ``store``, every tensor still in a file (subgraphs' too) is read into the proto.
        """
        for t in model.graph.initializer:
            if t.name in self.tensors and _is_stub(t):
                t.CopyFrom(self.tensors[t.name])
        if self.store is not None:
            self.store.inline(model)


def _is_stub(t: onnx.TensorProto) -> bool:
    return not t.raw_data and t.data_location != onnx.TensorProto.EXTERNAL and not any(
        (t.float_data, t.int32_data, t.int64_data, t.double_data, t.uint64_data, t.string_data)
    )


def _copy_fields(src: Message, dst: Message, skip: str) -> None:
    """Copy every set field of ``src`` but ``skip`` into ``dst``."""
    for desc, value in src.ListFields():
        if desc.name == skip:
            continue
        if desc.is_repeated:
            getattr(dst, desc.name).extend(value)
        elif desc.message_type is not None:
            getattr(dst, desc.name).CopyFrom(value)
        else:
            setattr(dst, desc.name, value)


def _hollow(model: onnx.ModelProto, store: TensorStore | None = None) -> tuple[onnx.ModelProto, _Originals]:
    """A copy of ``model`` whose main-graph initializers are stubs (name, type, dims), and the originals' reader.

    The rewrite reads the weights it folds from the originals; run_rewrite's own copy then
    copies no weight bytes.
    """
    originals = _Originals(model, store)
    hollow = onnx.ModelProto()
    _copy_fields(model, hollow, skip="graph")
    _copy_fields(model.graph, hollow.graph, skip="initializer")
    hollow.graph.initializer.extend(
        onnx.TensorProto(name=t.name, data_type=t.data_type, dims=t.dims) for t in model.graph.initializer
    )
    return hollow, originals


def probe_model(
    model: onnx.ModelProto, options: ExportOptions, tensors: TensorStore | None = None
) -> tuple[onnx.ModelProto, list[Candidate]]:
    """A copy of ``model`` in which each eligible node computes ``x @ W (+ bias)`` with W overridable, and the nodes.

    Around each product are the same Casts, Transpose, Unsqueeze and Add the export writes, so
    feeding a node's dequantized INT4 weight at ``Candidate.weight_name`` gives its INT4 error.
    The weights are graph inputs without initializers: a session of the probe is fed the
    candidates' arrays (``WeightFeeding``), and an initializer other nodes still read that equals
    a candidate's weight (a tied embedding table) is an input fed the same array (``Candidate.also``).
    With ``tensors`` (``model``'s weights in their files) each weight is read from there once.
    """
    hollow, originals = _hollow(model, tensors)
    out, rewriter = run_rewrite(hollow, options, lambda m: ProbeRewriter(m, options, originals))
    del hollow
    assert isinstance(rewriter, ProbeRewriter)
    out.graph.input.extend(rewriter.probe_weights)
    candidates = _share_weights(out.graph, rewriter.candidates, originals)
    out.graph.initializer.extend(rewriter.probe_defaults)  # after _share_weights: none of them is a weight
    originals.fill(out)
    return out, candidates


def _share_weights(graph: onnx.GraphProto, candidates: list[Candidate], originals: _Originals) -> list[Candidate]:
    """Turn an initializer still read by other nodes that equals a candidate's weight into an input fed with it.

    A tied LM head's weight is also the embedding table (behind a Transpose): without this the
    session would hold a second FP32 copy of the largest tensor of the model.
    """
    by_source = {c.sources[0]: i for i, c in enumerate(candidates) if len(c.sources) == 1}
    inputs = {i.name for i in graph.input}
    kept, shared = [], {}
    for t in graph.initializer:
        i = by_source.get(t.name) if t.name not in inputs else None
        c = None if i is None else candidates[i]
        if c is None or t.data_type != onnx.TensorProto.FLOAT or tuple(t.dims) != c.w.shape:
            kept.append(t)
            continue
        if not np.array_equal(originals.read(t), c.w):
            kept.append(t)
            continue
        shared[t.name] = i
    if not shared:
        return candidates
    del graph.initializer[:]
    graph.initializer.extend(kept)
    graph.input.extend(helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, list(candidates[i].w.shape))
                       for n, i in shared.items())  # fmt: skip
    out = list(candidates)
    for name, i in shared.items():
        out[i] = replace(out[i], also=(*out[i].also, name))
    return out


# While a calibrated export runs, blocks from this size on are mapped, and unmapped when freed, instead
# of coming from glibc's heaps: ORT's per-node buffers (the probe session has no arena) and NumPy's
# temporaries of many sizes interleave there, and freed heap pages stay resident. Measured on a
# 0.1B LLM (docs/methods.md): a probe run with every layer quantized peaked at 1.29-1.59 GB, with it 1.0 GB.
HEAP_MMAP_BYTES = 1 << 20
# Afterwards the threshold is left where glibc's own sliding threshold ends after large frees (its
# 64-bit maximum): the process keeps the heap's speed for the mid-sized blocks.
_MMAP_BYTES_AFTER = 32 << 20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


@contextmanager
def bounded_heap() -> Iterator[None]:
    """Map blocks of ``HEAP_MMAP_BYTES`` and more while inside (glibc; nothing elsewhere or when the user set it).

    An environment variable (``MALLOC_MMAP_THRESHOLD_``, or the tunable in ``GLIBC_TUNABLES``) wins.
    """
    libc = None
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ and "mmap_threshold" not in os.environ.get("GLIBC_TUNABLES", ""):
        try:
            libc = ctypes.CDLL("libc.so.6")
            libc.mallopt(_M_MMAP_THRESHOLD, HEAP_MMAP_BYTES)
        except (OSError, AttributeError):
            libc = None
    try:
        yield
    finally:
        if libc is not None:
            libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_BYTES_AFTER)


def release_memory() -> None:
    """Free what only reference cycles still hold, then hand freed heap pages back to the OS.

    A rewriter's objects refer to each other (bound methods), so the weights it read stay alive
    until the cyclic collector runs; glibc keeps freed pages after a big model copy is dropped
    (``malloc_trim``; a no-op elsewhere).
    """
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _compact(x: np.ndarray) -> np.ndarray:
    """A float32 output as float16 when that keeps it finite (a cosine near 1 moves by ~1e-7), else as it is."""
    if x.dtype != np.float32 or x.size == 0 or not np.all(np.abs(x) < 6e4):
        return x
    return x.astype(np.float16)


def compact_outputs(outputs: list[np.ndarray]) -> list[np.ndarray]:
    """Model outputs kept for a later comparison, float16 where that stays finite."""
    return [_compact(o) for o in outputs]


class ReferenceStore:
    """The FP32 outputs of ``batches`` batches, kept for later comparisons.

    Sized from the first batch's outputs: float16 (where that stays finite) when all of them
    in float32 pass REFERENCE_COMPACT_BYTES; in memory when they fit REFERENCE_RAM_BYTES, else
    one .npy file per output in a temporary folder (removed with the store), read back a batch
    at a time, so that an LLM's logits do not sit in memory beside the exported model's session.
    ``for_outputs`` makes one, or None when they are not worth keeping (REFERENCE_BYTES).
    """

    def __init__(self, batches: int, first: Sequence[np.ndarray]) -> None:
        size = sum(o.nbytes for o in first) * batches
        self.compact = size > REFERENCE_COMPACT_BYTES
        self._memory: dict[int, list[np.ndarray]] = {}
        self._files: dict[int, list[Path]] = {}
        self._folder = None
        if size > REFERENCE_RAM_BYTES:
            self._folder = tempfile.TemporaryDirectory(prefix="cim-int4-reference-")

    @classmethod
    def for_outputs(cls, batches: int, first: Sequence[np.ndarray]) -> ReferenceStore | None:
        """A store for ``batches`` batches like ``first``; None when too big to keep (run again when needed)."""
        return cls(batches, first) if sum(o.nbytes for o in first) * batches <= REFERENCE_BYTES else None

    def put(self, index: int, outputs: Sequence[np.ndarray]) -> bool:
        """Keep batch ``index``'s outputs; False (nothing kept) when the temporary folder cannot take them."""
        kept = compact_outputs(list(outputs)) if self.compact else list(outputs)
        if self._folder is None:
            self._memory[index] = kept
            return True
        paths = [Path(self._folder.name) / f"{index}-{j}.npy" for j in range(len(kept))]
        try:
            for path, x in zip(paths, kept, strict=True):
                np.save(path, x, allow_pickle=False)
        except OSError:
            for path in paths:
                path.unlink(missing_ok=True)
            return False
        self._files[index] = paths
        return True

    def get(self, index: int) -> list[np.ndarray] | None:
        """Batch ``index``'s outputs, or None when they were not kept."""
        if index in self._memory:
            return self._memory[index]
        if index in self._files:
            return [np.load(path, allow_pickle=False) for path in self._files[index]]
        return None

    def __len__(self) -> int:
        return len(self._memory) + len(self._files)

    def __contains__(self, index: int) -> bool:
        return index in self._memory or index in self._files


def _feeds_of(c: Candidate, qw: QuantizedWeight) -> dict[str, np.ndarray]:
    """What a run feeds to give candidate ``c`` the weight ``qw``: its codes (``Codes``), else its float32 weight."""
    k, n = c.w.shape
    if c.codes is None or qw.group_size != c.codes.group_size or (qw.k, qw.n) != (k, n):
        return {c.weight_name: dequantize(qw.packed, qw.scales, qw.k, qw.group_size, qw.bits).astype(np.float32)}
    groups = k // qw.group_size
    return {
        c.codes.select: np.array(True),
        c.codes.q: np.ascontiguousarray(unpack(qw.packed, qw.bits)[:, :k].T),  # [K, N] int8
        c.codes.scales: np.ascontiguousarray(qw.scales[:, :groups].astype(np.float32).T[:, None, :]),  # [G, 1, N]
    }


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
        made = {o for n in probe.graph.node for o in n.output}  # a product made in the main graph (maybe by an If)
        self.measured = {c.key for c in self.candidates if c.product in made}
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
        weights = {name: c.w for c in self.candidates for name in (c.weight_name, *c.also)}
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
        int4 = {}
        for i in layers:
            int4.update(_feeds_of(self.candidates[i], weights[self.candidates[i].key]))
        if self._weight_file is not None and sum(w.nbytes for w in int4.values()) > MAP_WEIGHTS_BYTES:
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
            found.append(row_cosines(reference, outputs))
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
