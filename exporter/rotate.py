"""rotate_residual: fold each RMS norm's weight into its readers and turn the residual stream by an orthogonal Q.

A decoder whose residual stream only meets RMS norms (Llama, Qwen, SmolLM: the norm
before each attention and MLP, the final one) computes the same function after

* every RMS norm's weight ``g`` set to ones, ``diag(g)`` folded into the MatMuls reading
  the normalized output: ``W <- Q^T diag(g) W``;
* every MatMul writing into the stream (attention out, MLP down) ``W <- W Q``;
* the token embedding ``T <- T Q``;

because an RMS norm commutes with an orthogonal map (``rms(x Q) = rms(x)``) and the epsilon
sees the same sum of squares. Nothing is added at run time, except for an LM head tied to the
embedding: the one table holds ``Q^T W``, so the final norm's weight goes into one MatMul
by ``Q^T diag(g) Q`` (hidden x hidden) in front of the head (``ROTATION_FOLD``), which the
exporter quantizes at ``FOLD_BITS`` (SmolLM2-135M: 0.02 bits per weight of the model, 0.08 in FP32).

Why: a random rotation spreads each weight row's few large entries over all of it, so a
group's scale is no longer set by one outlier; with GPTQ on SmolLM2-135M it took the perplexity
gap at 3 bits from 6.55x to 2.10x uniform 4-bit RTN's, at 4 bits from 0.54x to 0.31x
(docs/widths.md, "Rotation"). Round to nearest ignores the activations and lost far more.
Q is a random orthogonal matrix (QR of a Gaussian, float64, a fixed seed), so an export is
reproducible. A graph this pass does not recognise is refused in one line naming the node
(a post-norm, as Gemma's, puts a norm's weight on a branch, where it does not fold).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import onnx
from onnx import helper, numpy_helper


class NormSlots(NamedTuple):
    """Where an RMS norm op keeps its weight input, its stream inputs and the output carrying the stream on."""

    weight: int
    stream_inputs: tuple[int, ...]
    carry: int | None  # Skip*: output 3 = input + skip; None: the op has no such output


# (domain, op type) of each RMS norm op. ORT registers SimplifiedLayerNormalization in the ONNX domain.
RMS_NORMS = {
    ("", "SimplifiedLayerNormalization"): NormSlots(1, (0,), None),
    ("com.microsoft", "SimplifiedLayerNormalization"): NormSlots(1, (0,), None),
    ("", "RMSNormalization"): NormSlots(1, (0,), None),
    ("com.microsoft", "SkipSimplifiedLayerNormalization"): NormSlots(2, (0, 1), 3),
}
ROTATION_FOLD = "rotation/final_norm_fold"  # the MatMul in front of a tied LM head
FOLD_BITS = 8  # its width unless ``bits`` names it: it feeds the head directly, and 8-bit codes are near exact
DEFAULT_SEED = 0


class NotRotatable(ValueError):
    """The graph's residual stream is not one this pass can turn (the message names the node)."""


def orthogonal(n: int, seed: int = DEFAULT_SEED) -> np.ndarray:
    """A random n x n orthogonal matrix (float64): Q of a Gaussian's QR, columns signed by R's diagonal."""
    q, r = np.linalg.qr(np.random.default_rng(seed).standard_normal((n, n)))
    return q * np.sign(np.diag(r))[None, :]


@dataclass
class RotationSummary:
    """What rotate_residual changed: counts for the export summary."""

    hidden: int
    norms: int
    readers: int  # MatMuls reading a normalized stream (Q^T diag(g) W)
    writers: int  # MatMuls writing into the stream (W Q)
    tables: int  # embedding tables (T Q)
    fold_node: str  # ROTATION_FOLD's node name, or "" (no tied head)

    def format(self) -> str:
        fold = f"; tied head behind {self.fold_node!r}" if self.fold_node else ""
        return (
            f"rotation: hidden {self.hidden}, {self.norms} RMS norms folded, {self.readers} reading and "
            f"{self.writers} writing MatMuls, {self.tables} embedding table(s){fold}"
        )


def rotate_residual(model: onnx.ModelProto, seed: int = DEFAULT_SEED) -> RotationSummary:
    """Turn ``model``'s residual stream (weights in memory, main graph) in place; NotRotatable if it cannot."""
    return _Rotation(model.graph).apply(seed)


class _Rotation:
    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.inits = {t.name: t for t in graph.initializer}
        self.producer = {o: n for n in graph.node for o in n.output if o}
        self.consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = defaultdict(list)
        for n in graph.node:
            for i, name in enumerate(n.input):
                if name:
                    self.consumers[name].append((n, i))
        self.outputs = {o.name for o in graph.output}

    def fail(self, node: onnx.NodeProto | None, what: str) -> NotRotatable:
        where = f"{self.label(node)}: " if node is not None else ""
        return NotRotatable(f"rotate: {where}{what}")

    def weight(self, node: onnx.NodeProto, index: int) -> str:
        """The initializer name of ``node``'s input ``index`` (a float 2-D constant), else NotRotatable."""
        name = node.input[index] if index < len(node.input) else ""
        init = self.inits.get(name)
        if init is None or len(init.dims) != 2 or init.data_type != onnx.TensorProto.FLOAT:
            raise self.fail(node, f"input {index} {name!r} is not a 2-D float32 initializer")
        return name

    def apply(self, seed: int) -> RotationSummary:
        norms, tables, writers = self.trace()
        gammas = {id(norm): self.norm_weight(norm) for norm in norms}
        readers: list[tuple[onnx.NodeProto, str]] = []  # (MatMul reading a normalized stream, its norm's weight)
        for norm in norms:
            carry = RMS_NORMS[(norm.domain, norm.op_type)].carry
            for i, out in enumerate(norm.output):
                if not out or i == carry:
                    continue
                if i == 0:
                    for reader, slot in self.consumers[out]:
                        if reader.op_type != "MatMul" or reader.domain != "" or slot != 0:
                            raise self.fail(reader, "reads a normalized stream but is not a MatMul by a weight")
                        readers.append((reader, gammas[id(norm)]))
                    if out in self.outputs:
                        raise self.fail(norm, "its normalized output is a graph output")
                elif self.consumers[out] or out in self.outputs:
                    raise self.fail(norm, f"output {i} (the mean or the inverse deviation) is used")
        read: dict[str, list[tuple[onnx.NodeProto, str]]] = defaultdict(list)
        for reader, gamma in readers:
            read[self.weight(reader, 1)].append((reader, gamma))
        written: dict[str, onnx.NodeProto] = {}
        for writer in writers:
            name = self.weight(writer, 1)
            if name in written:
                raise self.fail(writer, f"weight {name!r} is shared with {self.label(written[name])}")
            written[name] = writer
        # Every check before the first weight changes: a refusal leaves the model as it was.
        for name in set(written) | set(read) | set(tables):
            mine = [r for r, _ in read.get(name, [])]
            if name in written:  # a writer's weight turns on its output side: no other node may share it
                mine = [n for n in mine if n is not written[name]]
                if mine:
                    raise self.fail(mine[0], f"weight {name!r} is shared with the writer {self.label(written[name])}")
                mine = [written[name]]
            if name in tables:  # its Gather, and the Transpose in front of it if any
                gather = tables[name]
                if name in written:
                    raise self.fail(gather, f"table {name!r} is also a weight writing into the stream")
                if name in read and not self.through_transpose(gather):
                    raise self.fail(gather, f"table {name!r} is also a MatMul weight without a Transpose")
                if len(read.get(name, [])) > 1:
                    heads = len(read[name])
                    raise self.fail(gather, f"the tied table {name!r} is read by {heads} MatMuls; rotation takes one")
                mine += [gather, self.producer[gather.input[0]]] if self.through_transpose(gather) else [gather]
            others = [n for n, _ in self.consumers[name] if all(n is not m for m in mine)]
            if others:
                raise self.fail(others[0], f"shares weight {name!r} with the MatMuls rotation turns")
            if name not in tables and len({g for _, g in read.get(name, [])}) > 1:
                raise self.fail(read[name][0][0], f"weight {name!r} is read after norms with different weights")
        hidden = self.hidden(read, written, tables)
        for norm in norms:
            if self.dims(gammas[id(norm)]) != (hidden,):
                gamma = gammas[id(norm)]
                raise self.fail(norm, f"its weight {gamma!r} has shape {list(self.dims(gamma))}, not [{hidden}]")
        q = orthogonal(hidden, seed)
        fold = ""
        for name, gather in tables.items():
            if self.through_transpose(gather):  # the table is value.T: rows (value.T) Q = (Q^T value).T
                self.store(name, q.T @ self.array(name))
            else:
                self.store(name, self.array(name) @ q)
            if name in read:
                fold = self.fold_tied_head(read.pop(name)[0], q)
        # A MatMul may read a normalized stream and write into the stream: both sides turn.
        for name in set(read) | set(written):
            value = self.array(name)
            if name in read:
                value = q.T @ (self.array(read[name][0][1])[:, None] * value)
            if name in written:
                value = value @ q
            self.store(name, value)
        for gamma in gammas.values():
            self.store(gamma, np.ones(self.dims(gamma)))
        return RotationSummary(hidden, len(norms), len(readers), len(writers), len(tables), fold)

    def label(self, node: onnx.NodeProto) -> str:
        return f"node {node.name or node.output[0]!r} ({node.op_type})"

    def norm_weight(self, norm: onnx.NodeProto) -> str:
        """The norm's weight initializer, after checking the norm commutes with a rotation."""
        slots = RMS_NORMS[(norm.domain, norm.op_type)]
        axis = next((a.i for a in norm.attribute if a.name == "axis"), -1)
        if axis != -1:
            raise self.fail(norm, f"normalizes axis {axis}; rotation needs the last axis")
        if any(norm.input[slots.weight + 1 :]):
            raise self.fail(norm, "has a bias input; an RMS norm with a bias does not commute with a rotation")
        name = norm.input[slots.weight] if slots.weight < len(norm.input) else ""
        init = self.inits.get(name)
        if init is None or len(init.dims) != 1 or init.data_type != onnx.TensorProto.FLOAT:
            raise self.fail(norm, f"its weight {name!r} is not a 1-D float32 initializer")
        if len(self.consumers[name]) != 1:
            raise self.fail(norm, f"its weight {name!r} is shared with other nodes")
        return name

    def trace(self) -> tuple[list[onnx.NodeProto], dict[str, onnx.NodeProto], list[onnx.NodeProto]]:
        """The residual stream from the embedding: its RMS norms, its tables (initializer -> Gather), its writers.

        It starts at each Gather on a float table (the token embedding) and follows the norms' carried
        sums (Skip*: input + skip); every other tensor a norm adds in must be a MatMul's output.
        Norms off the stream (a per-head q/k norm) are left as they are.
        """
        for node in self.graph.node:  # a subgraph's reads of the stream would go unseen
            if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
                raise self.fail(node, "holds a subgraph; rotation takes graphs without If/Loop/Scan")
        starts = [n for n in self.graph.node if n.op_type == "Gather" and n.domain == "" and self.is_table(n)]
        if not starts:
            raise self.fail(None, "no Gather on a 2-D float32 table (the token embedding) starts a residual stream")
        norms: list[onnx.NodeProto] = []
        tables: dict[str, onnx.NodeProto] = {}
        writers: list[onnx.NodeProto] = []
        stream: set[str] = set()
        reached: set[int] = set()  # ids of the norms in ``norms``
        frontier = [g.output[0] for g in starts]
        while frontier:
            name = frontier.pop()
            if name in stream:
                continue
            stream.add(name)
            node = self.producer.get(name)
            if node is None:
                what = "an initializer" if name in self.inits else "a graph input"
                raise self.fail(None, f"the residual stream tensor {name!r} is {what}")
            kind = (node.domain, node.op_type)
            if kind in RMS_NORMS and name != node.output[0]:
                pass  # a carried sum: its norm is reached through its inputs
            elif kind in RMS_NORMS:
                raise self.fail(
                    node, "its normalized output joins the residual stream (a post-norm: its weight cannot fold)"
                )
            elif kind == ("", "Gather"):
                tables[self.table_source(node)] = node
            elif kind == ("", "MatMul"):
                writers.append(node)
            else:
                raise self.fail(node, "writes into the residual stream but is neither a Gather on a table nor a MatMul")
            if name in self.outputs:
                raise self.fail(node, f"the residual stream {name!r} is a graph output")
            for reader, slot in self.consumers[name]:
                kind = (reader.domain, reader.op_type)
                if kind not in RMS_NORMS or slot not in RMS_NORMS[kind].stream_inputs:
                    raise self.fail(reader, f"reads the residual stream {name!r} but is not an RMS norm")
                if id(reader) not in reached:
                    reached.add(id(reader))
                    norms.append(reader)
                    carry = RMS_NORMS[kind].carry
                    frontier += [reader.input[i] for i in RMS_NORMS[kind].stream_inputs]
                    if carry is not None and len(reader.output) > carry and reader.output[carry]:
                        frontier.append(reader.output[carry])
        return norms, tables, writers

    def through_transpose(self, gather: onnx.NodeProto) -> bool:
        return gather.input[0] not in self.inits

    def is_table(self, gather: onnx.NodeProto) -> bool:
        try:
            self.table_source(gather)
        except NotRotatable:
            return False
        return True

    def table_source(self, gather: onnx.NodeProto) -> str:
        """The initializer a Gather's table is (directly, or behind one 2-D Transpose), else NotRotatable."""
        axis = next((a.i for a in gather.attribute if a.name == "axis"), 0)
        data = gather.input[0]
        if axis != 0:
            raise self.fail(gather, f"gathers along axis {axis}; an embedding gathers rows (axis 0)")
        if data in self.inits:
            return self.weight(gather, 0)
        node = self.producer.get(data)
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), [1, 0]) if node is not None else None
        if node is None or node.op_type != "Transpose" or perm != [1, 0] or len(self.consumers[data]) != 1:
            raise self.fail(gather, f"its table {data!r} is neither an initializer nor one behind a Transpose")
        return self.weight(node, 0)

    def hidden(self, read: dict, written: dict, tables: dict[str, onnx.NodeProto]) -> int:
        """The stream's width, on which every turned weight agrees: readers' rows, writers' columns, tables'."""
        sizes = {self.dims(name)[0] for name in read} | {self.dims(name)[1] for name in written}
        for name, gather in tables.items():
            rows, cols = self.dims(name)
            sizes.add(rows if self.through_transpose(gather) else cols)
        if len(sizes) != 1:
            raise self.fail(None, f"the MatMuls on the residual stream disagree on its width ({sorted(sizes)})")
        return sizes.pop()

    def fold_tied_head(self, head_and_gamma: tuple[onnx.NodeProto, str], q: np.ndarray) -> str:
        """Put Q^T diag(g) Q in front of the head reading the tied table (which now holds Q^T W)."""
        head, gamma = head_and_gamma
        g = self.array(gamma)
        fold = (q.T * g[None, :]) @ q
        weight, out = f"{ROTATION_FOLD}.weight", f"{ROTATION_FOLD}/output_0"
        self.graph.initializer.append(numpy_helper.from_array(fold.astype(np.float32), weight))
        node = helper.make_node("MatMul", [head.input[0], weight], [out], name=ROTATION_FOLD)
        head.input[0] = out
        nodes = list(self.graph.node)
        nodes.insert(nodes.index(head), node)
        del self.graph.node[:]
        self.graph.node.extend(nodes)
        return ROTATION_FOLD

    def dims(self, name: str) -> tuple[int, ...]:
        return tuple(self.inits[name].dims)

    def array(self, name: str) -> np.ndarray:
        return numpy_helper.to_array(self.inits[name]).astype(np.float64)

    def store(self, name: str, value: np.ndarray) -> None:
        self.inits[name].CopyFrom(numpy_helper.from_array(value.astype(np.float32), name))
