"""NumPy forward and backward of a decoder graph in plain ONNX (a dequantized twin), for training group scales.

Scale tuning (docs/methods.md "Scale tuning") needs the gradient of a loss on the logits with respect
to every quantized weight; ONNX Runtime has no backward pass here and torch is no dependency. So
this module runs the graph itself: one prompt window, an empty past, the ops of onnxruntime-genai's
decoders (``GroupQueryAttention`` with its rotary, ``SkipSimplifiedLayerNormalization``; Gemma 3's
Split, Reshape, tanh Gelu and local windows) and the plain ops of the dequantized twin (MatMul,
Gather, the gate's Slice / Sigmoid / Mul). Any other op is a one-line error naming the node.
``forward`` keeps what ``backward`` needs (a tape); ``backward`` returns the gradients of the named
initializers only.

Checked against ONNX Runtime's forward and against finite differences (tests/test_tune_graph.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

Array = np.ndarray


def _attrs(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


class GraphError(ValueError):
    """What the NumPy decoder cannot run, in one line naming the node."""


def _name(node: onnx.NodeProto) -> str:
    """How errors name a node: its name, else its first output."""
    return node.name or (node.output[0] if node.output else "")


def _unbroadcast(g: Array, shape: tuple[int, ...]) -> Array:
    """``g`` summed over the axes a broadcast of ``shape`` added or stretched."""
    while g.ndim > len(shape):
        g = g.sum(0)
    for axis, d in enumerate(shape):
        if d == 1 and g.shape[axis] != 1:
            g = g.sum(axis, keepdims=True)
    return g


def _rms(x: Array, eps: float) -> Array:
    return 1 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def _rms_back(dy: Array, x: Array, r: Array, w: Array) -> Array:
    gw = dy * w
    return r * gw - x * r**3 * (gw * x).mean(-1, keepdims=True)


@dataclass
class _Attention:
    q: Array
    k: Array
    v: Array
    p: Array
    cos: Array
    sin: Array
    scale: float
    heads: int
    kv_heads: int
    packed: bool


def _rotate(x: Array, cos: Array, sin: Array) -> Array:
    h = x.shape[-1] // 2
    return np.concatenate([x[..., :h] * cos - x[..., h:] * sin, x[..., h:] * cos + x[..., :h] * sin], -1)


def _unrotate(g: Array, cos: Array, sin: Array) -> Array:
    h = g.shape[-1] // 2
    return np.concatenate([g[..., :h] * cos + g[..., h:] * sin, g[..., h:] * cos - g[..., :h] * sin], -1)


def _gqa(node: onnx.NodeProto, x: list[Array | None]) -> tuple[Array, _Attention]:
    """GroupQueryAttention, packed QKV or separate, empty past, causal (and local), rotary (half split) when asked."""
    a = _attrs(node)
    where = f"GroupQueryAttention node '{_name(node)}'"
    if (x[1] is None) != (x[2] is None):
        raise GraphError(f"{where}: a key input without a value input or the reverse")
    if x[3] is not None and x[3].shape[2] != 0:
        raise GraphError(f"{where}: a past of {x[3].shape[2]} tokens; scale tuning runs one window from an empty past")
    if a.get("rotary_interleaved") or a.get("softcap", 0.0):
        raise GraphError(f"{where}: interleaved rotary or a softcap; scale tuning supports neither")
    if a.get("smooth_softmax") or any(t is not None for t in x[9:]):
        raise GraphError(f"{where}: smooth softmax or position ids / attention bias inputs; scale tuning has none")
    batch, seq, width = x[0].shape
    if np.any(np.asarray(x[5]) != seq - 1) or int(np.asarray(x[6]).reshape(-1)[0]) != seq:
        raise GraphError(f"{where}: padded windows (an attention mask with zeros); scale tuning takes full windows")
    heads, kv_heads = int(a["num_heads"]), int(a["kv_num_heads"])
    packed = x[1] is None
    hd = width // (heads + 2 * kv_heads) if packed else width // heads
    heads_of = lambda t, n: t.reshape(batch, seq, n, hd).transpose(0, 2, 1, 3)  # noqa: E731
    if packed:
        qkv = x[0]
        split = lambda lo, n: heads_of(qkv[..., lo * hd : (lo + n) * hd], n)  # noqa: E731
        q, k, v = split(0, heads), split(heads, kv_heads), split(heads + kv_heads, kv_heads)
    else:
        q, k, v = heads_of(x[0], heads), heads_of(x[1], kv_heads), heads_of(x[2], kv_heads)
    cos = sin = np.zeros(0, q.dtype)
    if a.get("do_rotary"):
        cos, sin = (np.asarray(t[:seq], q.dtype)[None, None] for t in (x[7], x[8]))
        if cos.shape[-1] != hd // 2 or cos.shape[2] != seq:
            raise GraphError(f"{where}: rotary caches {x[7].shape}, expected >= {seq} rows of {hd // 2} (full rotary)")
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    rep = heads // kv_heads
    k, v = np.repeat(k, rep, 1), np.repeat(v, rep, 1)
    scale = float(a.get("scale") or 0.0) or 1 / np.sqrt(hd)
    mask = np.triu(np.full((seq, seq), -np.inf, q.dtype), 1)
    window = int(a.get("local_window_size", -1))
    if window > 0:  # as ONNX Runtime's CPU kernel (measured): query i sees the ``window`` keys i - window + 1 .. i
        mask += np.tril(np.full((seq, seq), -np.inf, q.dtype), -window)
    s = q @ k.transpose(0, 1, 3, 2) * scale + mask
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = (p @ v).transpose(0, 2, 1, 3).reshape(batch, seq, heads * hd)
    return out, _Attention(q, k, v, p, cos, sin, scale, heads, kv_heads, packed)


def _gqa_back(do: Array, c: _Attention) -> list[Array]:
    """Gradients of GroupQueryAttention's inputs: [packed QKV] or [query, key, value]."""
    batch, heads, seq, hd = c.q.shape
    rep = heads // c.kv_heads
    do = do.reshape(batch, seq, heads, hd).transpose(0, 2, 1, 3)
    dv = c.p.transpose(0, 1, 3, 2) @ do
    dp = do @ c.v.transpose(0, 1, 3, 2)
    ds = c.p * (dp - (dp * c.p).sum(-1, keepdims=True)) * c.scale
    dq, dk = ds @ c.k, ds.transpose(0, 1, 3, 2) @ c.q
    dk = dk.reshape(batch, c.kv_heads, rep, seq, hd).sum(2)
    dv = dv.reshape(batch, c.kv_heads, rep, seq, hd).sum(2)
    if c.cos.size:
        dq, dk = _unrotate(dq, c.cos, c.sin), _unrotate(dk, c.cos, c.sin)
    pack = lambda t, n: t.transpose(0, 2, 1, 3).reshape(batch, seq, n * hd)  # noqa: E731
    grads = [pack(dq, heads), pack(dk, c.kv_heads), pack(dv, c.kv_heads)]
    return [np.concatenate(grads, -1)] if c.packed else grads


def _slice(x: Array, starts: Array, ends: Array, axes: Array | None) -> tuple[Array, tuple[slice, ...]]:
    index = [slice(None)] * x.ndim
    for i, (lo, hi) in enumerate(zip(starts, ends, strict=True)):
        axis = int(axes[i]) if axes is not None else i
        index[axis] = slice(int(lo), int(hi))
    return x[tuple(index)], tuple(index)


@dataclass
class _Step:
    node: onnx.NodeProto
    inputs: list[Array | None]
    outputs: list[Array | None]
    saved: object = None


# Ops on integer bookkeeping (the attention mask's lengths): run forward, never differentiated.
_NO_GRAD = {"Cast", "Shape", "ReduceSum", "Constant"}
SUPPORTED = (
    "MatMul", "Gather", "Transpose", "Sigmoid", "Mul", "Add", "Sub", "Slice", "Cast", "Shape", "ReduceSum",
    "Constant", "Reshape", "Split", "Gelu", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization",
    "GroupQueryAttention",
)  # fmt: skip
_GELU = np.sqrt(2 / np.pi)


def _gelu_tanh(x: Array) -> tuple[Array, Array]:
    """Gelu with the tanh approximation, and its derivative at ``x``."""
    u = _GELU * (x + 0.044715 * x**3)
    t = np.tanh(u)
    dt = (1 - t * t) * _GELU * (1 + 3 * 0.044715 * x * x)
    return 0.5 * x * (1 + t), 0.5 * (1 + t) + 0.5 * x * dt


def _reshape(node: onnx.NodeProto, x: Array, shape: Array) -> Array:
    dims = [int(d) for d in shape]
    if int(_attrs(node).get("allowzero", 0)) and 0 in dims:
        raise GraphError(f"Reshape node '{_name(node)}': allowzero=1; scale tuning takes 0 as 'keep this dimension'")
    return x.reshape([x.shape[i] if d == 0 else d for i, d in enumerate(dims)])


def check_ops(nodes: Iterable[onnx.NodeProto]) -> None:
    """Raise ValueError naming the first node whose op scale tuning does not run (attributes are checked as it runs)."""
    for node in nodes:
        if node.op_type not in SUPPORTED or node.domain not in ("", "ai.onnx", "com.microsoft"):
            runs = ", ".join(SUPPORTED)
            raise GraphError(f"node '{_name(node)}': op {node.op_type} is not one scale tuning runs ({runs})")


class Graph:
    """A plain-ONNX decoder run in NumPy: ``forward`` with some initializers replaced, ``backward`` on its tape."""

    def __init__(self, model: onnx.ModelProto, dtype: type = np.float32) -> None:
        self.nodes = []
        for node in model.graph.node:  # copies: a NodeProto kept would keep the whole model (and its weights) alive
            kept = onnx.NodeProto()
            kept.CopyFrom(node)
            self.nodes.append(kept)
        check_ops(self.nodes)
        self.dtype = dtype
        self.constants: dict[str, Array] = {}
        for t in model.graph.initializer:
            value = numpy_helper.to_array(t)
            self.constants[t.name] = value.astype(dtype) if value.dtype == np.float32 else value
        for node in self.nodes:
            if node.op_type == "Constant":
                self.constants[node.output[0]] = numpy_helper.to_array(_attrs(node)["value"])

    def forward(
        self, feeds: Mapping[str, Array], weights: Mapping[str, Array] | None = None
    ) -> tuple[dict[str, Array | None], list[_Step]]:
        """Every tensor's value (by name) and the tape, with ``weights`` in place of the initializers of those names."""
        values: dict[str, Array | None] = {**self.constants, **(weights or {}), **feeds}
        tape = []
        for node in self.nodes:
            if node.op_type == "Constant":
                continue
            try:
                x = [values[n] if n else None for n in node.input]
                outs, saved = self._run(node, x)
            except GraphError:
                raise
            except (ValueError, IndexError, KeyError, TypeError) as e:  # shapes NumPy refuses, a missing input
                raise GraphError(f"{node.op_type} node '{_name(node)}': {type(e).__name__}: {e}") from None
            for name, value in zip(node.output, outs, strict=False):
                if name:
                    values[name] = value
            tape.append(_Step(node, x, outs, saved))
        return values, tape

    def _run(self, node: onnx.NodeProto, x: list[Array | None]) -> tuple[list[Array | None], object]:
        op, a = node.op_type, _attrs(node)
        if op == "MatMul":
            return [x[0] @ x[1]], None
        if op == "Gather":
            if int(a.get("axis", 0)) != 0 and np.issubdtype(x[0].dtype, np.floating):
                raise GraphError(
                    f"Gather node '{_name(node)}': axis {a['axis']} of a float table; scale tuning takes rows"
                )
            return [np.take(x[0], x[1], axis=int(a.get("axis", 0)))], None
        if op == "Transpose":
            return [np.transpose(x[0], a.get("perm"))], None
        if op == "Sigmoid":
            return [1 / (1 + np.exp(-x[0]))], None
        if op in ("Mul", "Add", "Sub"):
            f: Callable[[Array, Array], Array] = {"Mul": np.multiply, "Add": np.add, "Sub": np.subtract}[op]
            return [f(x[0], x[1])], None
        if op == "Slice":
            if len(x) > 4 and x[4] is not None and np.any(np.asarray(x[4]) != 1):
                raise GraphError(f"Slice node '{_name(node)}': steps {x[4].tolist()}; scale tuning takes step 1 only")
            y, index = _slice(x[0], x[1], x[2], x[3] if len(x) > 3 else None)
            return [y], index
        if op == "Reshape":
            return [_reshape(node, x[0], x[1])], None
        if op == "Split":
            axis, n, dim = int(a.get("axis", 0)), len(node.output), x[0].shape[int(a.get("axis", 0))]
            sizes = x[1] if len(x) > 1 and x[1] is not None else a.get("split")
            if sizes is None:  # as ONNX: parts of ceil(dim / n), the last one smaller
                part = -(-dim // n)
                sizes = [part] * (n - 1) + [dim - part * (n - 1)]
            sizes = [int(v) for v in sizes]
            if len(sizes) != n or sum(sizes) != dim or min(sizes) < 0:
                raise GraphError(f"Split node '{_name(node)}': parts {sizes} of {dim} into {n} outputs")
            return np.split(x[0], np.cumsum(sizes)[:-1], axis=axis), None
        if op == "Gelu":
            if a.get("approximate", b"none") not in (b"tanh", "tanh"):
                raise GraphError(f"Gelu node '{_name(node)}': the exact (erf) form; scale tuning runs the tanh one")
            y, dy = _gelu_tanh(x[0])
            return [y], dy
        if op == "Cast":
            return [x[0].astype(helper.tensor_dtype_to_np_dtype(a["to"]))], None
        if op == "Shape":
            return [np.array(x[0].shape, np.int64)], None
        if op == "ReduceSum":
            axes = tuple(int(i) for i in x[1]) if len(x) > 1 and x[1] is not None else None
            return [x[0].sum(axis=axes, keepdims=bool(a.get("keepdims", 1)))], None
        if op == "SimplifiedLayerNormalization":
            r = _rms(x[0], float(a.get("epsilon", 1e-5)))
            return [x[0] * r * x[1]], r
        if op == "SkipSimplifiedLayerNormalization":
            s = x[0] + x[1] + (x[3] if len(x) > 3 and x[3] is not None else 0)
            r = _rms(s, float(a.get("epsilon", 1e-5)))
            return [s * r * x[2], None, None, s], (s, r)
        if op == "GroupQueryAttention":
            out, saved = _gqa(node, x)
            return [out, None, None], saved
        raise AssertionError(op)  # checked in __init__

    def backward(self, tape: list[_Step], grads: Mapping[str, Array], wanted: Iterable[str]) -> dict[str, Array]:
        """Gradients of the initializers ``wanted`` given the gradients ``grads`` of some tensors (e.g. the logits)."""
        wanted = set(wanted)
        g: dict[str, Array] = dict(grads)

        def add(name: str, value: Array | None) -> None:
            if name and value is not None:
                g[name] = g[name] + value if name in g else value

        for step in reversed(tape):
            node, x = step.node, step.inputs
            dy = [g.get(n) if n else None for n in node.output]
            if all(d is None for d in dy):
                continue
            op, d = node.op_type, dy[0]
            if op == "Cast" and np.issubdtype(x[0].dtype, np.floating):
                add(node.input[0], d.astype(x[0].dtype))
            elif op in _NO_GRAD:
                raise GraphError(f"{op} node '{_name(node)}': on the path from the weights to the loss, no backward")
            elif op == "MatMul":
                add(node.input[0], d @ np.swapaxes(x[1], -1, -2))
                if node.input[1] in wanted or node.input[1] not in self.constants:
                    if x[1].ndim == 2:
                        add(node.input[1], x[0].reshape(-1, x[0].shape[-1]).T @ d.reshape(-1, d.shape[-1]))
                    else:
                        add(node.input[1], _unbroadcast(np.swapaxes(x[0], -1, -2) @ d, x[1].shape))
            elif op == "Gather":
                table = np.zeros_like(x[0])
                np.add.at(table, x[1].reshape(-1), d.reshape(-1, d.shape[-1]))
                add(node.input[0], table)
            elif op == "Transpose":
                perm = _attrs(node).get("perm") or list(range(d.ndim))[::-1]
                add(node.input[0], np.transpose(d, np.argsort(perm)))
            elif op == "Sigmoid":
                add(node.input[0], d * step.outputs[0] * (1 - step.outputs[0]))
            elif op == "Gelu":
                add(node.input[0], d * step.saved)
            elif op == "Reshape":
                add(node.input[0], d.reshape(x[0].shape))
            elif op == "Split":
                parts = [dy[i] if dy[i] is not None else np.zeros_like(o) for i, o in enumerate(step.outputs)]
                add(node.input[0], np.concatenate(parts, axis=int(_attrs(node).get("axis", 0))))
            elif op == "Mul":
                add(node.input[0], _unbroadcast(d * x[1], x[0].shape))
                add(node.input[1], _unbroadcast(d * x[0], x[1].shape))
            elif op in ("Add", "Sub"):
                if np.issubdtype(x[0].dtype, np.floating):
                    add(node.input[0], _unbroadcast(d, x[0].shape))
                    add(node.input[1], _unbroadcast(d if op == "Add" else -d, x[1].shape))
            elif op == "Slice":
                full = np.zeros_like(x[0])
                full[step.saved] = d
                add(node.input[0], full)
            elif op == "SimplifiedLayerNormalization":
                add(node.input[0], _rms_back(d, x[0], step.saved, x[1]))
                if node.input[1] in wanted:
                    add(node.input[1], _unbroadcast(d * x[0] * step.saved, x[1].shape))
            elif op == "SkipSimplifiedLayerNormalization":
                s, r = step.saved
                ds = _rms_back(d, s, r, x[2]) if d is not None else 0
                if d is not None and node.input[2] in wanted:
                    add(node.input[2], _unbroadcast(d * s * r, x[2].shape))
                if len(dy) > 3 and dy[3] is not None:
                    ds = ds + dy[3]
                for i in (0, 1, 3):
                    if i < len(x) and x[i] is not None:
                        add(node.input[i], _unbroadcast(np.asarray(ds), x[i].shape))
            elif op == "GroupQueryAttention":
                for name, grad in zip(node.input, _gqa_back(d, step.saved), strict=False):
                    add(name, grad)
        return {name: g[name] for name in wanted if name in g}
