"""Cross-check of the native op against the reference backend, layer by layer, on whole models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from cim_int4.graphs import LlamaConfig, llama_decoder, matmul_chain, mlp, random_input, single_matmul
from cim_int4.ops import reference, reference_backend
from test_cli import run_cli

import cim_int4
from cim_int4 import make_session
from cim_int4.contract import COMPUTE_CONFIG, Int4Node, is_op_node
from cim_int4.crosscheck import allowed_difference, crosscheck
from cim_int4.layercheck import Model

pytest.importorskip("onnxruntime_extensions")

# One small model of each kind in cim_int4.graphs.
MODELS = {
    "matmul": lambda: single_matmul(200, 48, seed=1),
    "chain": lambda: matmul_chain(4, 64, seed=2),
    "mlp": lambda: mlp((64, 96, 48, 16), seed=4),  # fc1 is a Gemm with a bias
    "llama": lambda: llama_decoder(LlamaConfig(hidden=64, intermediate=128, layers=2, heads=4, seed=3)),
}
DIMS = {"M": 3, "batch": 2, "seq": 5}


def int4_and_feeds(name: str) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    model = cim_int4.export_int4(MODELS[name](), quiet=True)
    return model, random_input(model, DIMS, seed=7)


def cim_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if is_op_node(n)]


@pytest.mark.parametrize("name", MODELS)
def test_native_and_reference_agree_to_fp32_rounding(name: str) -> None:
    model, feeds = int4_and_feeds(name)
    report = crosscheck(model, feeds, threads=1)
    assert [layer.node for layer in report] == [n.name for n in cim_nodes(model)]
    with_bias = [Int4Node.from_node(n).bias is not None for n in cim_nodes(model)]
    assert any(with_bias) == (name == "mlp")  # the Gemm's bias goes through the op
    for layer in report:
        assert layer.ok, layer.format()
        assert layer.compute == "fp32" and 0 < layer.allowed < 1e-3


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("compute", reference.COMPUTE_MODES)
def test_reference_backend_layers_are_the_emulation(name: str, compute: str) -> None:
    # Each layer's output, given the input the reference session itself fed it, is bit for bit
    # reference.emulate in the chosen mode: int8 mode checked without the native library.
    model, feeds = int4_and_feeds(name)
    nodes = cim_nodes(model)
    names = list(dict.fromkeys(t for n in nodes for t in (n.input[0], n.output[0]) if t not in feeds))
    sess = make_session(
        Model(model, "INT4").with_outputs(names), threads=1, backend="reference", config={COMPUTE_CONFIG: compute}
    )
    values = {**feeds, **dict(zip(names, sess.run(names, feeds), strict=True))}
    for node in nodes:
        w = Int4Node.from_node(node)
        expected = reference.emulate(values[node.input[0]], w.packed, w.scales, w.k, w.group_size, w.bias, compute)
        if w.gated:  # the llama's MLPs: the gate of the emulated halves, rounded once
            expected = reference.gated(expected, w.gated).astype(np.float32)
        assert values[node.output[0]].tobytes() == expected.tobytes(), node.name


@pytest.mark.parametrize("name", MODELS)
def test_native_and_reference_agree_in_int8_mode(name: str) -> None:
    model, feeds = int4_and_feeds(name)
    for layer in crosscheck(model, feeds, threads=1, compute="int8"):
        assert layer.ok and layer.compute == "int8", layer.format()


@pytest.mark.parametrize("compute", reference.COMPUTE_MODES)
def test_allowed_difference_covers_what_an_input_difference_carries(compute: str) -> None:
    # Two runs of the same arithmetic on inputs that differ by a few ulps in some groups stay
    # within the bound; where the inputs are equal the outputs are too.
    rng = np.random.default_rng(11)
    w = Int4Node.from_node(cim_nodes(int4_and_feeds("matmul")[0])[0])
    a = rng.standard_normal((64, w.k), dtype=np.float32)
    b = a.copy()
    b[::2, 3:40] = np.nextafter(b[::2, 3:40], np.float32(np.inf))  # even rows: groups 0 and 1 differ
    ya, yb = (reference.emulate(x, w.packed, w.scales, w.k, w.group_size, compute=compute) for x in (a, b))
    allowed = allowed_difference(w, compute, a, b, ya)
    assert (np.abs(ya.astype(np.float64) - yb) <= allowed).all()
    assert np.array_equal(ya[1::2], yb[1::2]) and not np.array_equal(ya[::2], yb[::2])


def flip_channel(monkeypatch, node: str, channel: int) -> None:
    """Make the reference op wrong on purpose: ``node``'s output channel ``channel`` negated."""
    real = reference_backend.run_node

    def wrong(*args, **attrs):
        y = real(*args, **attrs)
        if attrs["node"] == node:
            y[..., channel] = -y[..., channel]
        return y

    monkeypatch.setattr(reference_backend, "run_node", wrong)


@pytest.mark.parametrize(("name", "layer"), [("chain", "matmul1"), ("llama", "layer0.attn.v_proj")])
def test_crosscheck_names_the_wrong_layer(name: str, layer: str, monkeypatch) -> None:
    model, feeds = int4_and_feeds(name)
    flip_channel(monkeypatch, layer, 5)
    report = crosscheck(model, feeds, threads=1)
    # Later layers see the wrong input too, but only the difference a layer adds is blamed on it.
    assert [entry.node for entry in report if not entry.ok] == [layer]
    (bad,) = [entry for entry in report if entry.node == layer]
    assert bad.worst > 100 and "KERNEL BUG" in bad.format()


def test_compare_backend_check(monkeypatch) -> None:
    fp32 = MODELS["chain"]()
    int4 = cim_int4.export_int4(fp32, quiet=True)
    report = cim_int4.compare(fp32, int4, dims=DIMS, threads=1, backend_check=True)
    assert report.backends is not None and len(report.backends) == 4 and all(b.ok for b in report.backends)
    assert report.first_divergent is None
    assert cim_int4.compare(fp32, int4, dims=DIMS, threads=1).backends is None
    flip_channel(monkeypatch, "matmul2", 3)
    report = cim_int4.compare(fp32, int4, dims=DIMS, threads=1, backend_check=True)
    assert report.first_divergent == "matmul2"
    assert "kernel bug" in report.summary() and report.to_json()["backends"][2]["ok"] is False


# ---------------------------------------------------------------- cim-int4 validate --backend reference


@pytest.fixture
def model_files(tmp_path: Path) -> tuple[str, str]:
    fp32, int4 = tmp_path / "chain.onnx", tmp_path / "chain.int4.onnx"
    onnx.save(MODELS["chain"](), fp32)
    cim_int4.export_int4(fp32, int4, quiet=True)
    return str(fp32), str(int4)


def test_cli_validate_reference_backend(model_files: tuple[str, str], capsys) -> None:
    code, out, err = run_cli(["validate", *model_files, "--backend", "reference", "--threads", "1"], capsys)
    assert code == 0 and err == ""
    assert "native op vs reference op" in out
    assert all(f"matmul{i} " in out for i in range(4)) and out.count("   ok") == 4


def test_cli_validate_reports_a_kernel_bug(model_files: tuple[str, str], capsys, monkeypatch) -> None:
    flip_channel(monkeypatch, "matmul2", 0)
    code, out, err = run_cli(["validate", *model_files, "--backend", "reference", "--threads", "1"], capsys)
    assert code == 4 and "KERNEL BUG" in out
    assert "first divergent layer: matmul2" in out and "kernel bug" in out


def test_cli_validate_without_the_extra(model_files: tuple[str, str], capsys, monkeypatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "onnxruntime_extensions", None)
    code, out, err = run_cli(["validate", *model_files, "--backend", "reference"], capsys)
    assert code == 1 and out == ""
    assert err.strip() == "cim-int4: error: backend='reference' needs onnxruntime-extensions: " + (
        "pip install cim-int4[reference]"
    )
