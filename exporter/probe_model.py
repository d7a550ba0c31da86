"""The probe model: the export's rewrite with ``x @ W`` in place of CimInt4MatMul, W a graph input fed per run.

``probe_model`` builds it and its ``Candidate`` layers. Where a layer's K is whole groups, its
product is an If that can also dequantize codes fed to it (``Codes``), so a run with many
layers quantized holds their int8 codes, not float32 copies.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import onnx
from google.protobuf.message import Message
from onnx import helper, numpy_helper

from .operands import Plan
from .options import ExportOptions
from .rewrite import Rewriter, run_rewrite
from .writer import TensorStore

# Probe weights are named from this prefix.
PROBE_PREFIX = "cim_int4.probe."


@dataclass(frozen=True)
class Candidate:
    """An eligible MatMul/Gemm of a probe model: its key, probe weight name, weight [K, N] and bias [N] (or None)."""

    key: str  # subgraph path + label, as in the summary; unique in the model
    weight_name: str
    w: np.ndarray
    bias: np.ndarray | None
    also: tuple[str, ...] = ()  # other graph inputs fed with ``w`` (a tied embedding table's initializer)
    # Inputs a Gather reads as its table (through Transpose/Identity/Cast), each with whether it holds ``w``
    # transposed ([N, K]): the export gives such a table the layer's codes, so a run that quantizes the layer
    # feeds them its quantized weight too (``Probe.compared``); FP32 runs feed ``w`` (or its transpose).
    tables: tuple[tuple[str, bool], ...] = ()
    sources: tuple[str, ...] = ()  # the names the weight was read through
    name: str = ""  # the node's own name (its output's when unnamed), which a ``bits`` mapping also matches
    codes: Codes | None = None  # the inputs that make the product dequantize in the graph (None: feed W only)


@dataclass(frozen=True)
class Codes:
    """Inputs of a probe product that dequantizes in ORT: ``x @ reshape(q [G, gs, N] * scales [G, 1, N], [K, N])``.

    ``select`` (bool, default False) picks that branch of an If around the product; ``q`` (int8
    [K, N], default empty) holds the signed codes and ``scales`` (float32 [K / gs, 1, N]) the group
    scales. Fed codes (1 byte a weight), a run holds no float32 weight between nodes: ORT makes one
    for the node (the Cast's and the Mul's output: two copies) and frees it, so a run with many layers
    quantized holds a quarter of the bytes (``Probe.cosines`` feeds a single layer its float32 weight).
    The product is the float32 rounding of ``q * scale``, as ``ops.reference.dequantize`` gives.
    """

    select: str
    q: str
    scales: str
    group_size: int


class ProbeRewriter(Rewriter):
    """Emits ``MatMul(x, W) [+ bias]`` where the export writes CimInt4MatMul, W a main-graph input per node."""

    quantizes_tables = False  # the probe measures MatMuls only; embeddings stay as they are
    fuses_gated = False  # the probe reads each MatMul's output; the gated MLPs are fused in the final rewrite

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
        # Overridable defaults (an initializer that is also an input) need IR 4; the If's outer scope, opset 11.
        codes = self._codes(index, w.shape) if self.opset >= 11 and self.model.ir_version >= 4 else None
        if codes is None:
            node = helper.make_node("MatMul", [x, w_name], [product], name=base)
        else:
            node = self._select(codes, x, w_name, w.shape, product, base)
        self.candidates.append(
            Candidate(key, w_name, w, plan.bias, sources=tuple(plan.sources), name=base, codes=codes)
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
    return (
        not t.raw_data
        and t.data_location != onnx.TensorProto.EXTERNAL
        and not any((t.float_data, t.int32_data, t.int64_data, t.double_data, t.uint64_data, t.string_data))
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
    session would hold a second FP32 copy of the largest tensor of the model. A table the head reads
    through a Transpose (the head's weight transposed) becomes an input too when a Gather reads it, so
    that a run can feed it the head's quantized weight (``Candidate.tables``).
    """
    by_source = {c.sources[0]: i for i, c in enumerate(candidates) if c.sources}
    inputs, gathered = {i.name for i in graph.input}, _gather_tables(graph)
    kept, shared = [], {}
    for t in graph.initializer:
        i = by_source.get(t.name) if t.name not in inputs else None
        c = None if i is None else candidates[i]
        dims = tuple(t.dims)
        if c is None or t.data_type != onnx.TensorProto.FLOAT or dims not in (c.w.shape, c.w.shape[::-1]):
            kept.append(t)
            continue
        transposed = dims != c.w.shape
        # a table: the Gather reads w.T ([N, K], the head's rows), as the export ties them (allocate.table_of_tied)
        table = gathered.get(t.name) is (not transposed)
        # the transposed form is shared only as a table; the weight itself as before (read through nothing else)
        if not (table if transposed else len(c.sources) == 1):
            kept.append(t)
            continue
        value = originals.read(t)
        if not np.array_equal(value.T if transposed else value, c.w):
            kept.append(t)
            continue
        shared[t.name] = (i, transposed, table)
    if not shared:
        return candidates
    del graph.initializer[:]
    graph.initializer.extend(kept)
    out = list(candidates)
    for name, (i, transposed, table) in shared.items():
        c = out[i]
        shape = list(c.w.shape[::-1] if transposed else c.w.shape)
        graph.input.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape))
        also = c.also if transposed else (*c.also, name)  # a transposed table is fed from ``tables`` alone
        out[i] = replace(c, also=also, tables=(*c.tables, (name, transposed)) if table else c.tables)
    return out


# Nodes that pass a table on unchanged in value (a tied head's weight reaches its Gather through a Transpose).
_TABLE_PASSES = ("Transpose", "Identity", "Cast")


def _gather_tables(graph: onnx.GraphProto) -> dict[str, bool]:
    """Names of ``graph`` a Gather reads as its data, directly or through ``_TABLE_PASSES`` nodes, each with
    whether the Gather's table is its transpose (an odd number of Transposes between)."""
    made = {o: n for n in graph.node for o in n.output}
    found: dict[str, bool] = {}
    for n in graph.node:
        if n.op_type != "Gather" or not n.input:
            continue
        name, flipped = n.input[0], False
        while True:
            found[name] = flipped
            node = made.get(name)
            if node is None or node.op_type not in _TABLE_PASSES or not node.input:
                break
            name, flipped = node.input[0], flipped ^ (node.op_type == "Transpose")
    return found
