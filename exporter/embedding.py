"""Int4 embeddings: a Gather on a constant 2-D float table becomes CimInt4Gather; a tied LM head shares its tensors.

A token embedding is ``Gather(table [rows, K], indices)`` along axis 0. Its table is
quantized exactly as a CimInt4MatMul weight ``W = table.T`` ([K, N=rows]) would be (same
scale rule, group size, packing), so the codes/scales pair is the same bytes in both views:
``packed`` uint8 [rows, K_padded/2] and ``scales`` float32 [rows, groups], row r = output
channel r. The pair is written once as two initializers; CimInt4Gather reads them as
inputs, and a MatMul/Gemm whose weight equals ``table.T`` (an LM head tied to the embedding,
whether through the same initializer behind a Transpose or a stored copy) reads the same two
initializers as inputs instead of holding attributes of its own. See docs/embeddings.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..contract import GATHER, GATHER_OP_TYPE, SharedInt4Node, encode_int8_scales, grid_of
from .fold import DEFAULT_DOMAINS, NotFoldable, Scope
from .operands import Ineligible
from .options import ExportOptions
from .quantize import QuantizedWeight, quantize_weight
from .widths import width_of


class NotATable(Exception):
    """A Gather whose data is not a constant (an ordinary Gather on activations or shapes): not reported."""


@dataclass
class Table:
    """One constant embedding table: its float32 value [rows, K], the names it was read through, its int4 form."""

    key: str  # the Gather's data input name
    value: np.ndarray
    sources: list[str]
    bytes_before: int
    quantized: QuantizedWeight | None = None
    given: QuantizedWeight | None = None  # its tied head's codes from a calibrated method (GPTQ), used as its own
    packed_name: str = ""
    scales_name: str = ""
    super_name: str = ""  # int8 scales' super-scales, else ""
    gather_name: str = ""  # the first Gather node reading it (a ``bits`` pattern may name it)

    @property
    def name(self) -> str:
        """The initializer (or Constant) the table comes from, for names and messages."""
        return self.sources[0] if self.sources else self.key

    @property
    def bytes_after(self) -> int:
        assert self.quantized is not None
        return self.quantized.nbytes


def is_gather(node: onnx.NodeProto) -> bool:
    """True for an ONNX Gather node (default domain)."""
    return node.op_type == "Gather" and node.domain in DEFAULT_DOMAINS


def plan_gather(node: onnx.NodeProto, scope: Scope, options: ExportOptions) -> Table:
    """The table of a Gather on a constant float32 2-D table along axis 0; else Ineligible (why) or NotATable."""
    data = node.input[0]
    if not scope.is_constant(data):
        raise NotATable(data)
    try:
        folded = scope.resolve(data, "table")
    except NotFoldable as why:
        raise Ineligible(str(why)) from None
    if folded.elem_type != onnx.TensorProto.FLOAT:
        if folded.elem_type in (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE):
            dtype = onnx.TensorProto.DataType.Name(folded.elem_type)
            raise Ineligible(f"table {data!r} is {dtype}; only FLOAT tables are quantized")
        raise NotATable(data)  # an int table (shapes, ids): not an embedding
    table = folded.value
    if table.ndim != 2:
        raise Ineligible(f"table {data!r} has shape {list(table.shape)}; only 2-D tables are quantized")
    axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)
    if axis not in (0, -2):
        raise Ineligible(f"gathers along axis {axis}; only rows (axis 0) are quantized")
    rows, k = table.shape
    if k < options.group_size:
        raise Ineligible(f"rows of {k} values are shorter than group_size={options.group_size}")
    if table.size < options.min_size:
        raise Ineligible(f"table has {table.size} elements, fewer than min_size={options.min_size}")
    if not np.all(np.isfinite(table)):
        raise Ineligible("table has NaN or infinite values")
    return Table(
        data, np.ascontiguousarray(table, dtype=np.float32), list(folded.names), folded.value.nbytes,
        gather_name=node.name,
    )


class Tables:
    """The embedding tables of one rewrite, each quantized once and written as two initializers of the main graph.

    A table's codes: its tied head's (``Table.given``) when the rewrite was handed them (a
    calibrated export: GPTQ's, fitted for the head, at the head's width); else its own, at
    ``widths[table.key]`` when given (``bits="auto"``: the tied head's allocated width), else at
    what the ``bits`` option gives its Gather's or its own name.
    """

    def __init__(
        self,
        options: ExportOptions,
        fresh: Callable[[str], str],
        write: Callable[[onnx.TensorProto], None] | None,
        widths: Mapping[str, int] | None = None,
    ) -> None:
        self.options = options
        self.fresh = fresh
        self.write = write
        self.widths = widths or {}
        self.tables: list[Table] = []
        self.initializers: list[onnx.TensorProto] = []

    def add(self, table: Table) -> Table:
        """Register ``table`` (the same data name again returns the one registered first)."""
        for known in self.tables:
            if known.key == table.key:
                return known
        self.tables.append(table)
        return table

    def tied(self, w: np.ndarray) -> Table | None:
        """The table whose transpose is exactly ``w`` [K, N] (a tied LM head), or None."""
        for table in self.tables:
            if table.value.shape == w.shape[::-1] and np.array_equal(table.value.T, w):
                return table
        return None

    def quantize(self, table: Table) -> QuantizedWeight:
        """``table``'s int4 form, made (and its two initializers written) on first use."""
        if table.quantized is None:
            o = self.options
            if table.given is not None:  # the tied head's calibrated codes, at the head's width
                qw = table.given
            else:
                bits = self.widths.get(table.key) or width_of(o.bits, table.gather_name, table.name)
                grid = grid_of(o.grid, bits)
                qw = quantize_weight(table.value.T, o.group_size, o.scale_rule, bits, o.scale_dtype, grid)
            table.quantized = qw
            table.packed_name = self.fresh(f"{table.name}/int4_packed")
            table.scales_name = self.fresh(f"{table.name}/int4_scales")
            arrays = [(qw.packed, table.packed_name), (qw.scales, table.scales_name)]
            if qw.super_scales is not None:  # int8 scales, and their super-scales as a fourth input
                table.super_name = self.fresh(f"{table.name}/int4_super_scales")
                arrays = [(qw.packed, table.packed_name),
                          (encode_int8_scales(qw.scales, qw.super_scales, f"table '{table.name}'"), table.scales_name),
                          (qw.super_scales, table.super_name)]
            for array, name in arrays:
                tensor = numpy_helper.from_array(array, name)
                if self.write is not None:
                    self.write(tensor)  # streamed to the output now
                self.initializers.append(tensor)
        return table.quantized

    def gather_node(self, node: onnx.NodeProto, table: Table) -> onnx.NodeProto:
        """The CimInt4Gather replacing ``node``."""
        qw = self.quantize(table)
        return SharedInt4Node(
            node.name or f"{node.output[0]}/{GATHER_OP_TYPE}",
            (table.packed_name, node.input[1], table.scales_name) + ((table.super_name,) if table.super_name else ()),
            (node.output[0],),
            qw.k,
            qw.group_size,
            GATHER,
            bits=qw.bits,
            grid=qw.grid,
        ).to_node()
