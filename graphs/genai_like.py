"""A small decoder shaped as onnxruntime-genai's builder writes one: tied table, packed QKV, GroupQueryAttention.

For tests of what runs on genai folders (scale tuning's NumPy decoder, ``tune.graph``) without the
builder or torch: random weights, two layers, the builder's op types and input names (``past.*``
instead of ``past_key_values.*``).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD, INTER, LAYERS = 64, 32, 4, 2, 16, 48, 2


def genai_like(seed: int = 0, gemma: bool = False) -> onnx.ModelProto:
    """A two-layer decoder shaped as onnxruntime-genai's builder writes one (tied table, packed QKV, GQA).

    ``gemma``: shaped as its Gemma 3 graphs instead: the embedding scaled, QKV split with query and
    key norms per head into GroupQueryAttention's three inputs, the first layer's attention local
    (4 tokens), norms after attention and MLP too, and a tanh Gelu gate.
    """
    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def init(name: str, value: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(value, name))
        return name

    def weight(name: str, k: int, n: int) -> str:
        return init(name, (rng.normal(size=(k, n)) / np.sqrt(k)).astype(np.float32))

    def gamma(name: str, size: int = HIDDEN) -> str:
        return init(name, (1 + 0.1 * rng.normal(size=size)).astype(np.float32))

    def skip_norm(x: str, skip: str, name: str, out: str, residual: str) -> None:
        """SkipSimplifiedLayerNormalization: ``out`` = norm(x + skip) * gamma ``name``, ``residual`` = x + skip."""
        inputs = [x, skip, gamma(name)]
        nodes.append(helper.make_node("SkipSimplifiedLayerNormalization", inputs, [out, "", "", residual],
                                      domain="com.microsoft", epsilon=1e-5))  # fmt: skip

    def norm(x: str, name: str, size: int = HIDDEN) -> str:
        node = helper.make_node("SimplifiedLayerNormalization", [x, gamma(name, size)], [f"{name}.y"], epsilon=1e-6)
        nodes.append(node)
        return f"{name}.y"

    one = init("one", np.array([1], np.int64))
    index = init("index", np.array(1, np.int64))
    nodes += [
        helper.make_node("ReduceSum", ["attention_mask", one], ["len"], keepdims=0),
        helper.make_node("Sub", ["len", one], ["len1"]),
        helper.make_node("Cast", ["len1"], ["seqlens_k"], to=TensorProto.INT32),
        helper.make_node("Shape", ["attention_mask"], ["mask_shape"]),
        helper.make_node("Gather", ["mask_shape", index], ["total"], axis=0),
        helper.make_node("Cast", ["total"], ["total_len"], to=TensorProto.INT32),
    ]
    freq = 1.0 / 10000 ** (np.arange(HEAD // 2) / (HEAD // 2))
    angle = np.arange(64)[:, None] * freq[None]
    init("cos_cache", np.cos(angle).astype(np.float32))
    init("sin_cache", np.sin(angle).astype(np.float32))
    head = weight("lm_head.weight", HIDDEN, VOCAB)
    nodes += [
        helper.make_node("Transpose", [head], ["table"], perm=[1, 0]),
        helper.make_node("Gather", ["table", "input_ids"], ["h0"]),
    ]
    x = "h0"
    if gemma:
        scale = init("embed_scale", np.array(np.sqrt(HIDDEN), np.float32))
        nodes.append(helper.make_node("Mul", ["h0", scale], ["h"]))
        x = "h"
        init("q_heads", np.array([0, -1, HEAD], np.int64))
        init("q_back", np.array([0, -1, HEADS * HEAD], np.int64))
        init("k_back", np.array([0, -1, KV_HEADS * HEAD], np.int64))
        init("qkv_sizes", np.array([HEADS * HEAD, KV_HEADS * HEAD, KV_HEADS * HEAD], np.int64))
    skip = None
    for i in range(LAYERS):
        p = f"l{i}"
        if skip is None:
            nodes.append(
                helper.make_node("SimplifiedLayerNormalization", [x, gamma(f"{p}.n1")], [f"{p}.x1"], epsilon=1e-5)
            )
            res = x
        else:
            skip_norm(x, skip, f"{p}.n1", f"{p}.x1", f"{p}.r1")
            res = f"{p}.r1"
        qkv = weight(f"{p}.qkv", HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD)
        nodes.append(helper.make_node("MatMul", [f"{p}.x1", qkv], [f"{p}.qkv_out"]))
        attention_in = [f"{p}.qkv_out", "", ""]
        if gemma:
            q, k, v = (f"{p}.{t}" for t in "qkv")
            nodes.append(helper.make_node("Split", [f"{p}.qkv_out", "qkv_sizes"], [q, k, v], axis=-1))
            for t, back in ((q, "q_back"), (k, "k_back")):
                nodes.append(helper.make_node("Reshape", [t, "q_heads"], [f"{t}.heads"]))
                normed = norm(f"{t}.heads", f"{t}_norm", HEAD)
                nodes.append(helper.make_node("Reshape", [normed, back], [f"{t}.normed"]))
            attention_in = [f"{q}.normed", f"{k}.normed", v]
        local = {"local_window_size": 4} if gemma and i == 0 else {}
        nodes += [
            helper.make_node(
                "GroupQueryAttention",
                [
                    *attention_in,
                    f"past.{i}.key",
                    f"past.{i}.value",
                    "seqlens_k",
                    "total_len",
                    "cos_cache",
                    "sin_cache",
                ],
                [f"{p}.att", f"present.{i}.key", f"present.{i}.value"],
                domain="com.microsoft",
                num_heads=HEADS,
                kv_num_heads=KV_HEADS,
                do_rotary=1,
                rotary_interleaved=0,
                scale=0.3,
                **local,
            ),
            helper.make_node("MatMul", [f"{p}.att", weight(f"{p}.o", HEADS * HEAD, HIDDEN)], [f"{p}.o_out"]),
        ]
        attended = norm(f"{p}.o_out", f"{p}.post_attention") if gemma else f"{p}.o_out"
        skip_norm(res, attended, f"{p}.n2", f"{p}.x2", f"{p}.r2")
        nodes += [
            helper.make_node("MatMul", [f"{p}.x2", weight(f"{p}.gate", HIDDEN, INTER)], [f"{p}.g"]),
            helper.make_node("MatMul", [f"{p}.x2", weight(f"{p}.up", HIDDEN, INTER)], [f"{p}.u"]),
        ]
        if gemma:
            nodes.append(helper.make_node("Gelu", [f"{p}.g"], [f"{p}.act"], approximate="tanh"))
        else:
            nodes += [
                helper.make_node("Sigmoid", [f"{p}.g"], [f"{p}.sg"]),
                helper.make_node("Mul", [f"{p}.g", f"{p}.sg"], [f"{p}.act"]),
            ]
        nodes += [
            helper.make_node("Mul", [f"{p}.act", f"{p}.u"], [f"{p}.m"]),
            helper.make_node("MatMul", [f"{p}.m", weight(f"{p}.down", INTER, HIDDEN)], [f"{p}.d"]),
        ]
        x, skip = f"{p}.r2", norm(f"{p}.d", f"{p}.post_feedforward") if gemma else f"{p}.d"
    skip_norm(x, skip, "final", "xf", "rf")
    nodes.append(helper.make_node("MatMul", ["xf", head], ["logits"]))
    past = [helper.make_tensor_value_info(f"past.{i}.{kv}", TensorProto.FLOAT, ["batch", KV_HEADS, "past", HEAD])
            for i in range(LAYERS) for kv in ("key", "value")]  # fmt: skip
    graph = helper.make_graph(
        nodes, "genai_like",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"]), *past],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", VOCAB])] +
        [helper.make_tensor_value_info(f"present.{i}.{kv}", TensorProto.FLOAT, None)
         for i in range(LAYERS) for kv in ("key", "value")],
        inits,
    )  # fmt: skip
    opsets = [helper.make_opsetid("", 20 if gemma else 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model


def genai_feeds(seq: int = 12, seed: int = 1) -> dict[str, np.ndarray]:
    """One window of ``seq`` random tokens with an empty past: the inputs ``genai_like`` takes."""
    ids = np.random.default_rng(seed).integers(0, VOCAB, size=(1, seq), dtype=np.int64)
    out = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for i in range(LAYERS):
        for kv in ("key", "value"):
            out[f"past.{i}.{kv}"] = np.zeros((1, KV_HEADS, 0, HEAD), np.float32)
    return out
