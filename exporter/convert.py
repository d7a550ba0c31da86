"""from_matmulnbits: ORT ``MatMulNBits`` nodes (com.microsoft) become ``CimInt4MatMul`` nodes, bit for bit.

For ``bits = 4``, no zero points (or all 8) and no ``g_idx``, MatMulNBits stores what our
attributes hold: ``B`` uint8 ``[N, ceil(K/blk), blk/2]``, element k of row n in byte k/2 of
the row, even k in the low nibble, code ``q + 8``; ``scales`` ``[N, ceil(K/blk)]`` (or
flattened), dequantized as ``(code - 8) * scale``. Reshaped, ``B`` is ``packed`` and
``scales`` is ``scales``: no requantization, the weights stay byte-identical. Padding codes
beyond K, which MatMulNBits ignores, are set to 8, as our format requires.

A ``B`` that other nodes read too (the genai builder's tied embedding: ``Reshape`` ->
``GatherBlockQuantized`` on the LM head's ``B`` and ``scales``) stays one tensor: the
CimInt4MatMul takes ``B`` and ``scales`` as inputs (the op contract's input form) instead of
attributes, so the file keeps one copy.

A ``GatherBlockQuantized`` of the same format (4 bits, uint8 data without zero points, so
code 8 is zero; rows gathered, blocks along the row, float32 scales) becomes a
``CimInt4Gather`` that reads the data initializer itself: the builder's ``Reshape`` in front of
it, which ORT would fold into a second copy of the table at load, goes.

``accuracy_level`` 4 (int8 activations) becomes ``compute = "int8"``, the op's analogue,
so the converted model keeps the precision (and speed trade) its author chose; other
levels compute in FP32. Nodes that do not match are left as they are, with the reason.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import numpy as np
import onnx
from onnx import helper

from ..contract import (
    DEFAULT_COMPUTE,
    GATHER,
    GATHER_OP_TYPE,
    MATMUL_SHARED,
    OP_DOMAIN,
    OP_TYPE,
    OP_VERSION,
    SUPPORTED_GROUP_SIZES,
    Int4Node,
    SharedInt4Node,
    is_op_node,
    pack,
    unpack,
    unpack_codes,
)
from . import gated
from .api import ExportError, max_ir_version
from .fold import NotFoldable, Scope
from .io import ModelFileError, external_info, read_model, tensor_nbytes
from .options import ExportOptions
from .rewrite import drop_stray_imports
from .subgraph import all_graphs, drop_unused, used_names
from .summary import Skipped
from .writer import OutputFiles, TensorStore, without

NBITS_DOMAIN = "com.microsoft"
NBITS_OP = "MatMulNBits"
GATHER_NBITS_OP = "GatherBlockQuantized"
# MatMulNBits input slots (ORT contrib op schema).
_A, _B, _SCALES, _ZERO_POINTS, _G_IDX, _BIAS = range(6)


@dataclass(frozen=True)
class Converted:
    """One MatMulNBits node that became CimInt4MatMul."""

    name: str
    k: int
    n: int
    block_size: int
    compute: str
    shared: bool = False  # B and scales read as inputs, shared with other nodes


@dataclass
class ConvertSummary:
    """What from_matmulnbits did: nodes converted and nodes left as MatMulNBits, with the reason."""

    converted: list[Converted] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    gathers: list[str] = field(default_factory=list)  # GatherBlockQuantized nodes now CimInt4Gather
    gated: list[str] = field(default_factory=list)  # gated MLPs fused: "gate + up (activation)"

    def format(self) -> str:
        """A human-readable report, one line per node."""
        lines = [
            f"cim-int4: {len(self.converted)} MatMulNBits node(s) converted to {OP_TYPE}, "
            f"{len(self.skipped)} left as they are"
        ]
        for c in self.converted:
            shared = ", B shared with other nodes (read as inputs)" if c.shared else ""
            lines.append(f"  converted {c.name!r}: K={c.k} N={c.n} block {c.block_size}, compute {c.compute}{shared}")
        for name in self.gathers:
            lines.append(f"  converted {GATHER_NBITS_OP} {name!r} to {GATHER_OP_TYPE} (reads its table in place)")
        for s in self.skipped:
            lines.append(f"  skipped   {s.name!r}: {s.reason}")
        if self.gated:
            lines.append(f"  gated MLPs: {len(self.gated)} fused, each gate and up projection with its activation and "
                         "product in one node")  # fmt: skip
        return "\n".join(lines)


class _Unconvertible(Exception):
    """A MatMulNBits node that stays as it is; the message says why."""


def _int_attrs(node: onnx.NodeProto) -> dict[str, int]:
    return {a.name: a.i for a in node.attribute if a.type == onnx.AttributeProto.INT}


def _input(node: onnx.NodeProto, slot: int) -> str:
    return node.input[slot] if len(node.input) > slot else ""


def _constant(consts: Scope, node: onnx.NodeProto, slot: int, what: str) -> np.ndarray:
    name = node.input[slot]
    tensor = consts.initializers.get(name)
    # A relative location was never resolved (read_model makes them absolute for TensorStore.read).
    if (
        tensor is not None
        and tensor.data_location == onnx.TensorProto.EXTERNAL
        and not tensor.raw_data
        and not os.path.isabs(external_info(tensor)[0])
    ):
        raise ExportError(
            f"{what} {name!r} of node {node.name!r} is in external data that was not loaded; "
            "load the model from its file (onnx.load(path) or cim_int4.exporter.load_model)"
        )
    try:
        return consts.resolve(name, what).value
    except NotFoldable as why:
        raise _Unconvertible(f"not a constant: {why}") from None


def _zero_points_are_8(zp: np.ndarray, n: int, blocks: int) -> bool:
    if zp.dtype != np.uint8:
        raise _Unconvertible(f"zero points are {zp.dtype}; only packed uint8 zero points (all 8) convert")
    row_bytes = -(-blocks // 2)
    if zp.size != n * row_bytes:
        raise _Unconvertible(f"zero points have {zp.size} bytes, expected N * ceil(blocks/2) = {n * row_bytes}")
    codes = unpack_codes(zp.reshape(n, row_bytes))[:, :blocks]
    return bool(np.all(codes == 8))


def _convert_node(
    node: onnx.NodeProto, consts: Scope, compute: str, shared: bool = False
) -> tuple[onnx.NodeProto, Converted]:
    """``node`` as CimInt4MatMul; ``shared``: its B is an initializer other nodes read too (kept as an input)."""
    attrs = _int_attrs(node)
    bits, block = attrs.get("bits", 4), attrs.get("block_size", 0)
    if bits != 4:
        raise _Unconvertible(f"bits={bits}; only 4-bit weights convert")
    if block not in SUPPORTED_GROUP_SIZES:
        raise _Unconvertible(f"block_size={block}; {OP_TYPE} takes {', '.join(map(str, SUPPORTED_GROUP_SIZES))}")
    if "K" not in attrs or "N" not in attrs or attrs["K"] < 1 or attrs["N"] < 1:
        raise _Unconvertible("attributes K and N must be present and >= 1")
    k, n = attrs["K"], attrs["N"]
    if _input(node, _G_IDX):
        raise _Unconvertible("has a g_idx input (act-order); only plain blockwise weights convert")
    blocks = -(-k // block)
    b = _constant(consts, node, _B, "B")
    if b.dtype != np.uint8 or b.size != n * blocks * block // 2:
        expected = f"uint8 [N, ceil(K/blk), blk/2] = [{n}, {blocks}, {block // 2}]"
        raise _Unconvertible(f"B is {b.dtype} {list(b.shape)}; expected {expected}")
    scales = _constant(consts, node, _SCALES, "scales")
    if scales.dtype != np.float32:
        raise _Unconvertible(f"scales are {scales.dtype} (float16 activations?); {OP_TYPE} takes float32")
    if scales.size != n * blocks:
        raise _Unconvertible(f"scales have {scales.size} elements; expected N * ceil(K/blk) = {n * blocks}")
    scales = scales.reshape(n, blocks)
    with np.errstate(over="ignore", invalid="ignore"):
        if not np.all(np.isfinite(scales * np.float32(8))):
            raise _Unconvertible("scales have NaN, infinite or too large (8 * |scale| overflows) values")
    if _input(node, _ZERO_POINTS) and not _zero_points_are_8(
        _constant(consts, node, _ZERO_POINTS, "zero_points"), n, blocks
    ):
        raise _Unconvertible("zero points other than 8 (asymmetric); only symmetric weights convert")
    bias = None
    if _input(node, _BIAS):
        bias = _constant(consts, node, _BIAS, "bias")
        if bias.dtype != np.float32 or bias.size != n:
            raise _Unconvertible(f"bias is {bias.dtype} {list(bias.shape)}; expected float32 [{n}]")
        bias = bias.reshape(n)

    packed = b.reshape(n, blocks * block // 2)
    # A shared B is read as it is, so only when its padding codes (if any) are already 8.
    share = shared and node.input[_SCALES] in consts.initializers
    if k % block:
        codes = unpack_codes(packed)
        share = share and bool(np.all(codes[:, k:] == 8))
        if not share:
            # MatMulNBits never reads codes beyond K; our op requires them to be 8 (q = 0).
            q = unpack(packed)
            q[:, k:] = 0
            packed = pack(q)
    mode = compute if compute != "auto" else ("int8" if attrs.get("accuracy_level", 0) == 4 else "fp32")
    name = node.name or f"{node.output[0]}/{OP_TYPE}"
    if share:
        inputs = (node.input[_A], node.input[_B], node.input[_SCALES])
        new = SharedInt4Node(
            name, inputs, (node.output[0],), k, block, MATMUL_SHARED, n, bias,
            None if mode == DEFAULT_COMPUTE else mode,
        ).to_node()
    else:
        new = Int4Node(
            name,
            (node.input[_A],),
            (node.output[0],),
            k,
            n,
            block,
            packed,
            scales,
            bias,
            # Absent means fp32, which older builds of the op also understand.
            None if mode == DEFAULT_COMPUTE else mode,
        ).to_node()
    return new, Converted(name=new.name, k=k, n=n, block_size=block, compute=mode, shared=share)


def _convert_gather(node: onnx.NodeProto, consts: Scope) -> tuple[onnx.NodeProto, list[str]]:
    """``node`` (GatherBlockQuantized) as CimInt4Gather on the initializer behind its data, and the names skipped."""
    attrs = _int_attrs(node)
    bits, block = attrs.get("bits", 4), attrs.get("block_size", 128)
    if bits != 4 or block not in SUPPORTED_GROUP_SIZES:
        raise _Unconvertible(f"bits={bits}, block_size={block}; {GATHER_OP_TYPE} takes 4 bits in blocks of "
                             f"{', '.join(map(str, SUPPORTED_GROUP_SIZES))}")
    if attrs.get("gather_axis", 0) != 0 or attrs.get("quantize_axis", 1) not in (1, -1):
        raise _Unconvertible("only rows gathered (gather_axis 0) with blocks along them (quantize_axis 1) convert")
    if len(node.input) != 3 or not node.input[2]:
        raise _Unconvertible("needs exactly data, indices and scales (no zero points: code 8 is zero)")
    try:
        data = consts.resolve(node.input[0], "data")
    except NotFoldable as why:
        raise _Unconvertible(f"data is not a constant: {why}") from None
    value = data.value
    source = consts.initializers.get(data.names[0])
    chain = [consts.producers[name] for name in data.names[1:]]
    if value.dtype != np.uint8 or value.ndim != 2 or source is None or any(
        n.op_type not in ("Reshape", "Identity") for n in chain
    ):
        raise _Unconvertible("data must be a uint8 [rows, bytes] initializer, possibly behind Reshape nodes")
    rows, k = value.shape[0], value.shape[1] * 2
    if k % block or source.dims[0] != rows:
        raise _Unconvertible(f"data {list(value.shape)} does not hold whole blocks of {block} per row")
    scales = _constant(consts, node, 2, "scales")
    if scales.dtype != np.float32 or scales.size != rows * (k // block):
        raise _Unconvertible(f"scales are {scales.dtype} {list(scales.shape)}; expected float32 [{rows}, {k // block}]")
    new = SharedInt4Node(
        node.name or f"{node.output[0]}/{GATHER_OP_TYPE}",
        (data.names[0], node.input[1], node.input[2]),
        (node.output[0],),
        k,
        block,
        GATHER,
    ).to_node()
    return new, data.names[1:]


class NothingToConvert(ExportError):
    """No MatMulNBits node converts; ``summary`` says why for each (none skipped: the model has none)."""

    def __init__(self, summary: ConvertSummary) -> None:
        if summary.skipped:
            super().__init__(f"no {NBITS_OP} node could be converted\n{summary.format()}")
        else:
            super().__init__(f"no {NBITS_DOMAIN} {NBITS_OP} node in the model; nothing to convert")
        self.summary = summary


def _fuse_gated(graph: onnx.GraphProto, summary: ConvertSummary, converted: set[str]) -> None:
    """Each gated MLP of two nodes converted here (attribute form; outputs ``converted``) as one gated node, in place.

    Nodes of ours that the input already had are left as they are (their tensors may still be
    in the input's files).
    """
    replaced: dict[int, onnx.NodeProto | None] = {}
    for mlp in gated.find(graph, lambda n: is_op_node(n) and len(n.input) == 1 and n.output[0] in converted):
        gate, up = (Int4Node.from_node(graph.node[i]) for i in (mlp.gate, mlp.up))
        fused = gated.fuse(gate, up, mlp, f"{gate.name}/gated")
        if fused is None:
            continue
        if fused.compute == DEFAULT_COMPUTE:  # as the converted nodes: absent means fp32 to every build of the op
            fused = dataclasses.replace(fused, compute=None)
        gated.forget_shapes(graph, mlp)
        replaced[mlp.mul] = fused.to_node()
        replaced.update(dict.fromkeys(mlp.dropped))
        summary.gated.append(f"{gate.name} + {up.name} ({mlp.activation})")
    for index in sorted(replaced, reverse=True):
        if replaced[index] is None:
            del graph.node[index]
        else:
            graph.node[index].CopyFrom(replaced[index])


def _convert_in_place(
    model: onnx.ModelProto,
    compute: str,
    load: Callable[[onnx.TensorProto], np.ndarray] | None = None,
    initializers_of: onnx.GraphProto | None = None,
    fuse_gated: bool = True,
) -> ConvertSummary:
    """Convert ``model`` itself, for callers that own it; ``load`` reads an initializer (default: its inline data).

    The only conversion: convert_with_summary runs it on a copy without the main graph's
    initializers, which come from ``initializers_of`` (the caller's graph, only read), and only
    those still used are copied; convert_file on a model whose weights stay in their file (read
    one node at a time by ``load``). Either way no whole copy of the weights is held.
    """
    try:
        drop_stray_imports(model)  # an import left by ORT's transformers optimizer, with no node
    except ValueError as e:
        raise ExportError(str(e)) from None
    graph = model.graph
    # An overridable B or scales is the caller's to feed. The nodes are the same in both graphs.
    consts = Scope(graph if initializers_of is None else initializers_of, fold_inputs=False, load=load)
    summary = ConvertSummary()
    converted: set[str] = set()  # outputs of the nodes converted here
    readers = Counter(i for g in all_graphs(graph) for n in g.node for i in n.input if i)
    for index, node in enumerate(graph.node):
        if node.op_type != NBITS_OP or node.domain != NBITS_DOMAIN:
            continue
        try:
            shared = len(node.input) > _B and readers[node.input[_B]] > 1 and node.input[_B] in consts.initializers
            new, done = _convert_node(node, consts, compute, shared)
        except _Unconvertible as why:
            summary.skipped.append(Skipped(node.name or f"{NBITS_OP}#{index} -> {node.output[0]}", NBITS_OP, str(why)))
            continue
        graph.node[index].CopyFrom(new)
        summary.converted.append(done)
        converted.add(new.output[0])
    if not summary.converted:
        raise NothingToConvert(summary)
    if fuse_gated:
        _fuse_gated(graph, summary, converted)
    folded: set[str] = set()
    for index, node in enumerate(graph.node):
        if node.op_type != GATHER_NBITS_OP or node.domain != NBITS_DOMAIN:
            continue
        try:
            new, through = _convert_gather(node, consts)
        except _Unconvertible as why:
            summary.skipped.append(Skipped(node.name or f"{GATHER_NBITS_OP}#{index}", GATHER_NBITS_OP, str(why)))
            continue
        graph.node[index].CopyFrom(new)
        folded.update(through)
        summary.gathers.append(new.name)
    if initializers_of is not None:  # in their order, so drop_unused leaves what it would leave in a whole copy
        read = used_names(graph) | {i.name for i in graph.input}
        graph.initializer.extend(t for t in initializers_of.initializer if t.name in read)
    drop_unused(graph, folded=folded, folded_inputs=set())
    if not any(o.domain == OP_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(OP_DOMAIN, OP_VERSION))
    model.ir_version = min(model.ir_version, max_ir_version())
    return summary


def conversion_options(options: ExportOptions | None = None, **values: object) -> ExportOptions:
    """A conversion's options: ``options`` (default ``compute="auto"``) with ``values``; compute and external_data only.

    ``compute``: ``"auto"`` (accuracy_level 4 -> ``"int8"``, else ``"fp32"``), ``"fp32"`` or
    ``"int8"``; ``fuse_gated``: gated MLPs as one node each (exporter.gated); ``external_data``:
    tensors in ``<output>.data`` whatever the size. ValueError
    names any other option given: a conversion keeps MatMulNBits' own block size and rounding.
    """
    options = (options or CONVERT_DEFAULTS).with_(**values)
    other = [f.name for f in fields(ExportOptions) if f.name not in ("compute", "external_data", "fuse_gated")
             and getattr(options, f.name) != getattr(CONVERT_DEFAULTS, f.name)]
    if other:
        raise ValueError(
            f"a MatMulNBits conversion takes only the options compute, external_data and fuse_gated, got {other}"
        )
    return options


CONVERT_DEFAULTS = ExportOptions(compute="auto")


def convert_with_summary(
    model: onnx.ModelProto, options: ExportOptions | None = None, **values: object
) -> tuple[onnx.ModelProto, ConvertSummary]:
    """A copy of ``model`` with each convertible MatMulNBits node as CimInt4MatMul, and the summary.

    Options (``conversion_options``): ``compute``, ``fuse_gated`` (exporter.gated). ``model`` is left as it is. Raises
    NothingToConvert (an ExportError) if no node converts (the message lists why for each).
    """
    options = conversion_options(options, **values)
    out = without(model, ("graph",))
    out.graph.CopyFrom(without(model.graph, ("initializer",)))
    return out, _convert_in_place(out, options.compute, initializers_of=model.graph, fuse_gated=options.fuse_gated)


def from_matmulnbits(model: onnx.ModelProto, options: ExportOptions | None = None, **values: object) -> onnx.ModelProto:
    """``model`` with its 4-bit symmetric MatMulNBits nodes as CimInt4MatMul (weights byte-identical).

    Options as ``convert_with_summary``. Load a model with external data from its file first
    (``cim_int4.exporter.load_model``).
    """
    return convert_with_summary(model, options, **values)[0]


def int4_bytes(path: str | os.PathLike) -> int:
    """Bytes of the B and scales initializers of the MatMulNBits nodes in the model file ``path`` (weights not read)."""
    model, _ = read_model(path)
    initializers = {t.name: t for t in model.graph.initializer}
    names = {
        n.input[slot]
        for n in model.graph.node
        if n.op_type == NBITS_OP and n.domain == NBITS_DOMAIN
        for slot in (_B, _SCALES)
        if len(n.input) > slot
    }
    return sum(tensor_nbytes(initializers[name]) for name in names if name in initializers)


def convert_file(
    source: str | os.PathLike,
    output: str | os.PathLike,
    options: ExportOptions | None = None,
    *,
    quiet: bool = False,
    **values: object,
) -> ConvertSummary:
    """Convert the model file ``source`` (with its external data) and write ``output``; never the input.

    Reads one node's weights at a time: memory peaks near the int4 weights once (docs/guide.md, "convert").
    Options (``conversion_options``): ``compute``, ``fuse_gated``, ``external_data`` (see ``save_model``).
    """
    options = conversion_options(options, **values)
    compute, external_data = options.compute, options.external_data
    try:
        # Weights stay in the input files until written: memory holds the converted weights, not the model.
        model, input_files = read_model(source)
        with OutputFiles(output, input_files) as files:
            store = TensorStore(files)
            summary = _convert_in_place(model, compute, store.read, fuse_gated=options.fuse_gated)
            files.commit(model, store, external_data=external_data, consume=True)
    except ModelFileError as e:
        raise ExportError(str(e)) from e
    except OSError as e:
        raise ExportError(f"{e.filename or output}: {e.strerror or e}") from e
    if not quiet:
        print(summary.format())
        print(f"cim-int4: wrote {output}")
    return summary
