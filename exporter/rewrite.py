"""Graph rewrite: constant-weight MatMul / Gemm nodes, in the main graph and its subgraphs, become CimInt4MatMul."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Protocol

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..contract import (
    ATTR_GRID,
    DEFAULT_BITS,
    DEFAULT_GRID,
    GRID_OP_VERSION,
    MATMUL_SHARED,
    OP_DOMAIN,
    OP_TYPE,
    OP_VERSION,
    Int4Node,
    SharedInt4Node,
    grid_of,
)
from . import gated
from .embedding import NotATable, Table, Tables, is_gather, plan_gather
from .fold import DEFAULT_DOMAINS, Scope
from .operands import Ineligible, Plan, plan_gemm, plan_matmul
from .options import ExportOptions
from .quantize import QuantizedWeight, quantize_weight
from .subgraph import all_graphs, defined_names, drop_unused, subgraphs, uses_domain
from .summary import ExportSummary, Rewritten, Skipped
from .widths import width_of


def node_label(node: onnx.NodeProto, index: int) -> str:
    """How the summary names node ``index`` of its graph: its name, else ``op#index -> first output``."""
    return node.name or f"{node.op_type}#{index} -> {node.output[0] if node.output else ''}"


def _excluded(name: str, patterns: list[tuple[str, re.Pattern[str]]]) -> str | None:
    for text, pattern in patterns:
        if name == text or pattern.fullmatch(name):
            return text
    return None


def _default_opset(model: onnx.ModelProto) -> int:
    versions = [o.version for o in model.opset_import if o.domain in DEFAULT_DOMAINS]
    return versions[0] if versions else onnx.defs.onnx_opset_version()


def drop_stray_imports(model: onnx.ModelProto) -> list[str]:
    """Remove imports of our domain at another version that no node uses (ORT's transformers optimizer writes v1000).

    Returns one warning line per import dropped; raises ValueError if a node uses the domain.
    """
    stray = [o for o in model.opset_import if o.domain == OP_DOMAIN and o.version not in (OP_VERSION, GRID_OP_VERSION)]
    if not stray:
        return []
    if uses_domain(model, OP_DOMAIN):
        raise ValueError(
            f"model imports domain {OP_DOMAIN!r} at version {stray[0].version} and has nodes in it; "
            f"this exporter writes version {OP_VERSION}"
        )
    kept = [o for o in model.opset_import if not (o.domain == OP_DOMAIN and o in stray)]
    del model.opset_import[:]
    model.opset_import.extend(kept)
    return [f"ignored opset import {OP_DOMAIN!r} v{o.version}: no node uses it (dropped)" for o in stray]


class TensorIO(Protocol):
    """Where tensor bytes live: ``read`` a constant as an array, ``write`` a new attribute tensor (may move it out)."""

    def read(self, tensor: onnx.TensorProto) -> np.ndarray: ...

    def write(self, tensor: onnx.TensorProto) -> None: ...


def _patterns(exclude: tuple[str, ...]) -> list[tuple[str, re.Pattern[str]]]:
    patterns = []
    for text in exclude:
        try:
            patterns.append((text, re.compile(text)))
        except re.error as e:
            raise ValueError(f"exclude pattern {text!r} is not a valid regular expression: {e}") from e
    return patterns


class Rewriter:
    """One rewrite of one model: walks every graph, plans each MatMul/Gemm, emits the replacement nodes.

    ``core`` makes the node computing the product; a subclass (exporter.probe_model) emits another.
    """

    # Gathers on constant tables become CimInt4Gather (and tied heads share them); not in a probe.
    quantizes_tables = True
    # Gated MLPs become one gated CimInt4MatMul (exporter.gated); not in a probe.
    fuses_gated = True

    def __init__(
        self,
        model: onnx.ModelProto,
        options: ExportOptions,
        keep: Mapping[str, str] | None = None,
        quantized: Mapping[str, QuantizedWeight] | None = None,
        tensors: TensorIO | None = None,
        table_widths: Mapping[str, int] | None = None,
    ):
        self.model = model
        self.tensors = tensors
        self.options = options
        self.group_size = options.group_size
        self.patterns = _patterns(options.exclude)
        self.min_size = options.min_size
        self.fold_inputs = options.fold_input_initializers is not False
        self.keep = keep or {}
        self.quantized = quantized or {}
        self.opset = _default_opset(model)
        self.summary = ExportSummary(options.group_size, options.scale_rule, options.node_compute, options.grid)
        self.names = defined_names(model.graph)
        self.folded: set[str] = set()  # names read through by a quantized weight or bias
        self.overridable: set[str] = set()
        self._ranks: dict[str, int] | None = None
        self.widths_used: dict[str, int] = {}  # node key -> the width it was written at
        # Embedding tables (Gather on a constant table), shared with a tied LM head; none in a probe.
        self.tables = Tables(options, self.fresh, tensors.write if tensors is not None else None, table_widths)
        self.quantize_tables = self.quantizes_tables and not options.keep_embedding
        self.fuse_gated = self.fuses_gated and options.fuse_gated

    def fresh(self, base: str) -> str:
        """A tensor name used nowhere in the model, derived from ``base``."""
        name, i = base, 0
        while name in self.names:
            i += 1
            name = f"{base}_{i}"
        self.names.add(name)
        return name

    def rank_of(self, name: str, scope: Scope) -> int | None:
        """Rank of tensor ``name`` from the model's declared shapes, else from ONNX shape inference (run once)."""
        s: Scope | None = scope
        while s is not None:
            for v in [*s.graph.input, *s.graph.value_info, *s.graph.output]:
                if v.name == name and v.type.tensor_type.HasField("shape"):
                    return len(v.type.tensor_type.shape.dim)
            s = s.parent
        if self._ranks is None:
            try:
                inferred = onnx.shape_inference.infer_shapes(self.model)
            except Exception:  # noqa: BLE001 - shape inference is a best effort here
                inferred = self.model
            self._ranks = {
                v.name: len(v.type.tensor_type.shape.dim)
                for g in all_graphs(inferred.graph)
                for v in g.value_info
                if v.type.tensor_type.HasField("shape")
            }
        return self._ranks.get(name)

    def rewrite_graph(self, graph: onnx.GraphProto, parent: Scope | None, path: str) -> None:
        scope = Scope(graph, parent, self.fold_inputs, load=self.tensors.read if self.tensors is not None else None)
        if parent is None:
            self.overridable = set(scope.overridable)
        casts: dict[str, str] = {}  # one Cast to float per fp16 activation, shared by its consumers
        replaced: dict[int, list[onnx.NodeProto]] = {}
        initializers: list[onnx.TensorProto] = []
        # Tables first, so that a tied LM head finds its embedding wherever the two nodes sit.
        gathers = self.plan_tables(graph, scope, path) if self.quantize_tables else {}
        if gathers and self.quantized:
            self.give_tied_heads(graph, scope, path)
        # Gated MLPs: each projection is held until its partner is made, then both become one node.
        mlps = gated.find(graph, gated.is_matmul) if self.fuse_gated else []
        roles = {i: m for m in mlps for i in (m.gate, m.up)}
        halves: dict[int, Int4Node] = {}
        for index, node in enumerate(graph.node):
            label = node_label(node, index)
            for attr_label, body in subgraphs(node):
                self.rewrite_graph(body, scope, f"{path}{node.op_type} {label!r}/{attr_label}/")
            if index in gathers:
                table = gathers[index]
                replaced[index] = [self.tables.gather_node(node, table)]
                self.folded.update(table.sources)
                self.summary.rewritten.append(
                    Rewritten(label, node.op_type, table.value.shape[1], table.value.shape[0], table.bytes_before,
                              table.bytes_after, path, "embedding table", self.tables.quantize(table).bits)
                )
                continue
            if node.domain not in DEFAULT_DOMAINS or node.op_type not in ("MatMul", "Gemm"):
                continue
            try:
                pattern = _excluded(node.name, self.patterns)
                if pattern is not None:
                    raise Ineligible(f"excluded by pattern {pattern!r}")
                plan = self.plan(node, scope)
                k, n = plan.w.shape
                if k < self.group_size:
                    raise Ineligible(f"K={k} is smaller than group_size={self.group_size}")
                if k * n < self.min_size:
                    raise Ineligible(f"weight has {k * n} elements, fewer than min_size={self.min_size}")
                if not np.all(np.isfinite(plan.w)):
                    raise Ineligible("weight has NaN or infinite values")
            except Ineligible as why:
                self.summary.skipped.append(Skipped(label, node.op_type, str(why), path))
                continue
            key = f"{path}{label}"
            if key in self.keep:
                self.summary.skipped.append(Skipped(label, node.op_type, self.keep[key], path))
                continue
            table = self.tables.tied(plan.w) if self.quantize_tables else None
            mlp = roles.get(index)
            if mlp is not None and table is None and _direct(plan):
                halves[index] = self.int4_node(node.name or f"{node.output[0]}/{OP_TYPE}", key, node.input[0],
                                               node.output[0], plan)
                replaced[index], after = [], halves[index].nbytes
                if mlp.gate in halves and mlp.up in halves:
                    self.fuse(graph, mlp, halves.pop(mlp.gate), halves.pop(mlp.up), replaced, path)
            else:
                replaced[index], after = self.emit(node, plan, key, casts, initializers, table)
            self.folded.update(plan.sources)
            if after is not None:
                bits = self.widths_used.get(key, DEFAULT_BITS)
                before, notes = plan.bytes_before, plan.notes
                if table is not None:
                    # The same initializer as the table's (behind a Transpose) is counted once, with the table.
                    before = 0 if set(plan.sources) & set(table.sources) else before
                    notes = "; ".join(x for x in (notes, f"tied: reads the int4 table of {table.name!r}") if x)
                self.summary.rewritten.append(
                    Rewritten(label, node.op_type, k, n, before, after, path, notes, bits, table is not None)
                )
        for index, half in halves.items():  # a projection whose partner stayed FP32: a node of its own
            replaced[index] = [self.written(half)]
        # In place, from the back: the nodes kept (If bodies, say) are not copied.
        for index in sorted(replaced, reverse=True):
            if not replaced[index]:
                del graph.node[index]
                continue
            first, *rest = replaced[index]
            graph.node[index].CopyFrom(first)
            for offset, extra in enumerate(rest, 1):
                graph.node.insert(index + offset, extra)
        graph.initializer.extend(initializers)

    def fuse(
        self,
        graph: onnx.GraphProto,
        mlp: gated.GatedMLP,
        gate: Int4Node,
        up: Int4Node,
        replaced: dict[int, list[onnx.NodeProto]],
        path: str,
    ) -> None:
        """Both projections of ``mlp`` as one gated node in the final Mul's place, or each its own if they differ."""
        fused = gated.fuse(gate, up, mlp, f"{gate.name}/gated")
        if fused is None:
            replaced[mlp.gate], replaced[mlp.up] = [self.written(gate)], [self.written(up)]
            return
        replaced[mlp.mul] = [self.written(fused)]
        for index in mlp.activation_nodes:
            replaced[index] = []
        gated.forget_shapes(graph, mlp)
        labels = (node_label(graph.node[mlp.gate], mlp.gate), node_label(graph.node[mlp.up], mlp.up))
        self.summary.gated.append(f"{path}{labels[0]} + {labels[1]} ({mlp.activation})")

    def written(self, node: Int4Node) -> onnx.NodeProto:
        """``node`` as an ONNX node, its tensors handed to ``tensors`` (streamed out) first."""
        proto = node.to_node()
        if self.tensors is not None:
            for a in proto.attribute:
                if a.type == onnx.AttributeProto.TENSOR:
                    self.tensors.write(a.t)  # streamed out now, before the node is copied into the graph
        return proto

    def plan(self, node: onnx.NodeProto, scope: Scope) -> Plan:
        """The Plan of a MatMul/Gemm ``node``; Ineligible says why there is none."""
        if node.op_type == "MatMul":
            return plan_matmul(node, scope, lambda x: self.rank_of(x, scope))
        return plan_gemm(node, scope)

    def give_tied_heads(self, graph: onnx.GraphProto, scope: Scope, path: str) -> None:
        """Hand each table the weights already quantized for its tied LM head (GPTQ's, error-compensated).

        The head is the layer those codes were fitted for; the table then shares them, as it
        shares its own round-to-nearest codes with the head without calibration.
        """
        shapes = {t.value.shape for t in self.tables.tables}
        for index, node in enumerate(graph.node):
            key = f"{path}{node_label(node, index)}"
            qw = None if key in self.keep else self.quantized.get(key)
            if qw is None or (qw.n, qw.k) not in shapes or node.op_type not in ("MatMul", "Gemm"):
                continue
            try:
                plan = self.plan(node, scope)
            except Ineligible:
                continue
            table = self.tables.tied(plan.w)
            if table is not None and table.quantized is None:
                table.given = qw

    def plan_tables(self, graph: onnx.GraphProto, scope: Scope, path: str) -> dict[int, Table]:
        """The Gathers of ``graph`` on a constant table that become CimInt4Gather (by node index); others skipped."""
        gathers: dict[int, Table] = {}
        for index, node in enumerate(graph.node):
            if not is_gather(node) or len(node.input) < 2:
                continue
            label = node.name or f"{node.op_type}#{index} -> {node.output[0] if node.output else ''}"
            try:
                pattern = _excluded(node.name, self.patterns)
                table = plan_gather(node, scope, self.options)
                if pattern is not None:
                    raise Ineligible(f"excluded by pattern {pattern!r}")
            except NotATable:
                continue
            except Ineligible as why:
                self.summary.skipped.append(Skipped(label, node.op_type, str(why), path))
                continue
            gathers[index] = self.tables.add(table)
        return gathers

    def _constant(self, base: str, value: np.ndarray, initializers: list[onnx.TensorProto]) -> str:
        name = self.fresh(base)
        initializers.append(numpy_helper.from_array(value, name))
        return name

    def _scaled_c(self, base: str, plan: Plan, nodes: list, initializers: list[onnx.TensorProto]) -> str:
        """Gemm's C times beta: C itself when beta is 1, a new constant when C is one, else a Mul node."""
        c = plan.add
        assert c is not None
        if plan.beta == 1.0:
            return c
        dtype = helper.tensor_dtype_to_np_dtype(plan.elem_type)
        if plan.add_value is not None:
            scaled = (plan.add_value.astype(np.float32) * np.float32(plan.beta)).astype(dtype)
            return self._constant(f"{c}/beta", scaled, initializers)
        beta = self._constant(f"{base}/beta", np.array(plan.beta, np.float32).astype(dtype), initializers)
        out = self.fresh(f"{c}/beta")
        nodes.append(helper.make_node("Mul", [c, beta], [out], name=f"{base}/scale_c"))
        return out

    def emit(
        self,
        node: onnx.NodeProto,
        plan: Plan,
        key: str,
        casts: dict[str, str],
        initializers: list[onnx.TensorProto],
        table: Table | None = None,
    ) -> tuple[list[onnx.NodeProto], int | None]:
        """The nodes replacing ``node`` ([Cast, Transpose, Mul,] core [, Cast, Unsqueeze, Add]) and core's bytes.

        With ``table`` (a tied LM head) the op reads the table's codes and scales as inputs.
        """
        base = node.name or f"{node.output[0]}/{OP_TYPE}"
        nodes: list[onnx.NodeProto] = []
        x = node.input[0]
        cast = plan.elem_type != onnx.TensorProto.FLOAT
        if cast:
            if x not in casts:
                casts[x] = self.fresh(f"{x}/float32")
                nodes.append(
                    helper.make_node("Cast", [x], [casts[x]], name=f"{base}/cast_in", to=onnx.TensorProto.FLOAT)
                )
            x = casts[x]
        if plan.trans_a:
            t = self.fresh(f"{x}/transposed")
            nodes.append(helper.make_node("Transpose", [x], [t], name=f"{base}/transpose_a", perm=[1, 0]))
            x = t
        steps: list[tuple[str, list[str], dict]] = []
        if cast:
            steps.append(("Cast", [], {"to": plan.elem_type}))
        if plan.unsqueeze:
            axes = list(range(plan.unsqueeze))
            if self.opset >= 13:
                steps.append(
                    ("Unsqueeze", [self._constant(f"{base}/axes", np.array(axes, np.int64), initializers)], {})
                )
            else:
                steps.append(("Unsqueeze", [], {"axes": axes}))
        if plan.add is not None:
            steps.append(("Add", [self._scaled_c(base, plan, nodes, initializers)], {}))

        y = node.output[0]
        out = self.fresh(f"{y}/{OP_TYPE}") if steps else y
        core, after = self.core(base, key, x, out, plan, initializers, table)
        nodes.extend(core)
        for i, (op, extra, attributes) in enumerate(steps):
            nxt = y if i == len(steps) - 1 else self.fresh(f"{y}/{op.lower()}")
            nodes.append(helper.make_node(op, [out, *extra], [nxt], name=f"{base}/{op.lower()}", **attributes))
            out = nxt
        return nodes, after

    def core(
        self,
        base: str,
        key: str,
        x: str,
        out: str,
        plan: Plan,
        initializers: list[onnx.TensorProto],
        table: Table | None = None,
    ) -> tuple[list[onnx.NodeProto], int | None]:
        """The CimInt4MatMul computing ``out = x @ W (+ bias)`` and its weight bytes; tensors go to ``tensors`` as made.

        A subclass returns None for the bytes when its node is not an INT4 one (the summary then skips it).
        A tied head (``table``) reads the table's two initializers as inputs and adds no weight bytes.
        """
        o = self.options
        if table is not None:
            qw = self.tables.quantize(table)
            self.widths_used[key] = qw.bits
            inputs = (x, table.packed_name, table.scales_name) + ((table.super_name,) if table.super_name else ())
            op = SharedInt4Node(
                base, inputs, (out,), qw.k, qw.group_size, MATMUL_SHARED, qw.n, plan.bias, o.node_compute, qw.bits,
                qw.grid,
            ).to_node()
            return [op], 0 if plan.bias is None else plan.bias.nbytes
        node = self.int4_node(base, key, x, out, plan)
        return [self.written(node)], node.nbytes

    def int4_node(self, base: str, key: str, x: str, out: str, plan: Plan) -> Int4Node:
        """The CimInt4MatMul of ``out = x @ W (+ bias)``, its weight quantized (or taken from ``quantized``)."""
        o = self.options
        bits = width_of(o.bits, key, base)
        qw = self.quantized.get(key) or quantize_weight(
            plan.w, self.group_size, o.scale_rule, bits, o.scale_dtype, grid_of(o.grid, bits)
        )
        self.widths_used[key] = qw.bits
        return Int4Node(
            base, (x,), (out,), qw.k, qw.n, qw.group_size, qw.packed, qw.scales, plan.bias, o.node_compute,
            bits=qw.bits, super_scales=qw.super_scales, grid=qw.grid,
        )


def _direct(plan: Plan) -> bool:
    """Whether the node becomes the op alone (float32, no Transpose, Unsqueeze or Add around it)."""
    return plan.elem_type == onnx.TensorProto.FLOAT and not plan.trans_a and not plan.unsqueeze and plan.add is None


def run_rewrite(
    model: onnx.ModelProto,
    options: ExportOptions,
    make: Callable[[onnx.ModelProto], Rewriter],
    in_place: bool = False,
) -> tuple[onnx.ModelProto, Rewriter]:
    """Rewrite a copy of ``model`` (``model`` itself if ``in_place``) with the Rewriter ``make(copy)``; both."""
    if in_place:
        out = model
    else:
        out = onnx.ModelProto()
        out.CopyFrom(model)
    dropped = drop_stray_imports(out)
    rewriter = make(out)
    summary = rewriter.summary
    summary.warnings.extend(dropped)
    rewriter.rewrite_graph(out.graph, None, "")
    out.graph.initializer.extend(rewriter.tables.initializers)

    if rewriter.folded:
        folded_inputs = rewriter.folded & rewriter.overridable
        drop_unused(out.graph, rewriter.folded, folded_inputs)
        if folded_inputs and options.fold_input_initializers is None:
            names = ", ".join(sorted(folded_inputs)[:3]) + (", ..." if len(folded_inputs) > 3 else "")
            summary.warnings.append(
                f"quantized {len(folded_inputs)} initializer(s) also listed as graph inputs ({names}): feeding "
                "them no longer changes the weights; fold_input_initializers=False keeps them FP32"
            )
    if summary.rewritten and not any(o.domain == OP_DOMAIN for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid(OP_DOMAIN, OP_VERSION))
    if _has_grid(out.graph):  # codes an op library from before grids would read as uniform: it must refuse
        for o in out.opset_import:
            if o.domain == OP_DOMAIN:
                o.version = GRID_OP_VERSION
    return out, rewriter


def _has_grid(graph: onnx.GraphProto) -> bool:
    """Whether a node of the library in ``graph`` (or a subgraph) has a non-uniform ``grid``."""
    for node in graph.node:
        for a in node.attribute:
            if node.domain == OP_DOMAIN and a.name == ATTR_GRID and a.s.decode() != DEFAULT_GRID:
                return True
            if a.type == onnx.AttributeProto.GRAPH and _has_grid(a.g):
                return True
            if any(_has_grid(g) for g in a.graphs):
                return True
    return False


def rewrite_model(
    model: onnx.ModelProto,
    options: ExportOptions | None = None,
    *,
    keep: Mapping[str, str] | None = None,
    quantized: Mapping[str, QuantizedWeight] | None = None,
    tensors: TensorIO | None = None,
    table_widths: Mapping[str, int] | None = None,
    in_place: bool = False,
) -> tuple[onnx.ModelProto, ExportSummary]:
    """A copy of ``model`` with every eligible MatMul/Gemm replaced by CimInt4MatMul, and the summary.

    ``keep`` maps node keys (subgraph path + label, as in the summary) to leave in FP32 to the
    reason the summary gives; ``quantized`` holds weights already quantized (by key) with the same options.
    ``tensors`` reads weights held outside the proto and takes each new attribute tensor as it
    is made (the exporter streams them to the output file); by default everything is inline.
    ``table_widths`` maps embedding tables (their Gather's data input) to a width (``bits="auto"``).
    ``in_place``: rewrite ``model`` itself (no copy of its weights; the caller is done with it).
    """
    options = options or ExportOptions()
    out, rewriter = run_rewrite(
        model, options, lambda m: Rewriter(m, options, keep, quantized, tensors, table_widths), in_place
    )
    return out, rewriter.summary
