"""AWQ: per-input-channel scales ``s`` searched on the calibration inputs, folded into the producer of the input.

``y = x @ W = (x / s) @ (diag(s) W)``: the weight quantized is ``diag(s) W``, so the input
channels that carry large activations get finer steps (Lin et al., 2023). The search tries
``s = mean|x|^alpha`` (normalised to a geometric mean of 1) for alpha in ``ALPHAS`` and keeps
the one whose quantized weight gives the least output error on the calibration rows,
``tr(E^T H E)`` with ``E = Q(diag(s) W) / s - W`` and ``H = sum x x^T`` (exact for the layer,
computed from the calibration statistics; alpha 0 is plain rounding, so the search never
does worse on them). Layers that read the same tensor (q, k, v) share one ``s``.

``1 / s`` must be applied to ``x`` without an extra node, where that is exact (``find_sites``):

* the gain (and bias) of a LayerNormalization / RMSNormalization (also ORT's Simplified /
  Skip variants) whose first output is ``x``;
* the constant of a ``Mul(a, c)`` (an RMSNorm written out, say);
* the output columns of a MatMul with a constant weight that makes ``x``, or that makes one
  operand of the ``Mul`` that makes ``x`` (a gated MLP's ``act(gate) * up``), when nothing
  else reads that MatMul's output.

Every reader of ``x`` must be a MatMul the export quantizes; the scaled tensors are written as
new initializers (the originals stay for their other readers, or are dropped when unread),
so the transformed model computes the same function in FP32 as the original.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from .calibration import Stats
from .fold import DEFAULT_DOMAINS, NotFoldable, Scope
from .quantize import DEFAULT_SCALE_DTYPE, quantize
from .subgraph import all_graphs, defined_names, drop_unused

ALPHAS = tuple(i / 20 for i in range(20))
# Output channels the search looks at per layer input (a random subset of the readers' columns): each
# alpha costs 2 K^2 of these in tr(E^T H E), which dominates the export's time (SmolLM2: 2048 took
# longer than the GPTQ export).
SEARCH_COLUMNS = 512

# Normalisations whose first output is ``gain * normalized (+ bias)``: op -> inputs scaled with it.
_GAINS = {
    ("", "LayerNormalization"): (1, 2),
    ("", "RMSNormalization"): (1,),
    ("", "SimplifiedLayerNormalization"): (1,),  # ORT registers it in the ONNX domain
    ("com.microsoft", "LayerNormalization"): (1, 2),
    ("com.microsoft", "SimplifiedLayerNormalization"): (1,),
    ("com.microsoft", "SkipLayerNormalization"): (2, 3),
    ("com.microsoft", "SkipSimplifiedLayerNormalization"): (2,),
}


@dataclass(frozen=True)
class Site:
    """Where the inverse scale of layer input ``x`` goes: inputs of ``node`` divided along the last axis."""

    x: str
    readers: tuple[int, ...]  # main-graph node indices of the MatMuls reading x
    node: int  # the producer (gain/Mul) or the MatMul whose weight columns are divided
    inputs: tuple[int, ...]  # which of its inputs


def _domain(node: onnx.NodeProto) -> str:
    return "" if node.domain in DEFAULT_DOMAINS else node.domain


def _initializer(graph: onnx.GraphProto, name: str, size: int) -> bool:
    """True if ``name`` is a plain (not overridable) float initializer of ``graph``, last axis 1 or ``size``."""
    inputs = {i.name for i in graph.input}
    for t in graph.initializer:
        if t.name == name and name not in inputs and t.data_type == onnx.TensorProto.FLOAT:
            dims = list(t.dims)
            return (dims == [] or all(d == 1 for d in dims[:-1])) and (not dims or dims[-1] in (1, size))
    return False


def find_sites(model: onnx.ModelProto, quantized: Mapping[int, int]) -> list[Site]:
    """Layer inputs of the main graph whose inverse scale folds exactly; ``quantized``: MatMul node index -> K."""
    graph = model.graph
    producer = {o: i for i, n in enumerate(graph.node) for o in n.output if o}
    readers: dict[str, list[tuple[int, int]]] = {}
    for g in all_graphs(graph):
        for i, n in enumerate(graph.node if g is graph else g.node):
            for slot, name in enumerate(n.input):
                readers.setdefault(name, []).append((i if g is graph else -1, slot))
    for o in graph.output:
        readers.setdefault(o.name, []).append((-1, 0))
    scope = Scope(graph, fold_inputs=False)

    def exclusive(name: str, reader: int) -> bool:
        return all(r == reader for r, _ in readers.get(name, []))

    def const_matmul(index: int, k: int) -> bool:
        node = graph.node[index]
        if _domain(node) or node.op_type != "MatMul":
            return False
        try:
            w = scope.resolve(node.input[1])
        except NotFoldable:
            return False
        return w.elem_type == onnx.TensorProto.FLOAT and w.value.ndim == 2 and w.value.shape[1] == k

    sites = []
    groups: dict[str, list[int]] = {}
    for index in quantized:
        groups.setdefault(graph.node[index].input[0], []).append(index)
    for x, group in groups.items():
        k = quantized[group[0]]
        uses = readers.get(x, [])
        if x not in producer or any(r not in group or slot != 0 for r, slot in uses):
            continue
        p = producer[x]
        node = graph.node[p]
        key = (_domain(node), node.op_type)
        site = None
        if key in _GAINS and node.output[0] == x:
            scaled = tuple(i for i in _GAINS[key] if i < len(node.input) and node.input[i])
            if all(_initializer(graph, node.input[i], k) for i in scaled) and _axis_last(node):
                site = Site(x, tuple(group), p, scaled)
        elif key == ("", "Mul"):
            consts = [i for i in (0, 1) if _initializer(graph, node.input[i], k)]
            if len(consts) == 1 and not scope.is_constant(node.input[1 - consts[0]]):
                site = Site(x, tuple(group), p, (consts[0],))
            elif not consts:
                for i in (0, 1):
                    m = producer.get(node.input[i])
                    if m is not None and exclusive(node.input[i], p) and const_matmul(m, k):
                        site = Site(x, tuple(group), m, (1,))
                        break
        elif key == ("", "MatMul") and const_matmul(p, k):
            site = Site(x, tuple(group), p, (1,))
        if site is not None:
            sites.append(site)
    return sites


def _axis_last(node: onnx.NodeProto) -> bool:
    for a in node.attribute:
        if a.name == "axis":
            return a.i == -1
    return True  # every op in _GAINS defaults to the last axis


def fake_quantize(
    w: np.ndarray, group_size: int, scale_rule: str, scale_dtype: str = DEFAULT_SCALE_DTYPE
) -> np.ndarray:
    """float64 [K, N]: ``w`` quantized with the contract's rounding and ``scale_dtype`` scales, dequantized."""
    k = w.shape[0]
    q, scales = quantize(w, group_size, scale_rule, scale_dtype=scale_dtype)
    deq = q.reshape(q.shape[0], -1, group_size).astype(np.float64) * scales[:, :, None]
    return deq.reshape(q.shape[0], -1)[:, :k].T


def search(
    weights: Sequence[np.ndarray],
    stats: Stats,
    group_size: int,
    scale_rule: str,
    scale_dtype: str = DEFAULT_SCALE_DTYPE,
) -> tuple[np.ndarray, float, float]:
    """The scale ``s`` [K] for a layer input read by ``weights`` (each [K, N_i]), its loss, and alpha 0's loss."""
    w = np.concatenate(weights, axis=1).astype(np.float32)
    if w.shape[1] > SEARCH_COLUMNS:
        cols = np.sort(np.random.default_rng(0).choice(w.shape[1], SEARCH_COLUMNS, replace=False))
        w = w[:, cols]
    h = stats.xtx
    mean = stats.mean_abs
    live = mean > 0
    best = (np.inf, np.ones(len(mean)))
    plain = np.inf
    for alpha in ALPHAS:
        s = np.ones(len(mean))
        if alpha and live.any():
            s[live] = mean[live] ** alpha
            s[live] /= np.exp(np.log(s[live]).mean())
            s[~live] = 1.0
        s = s.astype(np.float32)
        e = fake_quantize(w * s[:, None], group_size, scale_rule, scale_dtype) / s[:, None].astype(np.float64) - w
        loss = float(np.einsum("kn,kn->", h @ e, e))
        if alpha == 0:
            plain = loss
        if loss < best[0]:
            best = (loss, s)
    return best[1], best[0], plain


def apply_scales(model: onnx.ModelProto, sites: Sequence[Site], scales: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of ``model`` computing the same function with each site's ``x`` divided by ``scales[x]``.

    Readers' weights become ``diag(s) W`` and the producer's scaled inputs (or weight columns) ``/ s``,
    all as new initializers.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    names = defined_names(graph)
    scope = Scope(graph, fold_inputs=False)
    added: list[onnx.TensorProto] = []
    replaced: set[str] = set()
    values: dict[str, np.ndarray] = {}  # new tensors (a MatMul can be both a reader and a producer)

    def value(name: str) -> np.ndarray:
        return values[name] if name in values else scope.resolve(name).value.astype(np.float32)

    def put(node: onnx.NodeProto, slot: int, array: np.ndarray) -> None:
        base, i = f"{node.input[slot]}.awq", 0
        name = base
        while name in names:
            i += 1
            name = f"{base}{i}"
        names.add(name)
        values[name] = np.ascontiguousarray(array, dtype=np.float32)
        added.append(numpy_helper.from_array(values[name], name))
        replaced.add(node.input[slot])
        node.input[slot] = name

    for site in sites:
        s = scales.get(site.x)
        if s is None or np.all(s == 1):
            continue
        s = np.asarray(s, dtype=np.float32)
        for r in site.readers:
            node = graph.node[r]
            put(node, 1, value(node.input[1]) * s[:, None])
        node = graph.node[site.node]
        for slot in site.inputs:
            old = value(node.input[slot])
            if node.op_type == "MatMul":
                put(node, slot, old / s[None, :])
            else:
                # A gain [K] (or a Mul's [1, .., K] or scalar constant) becomes [.., K]: same broadcast, same rank.
                shape = [*old.shape[:-1], len(s)] if old.ndim else [len(s)]
                put(node, slot, (np.broadcast_to(old.reshape(-1), s.shape) / s).reshape(shape))
    graph.initializer.extend(added)
    drop_unused(graph, replaced, set())
    return out


def transformed_stats(stats: Stats, s: np.ndarray) -> Stats:
    """The statistics of ``x / s`` from those of ``x``."""
    inv = 1.0 / np.asarray(s, dtype=np.float64)
    return Stats(stats.xtx * inv[:, None] * inv[None, :], stats.abs_sum * inv, stats.rows)


__all__ = ["ALPHAS", "Site", "apply_scales", "fake_quantize", "find_sites", "search", "transformed_stats"]
