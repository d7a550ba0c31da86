"""Tests of the FP32 graph builders: ONNX validity, onnxruntime vs NumPy forwards, weight realism."""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cim_int4.graphs import (
    BUILDERS,
    IR_VERSION,
    OPSET,
    LlamaConfig,
    llama_decoder,
    matmul_chain,
    mlp,
    random_input,
    single_matmul,
)
from onnx import helper, numpy_helper

TINY_LLAMA = LlamaConfig(hidden=64, intermediate=128, layers=2, heads=4, seed=3)

SMALL_BUILDS = {
    "single_matmul": lambda: single_matmul(48, 40, seed=1),
    "single_matmul_bias": lambda: single_matmul(48, 40, seed=1, bias=True),
    "matmul_chain": lambda: matmul_chain(3, 32, seed=2),
    "mlp": lambda: mlp((24, 40, 36, 12), seed=4),
    "mlp_one_layer": lambda: mlp((24, 12)),
    "llama_tiny": lambda: llama_decoder(TINY_LLAMA),
    "llama_tiny_no_rope": lambda: llama_decoder(
        LlamaConfig(hidden=64, intermediate=128, layers=2, heads=4, rope=False)
    ),
}


def run(
    model: onnx.ModelProto,
    feeds: dict[str, np.ndarray],
    outputs: list[str] | None = None,
) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(outputs, feeds)


def weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


# ---------------------------------------------------------------- graph contract


@pytest.mark.parametrize("name", SMALL_BUILDS)
def test_model_passes_full_check_with_pinned_versions(name: str) -> None:
    model = SMALL_BUILDS[name]()
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version == IR_VERSION == 8
    assert [(o.domain, o.version) for o in model.opset_import] == [("", OPSET)]
    assert OPSET == 17


@pytest.mark.parametrize("name", SMALL_BUILDS)
def test_nodes_named_uniquely_and_weights_follow_node_names(name: str) -> None:
    model = SMALL_BUILDS[name]()
    names = [n.name for n in model.graph.node]
    assert all(names), "every node needs a name so users can exclude it"
    assert len(set(names)) == len(names)
    w = weights(model)
    const_matmuls = 0
    for node in model.graph.node:
        if node.op_type in ("MatMul", "Gemm") and node.input[1] in w:
            const_matmuls += 1
            assert node.input[1] == f"{node.name}.weight"
            assert w[node.input[1]].dtype == np.float32 and w[node.input[1]].ndim == 2
    assert const_matmuls >= 1
    for value in list(model.graph.input) + list(model.graph.output):
        assert value.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
        assert value.type.tensor_type.shape.dim[0].dim_param, "leading dim must be symbolic"


def test_builds_are_deterministic_in_seed() -> None:
    assert single_matmul(32, 16, seed=5).SerializeToString() == single_matmul(32, 16, seed=5).SerializeToString()
    assert llama_decoder(TINY_LLAMA).SerializeToString() == llama_decoder(TINY_LLAMA).SerializeToString()
    a = weights(single_matmul(32, 16, seed=5))["matmul.weight"]
    b = weights(single_matmul(32, 16, seed=6))["matmul.weight"]
    assert not np.array_equal(a, b)


# ---------------------------------------------------------------- simple graphs vs NumPy


@pytest.mark.parametrize("bias", [False, True])
def test_single_matmul_matches_numpy(bias: bool) -> None:
    model = single_matmul(48, 40, seed=1, bias=bias)
    assert model.graph.node[0].name == "matmul"
    w = weights(model)
    x = random_input(model, {"M": 3})["x"]
    expected = x @ w["matmul.weight"] + (w["matmul.bias"] if bias else 0.0)
    (y,) = run(model, {"x": x})
    assert y.shape == (3, 40)
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5)


def test_matmul_chain_matches_numpy_and_keeps_scale() -> None:
    model = matmul_chain(6, 64, seed=2)
    w = weights(model)
    x = random_input(model, {"M": 5})["x"]
    expected = x.astype(np.float64)
    for i in range(6):
        expected = expected @ w[f"matmul{i}.weight"]
    (y,) = run(model, {"x": x})
    assert y.shape == (5, 64)
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4)
    assert 0.3 < y.std() < 3.0, "chain weights should neither explode nor vanish activations"


def test_mlp_matches_numpy_and_has_a_gemm_layer() -> None:
    dims = (24, 40, 36, 12)
    model = mlp(dims, seed=4)
    gemms = [n for n in model.graph.node if n.op_type == "Gemm"]
    assert len(gemms) == 1
    assert {a.name: helper.get_attribute_value(a) for a in gemms[0].attribute} == {"transB": 1}
    assert len(gemms[0].input) == 3, "Gemm must carry its bias as C"
    w = weights(model)
    x = random_input(model, {"batch": 2})["x"]
    h = x.astype(np.float64)
    for i in range(len(dims) - 1):
        wi = w[f"fc{i}.weight"]
        h = h @ (wi.T if f"fc{i}" == gemms[0].name else wi) + w[f"fc{i}.bias"]
        if i < len(dims) - 2:
            h = np.maximum(h, 0.0)
    (y,) = run(model, {"x": x})
    assert y.shape == (2, 12)
    np.testing.assert_allclose(y, h, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- llama vs an independent NumPy forward


def llama_forward(model: onnx.ModelProto, cfg: LlamaConfig, x: np.ndarray) -> dict[str, np.ndarray]:
    """Float64 Llama forward from the model's initializers; returns per-layer outputs and "output"."""
    w = {k: v.astype(np.float64) for k, v in weights(model).items()}
    b, s, hidden = x.shape
    nh, hd = cfg.heads, cfg.head_dim

    def rms(t: np.ndarray, name: str) -> np.ndarray:
        return t / np.sqrt(np.mean(t * t, axis=-1, keepdims=True) + cfg.rms_eps) * w[f"{name}.weight"]

    def rope(t: np.ndarray) -> np.ndarray:
        # As complex numbers: pair (j, j + D/2) of t [B, S, H, D] turns by pos * theta^(-2j/D).
        if not cfg.rope:
            return t
        angle = np.arange(s)[:, None] * cfg.rope_theta ** (-2.0 * np.arange(hd // 2) / hd)
        z = (t[..., : hd // 2] + 1j * t[..., hd // 2 :]) * np.exp(1j * angle)[None, :, None, :]
        return np.concatenate([z.real, z.imag], axis=-1)

    out = {}
    h = x.astype(np.float64)
    for i in range(cfg.layers):
        p = f"layer{i}"
        n = rms(h, f"{p}.input_norm")
        q, k, v = ((n @ w[f"{p}.attn.{m}_proj.weight"]).reshape(b, s, nh, hd) for m in ("q", "k", "v"))
        q, k = rope(q), rope(k)
        scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
        scores = np.where(np.triu(np.ones((s, s), dtype=bool), k=1), -np.inf, scores)
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        ctx = np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, hidden)
        h = h + ctx @ w[f"{p}.attn.o_proj.weight"]
        n = rms(h, f"{p}.post_attn_norm")
        gate = n @ w[f"{p}.mlp.gate_proj.weight"]
        up = n @ w[f"{p}.mlp.up_proj.weight"]
        h = h + (gate / (1.0 + np.exp(-gate)) * up) @ w[f"{p}.mlp.down_proj.weight"]
        out[f"{p}.output"] = h
    out["output"] = rms(h, "final_norm")
    return out


def with_layer_outputs(model: onnx.ModelProto, layers: int) -> onnx.ModelProto:
    """Copy of the model that also exposes each "layer{i}.output" as a graph output."""
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    for i in range(layers):
        exposed.graph.output.append(helper.make_empty_tensor_value_info(f"layer{i}.output"))
    return exposed


@pytest.mark.parametrize("rope", [True, False])
def test_llama_matches_numpy_layer_by_layer(rope: bool) -> None:
    cfg = LlamaConfig(hidden=64, intermediate=128, layers=2, heads=4, seed=3, rope=rope)
    model = llama_decoder(cfg)
    x = random_input(model, {"batch": 2, "seq": 5}, seed=1)["hidden_states"]
    names = ["output"] + [f"layer{i}.output" for i in range(cfg.layers)]
    got = dict(
        zip(
            names,
            run(with_layer_outputs(model, cfg.layers), {"hidden_states": x}, names),
            strict=True,
        )
    )
    expected = llama_forward(model, cfg, x)
    for name in names:
        assert got[name].shape == (2, 5, 64), name
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-4, atol=1e-4, err_msg=name)


def test_llama_is_causal() -> None:
    model = llama_decoder(TINY_LLAMA)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = random_input(model, {"batch": 2, "seq": 6}, seed=2)["hidden_states"]
    (base,) = sess.run(None, {"hidden_states": x})

    later = x.copy()
    later[:, -1] += 3.0
    (changed,) = sess.run(None, {"hidden_states": later})
    np.testing.assert_allclose(changed[:, :-1], base[:, :-1], rtol=0, atol=1e-6)
    assert not np.allclose(changed[:, -1], base[:, -1], atol=1e-3)

    # The converse shows attention really mixes positions, so the check above is not vacuous.
    earlier = x.copy()
    earlier[:, 0] += 3.0
    (changed,) = sess.run(None, {"hidden_states": earlier})
    assert not np.allclose(changed[:, 1:], base[:, 1:], atol=1e-3)


@pytest.mark.parametrize(("batch", "seq"), [(1, 1), (3, 7)])
def test_llama_runs_with_dynamic_batch_and_seq(batch: int, seq: int) -> None:
    model = llama_decoder(TINY_LLAMA)
    feeds = random_input(model, {"batch": batch, "seq": seq})
    (y,) = run(model, feeds)
    assert y.shape == (batch, seq, 64)
    assert np.isfinite(y).all()


def test_llama_node_names() -> None:
    names = {n.name for n in llama_decoder(TINY_LLAMA).graph.node}
    for i in range(TINY_LLAMA.layers):
        for proj in (
            "attn.q_proj",
            "attn.k_proj",
            "attn.v_proj",
            "attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ):
            assert f"layer{i}.{proj}" in names
    assert len([n for n in names if re.fullmatch(r"layer\d+\.(attn|mlp)\.\w+_proj", n)]) == 7 * TINY_LLAMA.layers


def test_llama_default_config_size() -> None:
    model = llama_decoder()
    w = weights(model)
    total = sum(a.nbytes for a in w.values())
    assert total <= 210e6  # ~196 MiB of FP32 weights
    assert w["layer0.mlp.gate_proj.weight"].shape == (1024, 2816)
    assert w["layer3.mlp.down_proj.weight"].shape == (2816, 1024)
    assert "layer4.attn.q_proj.weight" not in w


# ---------------------------------------------------------------- weight realism


def outlier_ratio(w: np.ndarray) -> float:
    norms = np.linalg.norm(w, axis=0)  # per column (output channel) of a [K, N] weight
    return float(norms.max() / np.median(norms))


def test_weights_have_outlier_columns() -> None:
    w = weights(single_matmul(512, 512))["matmul.weight"]
    assert outlier_ratio(w) > 5.0
    assert abs(w.std() * np.sqrt(512) - 1.0) < 0.5  # std ~ 1/sqrt(K), outliers included
    assert outlier_ratio(weights(single_matmul(512, 512, outlier_fraction=0.0))["matmul.weight"]) < 1.5

    llama = weights(llama_decoder(TINY_LLAMA))
    for name in ("layer0.attn.q_proj.weight", "layer1.mlp.down_proj.weight"):
        assert outlier_ratio(llama[name]) > 5.0, name
    mlp_w = weights(mlp((64, 48, 16)))
    assert outlier_ratio(mlp_w["fc0.weight"]) > 5.0
    assert outlier_ratio(mlp_w["fc1.weight"].T) > 5.0, "Gemm weight is stored [N, K]"


# ---------------------------------------------------------------- helpers


def test_random_input_fills_symbolic_dims() -> None:
    llama = llama_decoder(TINY_LLAMA)
    feeds = random_input(llama)
    assert list(feeds) == ["hidden_states"]
    assert feeds["hidden_states"].shape == (1, 8, 64)
    assert feeds["hidden_states"].dtype == np.float32
    assert random_input(llama, {"batch": 2, "seq": 5})["hidden_states"].shape == (
        2,
        5,
        64,
    )
    assert random_input(single_matmul(16, 8))["x"].shape == (1, 16)
    np.testing.assert_array_equal(
        random_input(llama, seed=4)["hidden_states"],
        random_input(llama, seed=4)["hidden_states"],
    )


def test_builders_registry() -> None:
    assert {"mlp", "llama"} <= set(BUILDERS)
    model = BUILDERS["mlp"]()
    assert isinstance(model, onnx.ModelProto)
    (y,) = run(model, random_input(model, {"batch": 2}))
    assert y.shape == (2, 128)
