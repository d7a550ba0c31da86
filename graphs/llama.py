"""A Llama-style FP32 decoder stack built from primitive ONNX ops.

Graph contract (tests and the validator rely on these names):
- input "hidden_states" [batch, seq, hidden], output "output" [batch, seq, hidden];
- layer i's residual output tensor is "layer{i}.output";
- projection nodes are MatMul "layer{i}.attn.{q,k,v,o}_proj" and
  "layer{i}.mlp.{gate,up,down}_proj", each with initializer "<node name>.weight" [K, N];
- RMSNorm weights are "layer{i}.input_norm.weight", "layer{i}.post_attn_norm.weight"
  and "final_norm.weight".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from ._common import (
    OUTLIER_FRACTION,
    OUTLIER_SCALE,
    float_value_info,
    initializer,
    make_model,
    weight_matrix,
)

# Additive mask for future positions: large enough that exp() underflows to exactly 0,
# finite so that fully-masked arithmetic never produces NaN.
MASK_VALUE = -1e9


@dataclass(frozen=True)
class LlamaConfig:
    """Shape and weight-generation settings of `llama_decoder`."""

    hidden: int = 1024
    intermediate: int = 2816
    layers: int = 4
    heads: int = 8
    seed: int = 0
    rms_eps: float = 1e-5
    outlier_fraction: float = OUTLIER_FRACTION
    outlier_scale: float = OUTLIER_SCALE
    rope: bool = True
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.rope and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
        if self.layers < 1:
            raise ValueError(f"layers must be >= 1, got {self.layers}")

    @property
    def head_dim(self) -> int:
        """Per-head width, hidden // heads."""
        return self.hidden // self.heads


class _Builder:
    """Collects nodes and initializers; a node's output tensor is named after the node unless given."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def op(
        self,
        op_type: str,
        inputs: list[str],
        name: str,
        out: str | None = None,
        **attrs,
    ) -> str:
        out = name if out is None else out
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=name, **attrs))
        return out

    def const(self, name: str, array: np.ndarray) -> str:
        self.inits.append(initializer(name, array))
        return name


def _rms_norm(
    g: _Builder,
    x: str,
    prefix: str,
    weight: np.ndarray,
    eps: str,
    out: str | None = None,
) -> str:
    w = g.const(f"{prefix}.weight", weight)
    sq = g.op("Mul", [x, x], f"{prefix}.square")
    ms = g.op("ReduceMean", [sq], f"{prefix}.mean", axes=[-1], keepdims=1)
    var = g.op("Add", [ms, eps], f"{prefix}.add_eps")
    rms = g.op("Sqrt", [var], f"{prefix}.sqrt")
    inv = g.op("Reciprocal", [rms], f"{prefix}.inv_rms")
    normed = g.op("Mul", [x, inv], f"{prefix}.normalize")
    return g.op("Mul", [normed, w], f"{prefix}.scale", out=out)


def _rotate(g: _Builder, x: str, prefix: str, cos: str, sin: str) -> str:
    # HF Llama's rotate_half convention: x * cos + concat(-x2, x1) * sin on [B, S, H, D].
    x1, x2 = f"{prefix}.first_half", f"{prefix}.second_half"
    g.nodes.append(helper.make_node("Split", [x], [x1, x2], name=f"{prefix}.split", axis=-1))
    neg = g.op("Neg", [x2], f"{prefix}.neg")
    rot = g.op("Concat", [neg, x1], f"{prefix}.rotate_half", axis=-1)
    a = g.op("Mul", [x, cos], f"{prefix}.mul_cos")
    b = g.op("Mul", [rot, sin], f"{prefix}.mul_sin")
    return g.op("Add", [a, b], prefix)


def llama_decoder(cfg: LlamaConfig | None = None) -> onnx.ModelProto:
    """Build a Llama-style decoder stack (RMSNorm, causal MHA with RoPE, SwiGLU MLP) without embeddings."""
    cfg = LlamaConfig() if cfg is None else cfg
    rng = np.random.default_rng(cfg.seed)
    hd, d = cfg.hidden, cfg.head_dim
    g = _Builder()

    def proj(x: str, name: str, k: int, n: int) -> str:
        w = weight_matrix(
            rng,
            k,
            n,
            outlier_fraction=cfg.outlier_fraction,
            outlier_scale=cfg.outlier_scale,
        )
        return g.op("MatMul", [x, g.const(f"{name}.weight", w)], name)

    def norm_weight() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(hd)).astype(np.float32)

    eps = g.const("const.rms_eps", np.array(cfg.rms_eps, dtype=np.float32))
    attn_scale = g.const("const.attn_scale", np.array(1.0 / np.sqrt(d), dtype=np.float32))
    split_heads = g.const("const.split_heads_shape", np.array([0, 0, cfg.heads, d], dtype=np.int64))
    merge_heads = g.const("const.merge_heads_shape", np.array([0, 0, hd], dtype=np.int64))
    axis0 = g.const("const.axes_0", np.array([0], dtype=np.int64))
    axis1 = g.const("const.axes_1", np.array([1], dtype=np.int64))

    # Positions 0..seq-1 from the runtime shape, so one graph serves any sequence length.
    shape = g.op("Shape", ["hidden_states"], "positions.input_shape")
    seq_len = g.op(
        "Gather",
        [shape, g.const("const.seq_axis", np.array(1, dtype=np.int64))],
        "positions.seq_len",
    )
    positions = g.op(
        "Range",
        [
            g.const("const.zero_i64", np.array(0, dtype=np.int64)),
            seq_len,
            g.const("const.one_i64", np.array(1, dtype=np.int64)),
        ],
        "positions",
    )

    # Additive causal mask [seq, seq]: MASK_VALUE where key position > query position.
    rows = g.op("Unsqueeze", [positions, axis1], "causal_mask.query_pos")
    cols = g.op("Unsqueeze", [positions, axis0], "causal_mask.key_pos")
    future = g.op("Greater", [cols, rows], "causal_mask.future")
    mask = g.op(
        "Where",
        [
            future,
            g.const("const.mask_value", np.array(MASK_VALUE, dtype=np.float32)),
            g.const("const.zero_f32", np.array(0.0, dtype=np.float32)),
        ],
        "causal_mask",
    )

    cos = sin = ""
    if cfg.rope:
        inv_freq = cfg.rope_theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
        pos_f = g.op("Cast", [positions], "rope.positions_f32", to=TensorProto.FLOAT)
        pos_col = g.op("Unsqueeze", [pos_f, axis1], "rope.positions_col")
        freqs = g.op(
            "Mul",
            [pos_col, g.const("rope.inv_freq", inv_freq.astype(np.float32))],
            "rope.freqs",
        )
        emb = g.op("Concat", [freqs, freqs], "rope.angles", axis=-1)
        # [seq, 1, head_dim] broadcasts against q/k laid out as [batch, seq, heads, head_dim].
        cos = g.op("Unsqueeze", [g.op("Cos", [emb], "rope.cos_2d"), axis1], "rope.cos")
        sin = g.op("Unsqueeze", [g.op("Sin", [emb], "rope.sin_2d"), axis1], "rope.sin")

    x = "hidden_states"
    for i in range(cfg.layers):
        p = f"layer{i}"
        h = _rms_norm(g, x, f"{p}.input_norm", norm_weight(), eps)
        q, k, v = (
            g.op(
                "Reshape",
                [proj(h, f"{p}.attn.{m}_proj", hd, hd), split_heads],
                f"{p}.attn.{m}_heads",
            )
            for m in ("q", "k", "v")
        )
        if cfg.rope:
            q = _rotate(g, q, f"{p}.attn.q_rope", cos, sin)
            k = _rotate(g, k, f"{p}.attn.k_rope", cos, sin)
        # Heads first; K goes straight to [B, H, D, S] so scores need no extra transpose.
        q = g.op("Transpose", [q], f"{p}.attn.q_transpose", perm=[0, 2, 1, 3])
        k = g.op("Transpose", [k], f"{p}.attn.k_transpose", perm=[0, 2, 3, 1])
        v = g.op("Transpose", [v], f"{p}.attn.v_transpose", perm=[0, 2, 1, 3])
        scores = g.op("MatMul", [q, k], f"{p}.attn.scores")
        scores = g.op("Mul", [scores, attn_scale], f"{p}.attn.scale")
        scores = g.op("Add", [scores, mask], f"{p}.attn.mask")
        probs = g.op("Softmax", [scores], f"{p}.attn.softmax", axis=-1)
        ctx = g.op("MatMul", [probs, v], f"{p}.attn.context")
        ctx = g.op("Transpose", [ctx], f"{p}.attn.context_transpose", perm=[0, 2, 1, 3])
        ctx = g.op("Reshape", [ctx, merge_heads], f"{p}.attn.merge_heads")
        attn = proj(ctx, f"{p}.attn.o_proj", hd, hd)
        x = g.op("Add", [x, attn], f"{p}.attn.residual")

        h = _rms_norm(g, x, f"{p}.post_attn_norm", norm_weight(), eps)
        gate = proj(h, f"{p}.mlp.gate_proj", hd, cfg.intermediate)
        up = proj(h, f"{p}.mlp.up_proj", hd, cfg.intermediate)
        sig = g.op("Sigmoid", [gate], f"{p}.mlp.gate_sigmoid")
        act = g.op("Mul", [gate, sig], f"{p}.mlp.silu")
        act = g.op("Mul", [act, up], f"{p}.mlp.swiglu")
        down = proj(act, f"{p}.mlp.down_proj", cfg.intermediate, hd)
        x = g.op("Add", [x, down], f"{p}.mlp.residual", out=f"{p}.output")

    _rms_norm(g, x, "final_norm", norm_weight(), eps, out="output")
    io_shape = ["batch", "seq", hd]
    return make_model(
        "llama_decoder",
        g.nodes,
        [float_value_info("hidden_states", io_shape)],
        [float_value_info("output", io_shape)],
        g.inits,
    )
