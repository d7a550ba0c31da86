"""Scale tuning: train an exported model's group scales, codes fixed, to bring its logits back to FP32's.

Each layer was quantized for its own output error; the errors compound through the model. Here
every stored set of scales ``s`` becomes ``s * exp(theta)`` and ``theta`` is trained by Adam on the
KL divergence of the exported model's next-token distributions from the FP32 model's, over every
position of the calibration windows (the FP32 model run by ONNX Runtime is the teacher; the exported
model runs as its dequantized twin in ``tune.graph``, which has the backward pass). The trained
scales are then stored as the node stored them (int8 under float16 super-scales, float16 or
float32): no byte more, no new op. On SmolLM2 at 2.985 bits per weight the torch prototype took the
perplexity gap from 4.6x to 1.6x round-to-nearest 4-bit's (docs/widths.md "Scale tuning").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import onnx
from onnx import numpy_helper

from ...contract import GATHER, MATMUL, MATMUL_SHARED, Int4Node, int8_scales, is_op_node, scale_values
from .graph import Graph
from .twin import ScaleParam, twin

Feeds = dict[str, np.ndarray]
Teacher = Callable[[Feeds], np.ndarray]


DEFAULT_LR = 2e-3  # Adam's first step on the log-scales (SmolLM2: docs/methods.md "Scale tuning")


@dataclass(frozen=True)
class TuneOptions:
    """How scales are trained: passes over the training windows, Adam's step (cosine to 0), windows held out."""

    epochs: int = 4
    lr: float = DEFAULT_LR
    held_out: int = 1
    logits: str = "logits"


@dataclass
class TuneResult:
    """What the tuning did: held-out KL per token before and after (the scales as stored), and its time."""

    kl_before: float
    kl_after: float
    seconds: float
    params: int


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _kl(logits: np.ndarray, teacher_lp: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean KL(teacher || model) per position, and its gradient with respect to ``logits``."""
    lq = _log_softmax(logits.astype(np.float64))
    p = np.exp(teacher_lp)
    positions = int(np.prod(logits.shape[:-1]))
    return float((p * (teacher_lp - lq)).sum() / positions), ((np.exp(lq) - p) / positions).astype(logits.dtype)


class _Adam:
    def __init__(self, shapes: Sequence[tuple[int, ...]], lr: float, steps: int) -> None:
        self.m = [np.zeros(s) for s in shapes]
        self.v = [np.zeros(s) for s in shapes]
        self.t, self.lr, self.steps = 0, lr, steps

    def step(self, params: list[np.ndarray], grads: list[np.ndarray]) -> None:
        lr = self.lr * 0.5 * (1 + np.cos(np.pi * self.t / self.steps))
        self.t += 1
        for p, g, m, v in zip(params, grads, self.m, self.v, strict=True):
            m *= 0.9
            m += 0.1 * g
            v *= 0.999
            v += 0.001 * g * g
            p -= lr * (m / (1 - 0.9**self.t)) / (np.sqrt(v / (1 - 0.999**self.t)) + 1e-8)


class _Twin:
    """The exported model's dequantized twin as a ``Graph``, its weights made from the trained scales."""

    def __init__(self, exported: onnx.ModelProto) -> None:
        copy = onnx.ModelProto()
        copy.CopyFrom(exported)
        self.params: list[ScaleParam] = []
        self.graph = Graph(twin(copy, self.params))
        for p in self.params:  # made from the scales at every step: no second copy
            for name, _ in p.weights:
                del self.graph.constants[name]
        self.theta = [np.zeros(p.scales.shape) for p in self.params]

    def scales(self) -> list[np.ndarray]:
        return [p.scales * np.exp(t).astype(np.float32) for p, t in zip(self.params, self.theta, strict=True)]

    def weights(self) -> dict[str, np.ndarray]:
        out = {}
        for p, s in zip(self.params, self.scales(), strict=True):
            rows = p.rows(s)
            for name, as_kn in p.weights:
                out[name] = np.ascontiguousarray(rows.T) if as_kn else rows
        return out

    def loss(self, feeds: Feeds, teacher_lp: np.ndarray, logits: str, grad: bool) -> tuple[float, list[np.ndarray]]:
        values, tape = self.graph.forward(feeds, self.weights())
        kl, dlogits = _kl(values[logits], teacher_lp)
        if not grad:
            return kl, []
        names = [name for p in self.params for name, _ in p.weights]
        dw = self.graph.backward(tape, {logits: dlogits}, names)
        grads = []
        for p, s in zip(self.params, self.scales(), strict=True):
            rows = sum((dw[n].T if as_kn else dw[n]) for n, as_kn in p.weights if n in dw)
            g = p.scale_gradient(rows) if not isinstance(rows, int) else np.zeros(p.scales.shape)
            grads.append(g * s)  # d / d theta of s0 * exp(theta)
        return kl, grads


def tune_scales(
    exported: onnx.ModelProto,
    windows: Sequence[Feeds],
    teacher: Teacher,
    options: TuneOptions = TuneOptions(),
    log: Callable[[str], None] | None = None,
) -> TuneResult:
    """Train ``exported``'s scales (in place) on ``windows``; ``teacher(feeds)`` gives FP32's logits of a window.

    ``log`` gets a line per epoch (training and held-out KL per token). The last ``options.held_out`` windows
    are held out; with none, the KL reported before and after is the training windows'.
    """
    if len(windows) <= options.held_out:
        raise ValueError(f"scale tuning needs more than {options.held_out} calibration windows, got {len(windows)}")
    start = time.perf_counter()
    model = _Twin(exported)
    train, held = windows[: len(windows) - options.held_out], windows[len(windows) - options.held_out :]
    held = held or train  # none held out: the KL reported is the training windows'
    teacher_lp = {id(w): _log_softmax(np.asarray(teacher(w), np.float64)) for w in held}

    def held_kl() -> float:
        return float(np.mean([model.loss(w, teacher_lp[id(w)], options.logits, False)[0] for w in held]))

    before = held_kl()
    adam = _Adam([t.shape for t in model.theta], options.lr, options.epochs * len(train))
    order = np.random.default_rng(0)
    after = before
    for epoch in range(options.epochs):
        seen = []
        for i in order.permutation(len(train)):
            lp = _log_softmax(np.asarray(teacher(train[i]), np.float64))
            kl, grads = model.loss(train[i], lp, options.logits, True)
            adam.step(model.theta, grads)
            seen.append(kl)
        after = held_kl()
        if log is not None:
            log(
                f"epoch {epoch + 1}/{options.epochs}: KL per token {np.mean(seen):.4f} training, {after:.4f} held out "
                f"(was {before:.4f}), {time.perf_counter() - start:.0f} s"
            )
    params = sum(t.size for t in model.theta)
    _write_back(exported, model.params, model.scales())
    del model  # one twin at a time
    model = _Twin(exported)  # held-out KL of the scales as stored (int8 ones re-rounded under new super-scales)
    return TuneResult(before, held_kl(), time.perf_counter() - start, params)


def _encode(values: np.ndarray, dtype: np.dtype, name: str) -> tuple[np.ndarray, np.ndarray | None]:
    """``values`` as stored scales of ``dtype``: int8 with their float16 super-scales, else the values themselves."""
    if dtype != np.int8:
        return values.astype(dtype), None
    pair = int8_scales(values)
    if pair is None:
        raise ValueError(f"{name}: trained scales beyond what float16 super-scales hold")
    return pair


def _write_back(exported: onnx.ModelProto, params: list[ScaleParam], scales: list[np.ndarray]) -> None:
    """Store each trained set of scales as its node stored it (int8 under super-scales, float16 or float32)."""
    trained = dict(zip((p.node for p in params), scales, strict=True))
    inits = {t.name: t for t in exported.graph.initializer}
    nodes = list(exported.graph.node)
    for i, node in enumerate(nodes):
        if is_op_node(node) and len(node.input) == 1 and node.name in trained:
            n = Int4Node.from_node(node, MATMUL)
            dtype = np.dtype(np.int8) if n.super_scales is not None else n.scales.dtype
            q, d = _encode(trained[node.name], dtype, f"node '{node.name}'")
            nodes[i] = replace(n, scales=q if d is None else scale_values(q, d), super_scales=d).to_node()
    shared = [n for n in nodes if is_op_node(n, MATMUL_SHARED) or is_op_node(n, GATHER)]
    supers = {n.input[2]: n.input[3] for n in shared if len(n.input) == 4}
    for name, values in trained.items():
        if name not in inits:
            continue
        old = numpy_helper.to_array(inits[name])
        q, d = _encode(values, old.dtype, f"initializer '{name}'")
        inits[name].CopyFrom(numpy_helper.from_array(q.reshape(old.shape), name))
        if d is not None:
            shape = numpy_helper.to_array(inits[supers[name]]).shape
            inits[supers[name]].CopyFrom(numpy_helper.from_array(d.reshape(shape), supers[name]))
    del exported.graph.node[:]
    exported.graph.node.extend(nodes)
