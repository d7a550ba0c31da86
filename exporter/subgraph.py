"""Walking a model's graphs (the main graph and If/Loop/Scan bodies, nested) and tidying them after a rewrite."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import onnx

from .fold import DEFAULT_DOMAINS, FOLDABLE


def subgraphs(node: onnx.NodeProto) -> Iterator[tuple[str, onnx.GraphProto]]:
    """(attribute label, body) of each graph attribute of ``node``: ``then_branch``, ``body``, ``branches[1]``."""
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.name, attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            for i, g in enumerate(attr.graphs):
                yield f"{attr.name}[{i}]", g


def all_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every graph nested in it, outer before inner."""
    stack = [graph]
    while stack:
        g = stack.pop()
        yield g
        for node in g.node:
            stack.extend(body for _, body in subgraphs(node))


def used_names(graph: onnx.GraphProto) -> set[str]:
    """Every tensor name read by a node of ``graph`` or of its subgraphs, and every (sub)graph output."""
    used: set[str] = set()
    for g in all_graphs(graph):
        used.update(i for n in g.node for i in n.input if i)
        used.update(o.name for o in g.output)
    return used


def defined_names(graph: onnx.GraphProto) -> set[str]:
    """Every tensor name defined anywhere in the model: inputs, initializers and node outputs of all graphs."""
    names: set[str] = set()
    for g in all_graphs(graph):
        names.update(i.name for i in g.input)
        names.update(t.name for t in g.initializer)
        names.update(o for n in g.node for o in n.output if o)
    return names


def uses_domain(model: onnx.ModelProto, domain: str) -> bool:
    """True if a node of any graph or local function of ``model`` is in ``domain``."""
    nodes = [n for g in all_graphs(model.graph) for n in g.node]
    nodes += [n for f in model.functions for n in f.node]
    return any(n.domain == domain for n in nodes)


def _remove(repeated, drop: Callable[[object], bool]) -> bool:  # noqa: ANN001 - a protobuf repeated field
    """Delete the elements ``drop`` selects, in place: no copy of the (possibly large) elements kept."""
    doomed = [i for i, item in enumerate(repeated) if drop(item)]
    for i in reversed(doomed):
        del repeated[i]
    return bool(doomed)


def drop_unused(graph: onnx.GraphProto, folded: set[str], folded_inputs: set[str]) -> None:
    """Remove what the rewrite left unread: initializers, Constant nodes, fold-chain nodes in ``folded``.

    Nodes still read by another consumer stay. Graph inputs are removed only for the
    initializers in ``folded_inputs`` (listed as inputs, folded into a quantized weight).
    Repeats until nothing changes, since dropping one link of a chain frees the next.
    """
    changed = True
    while changed:
        changed = False
        used = used_names(graph)
        for g in all_graphs(graph):
            inputs = {i.name for i in g.input} - (folded_inputs if g is graph else set())
            read = used | inputs
            changed |= _remove(g.initializer, lambda t, read=read: t.name not in read)
            changed |= _remove(g.node, lambda n, used=used: _droppable(n, folded, used))
        gone = folded_inputs - {t.name for t in graph.initializer}
        _remove(graph.input, lambda i, gone=gone: i.name in gone)
    for g in all_graphs(graph):
        names = {t.name for t in g.initializer} | {o for n in g.node for o in n.output} | {i.name for i in g.input}
        _remove(g.value_info, lambda v, names=names: v.name not in names)


def _droppable(node: onnx.NodeProto, folded: set[str], used: set[str]) -> bool:
    if node.domain not in DEFAULT_DOMAINS or any(o in used for o in node.output if o):
        return False
    if node.op_type == "Constant":
        return True
    return node.op_type in FOLDABLE and any(o in folded for o in node.output)
