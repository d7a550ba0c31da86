"""cim_int4.compare (module validate) and ``cim-int4 validate``: rows, the two layer checks, inputs, external data."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from cim_int4.exporter import export_with_summary
from cim_int4.graphs import OPSET, guess_vocabulary, matmul_chain, model_feeds, random_input
from cim_int4.graphs._common import IR_VERSION, initializer, weight_matrix
from cim_int4.ops import reference
from conftest import attribute_scales
from onnx import TensorProto, helper, numpy_helper

import cim_int4
from cim_int4 import layercheck
from cim_int4 import validate as compare_module
from cim_int4.contract import COMPUTE_CONFIG, OP_TYPE

VOCAB = 50


def _int4(model: onnx.ModelProto) -> onnx.ModelProto:
    return export_with_summary(model)[0]


def _layers(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == OP_TYPE]


def _edit_attribute(model: onnx.ModelProto, layer: int, name: str, edit) -> onnx.ModelProto:
    """A copy of ``model`` whose ``layer``-th CimInt4MatMul has attribute ``name`` replaced by ``edit(array)``."""
    bad = onnx.ModelProto()
    bad.CopyFrom(model)
    attr = next(a for a in _layers(bad)[layer].attribute if a.name == name)
    attr.t.CopyFrom(numpy_helper.from_array(edit(numpy_helper.to_array(attr.t)), name))
    return bad


def _swap_nibbles_of_one_block(packed: np.ndarray) -> np.ndarray:
    # Output channels 16..31, the bytes of their first group: a kernel reading one tile's nibbles the wrong way round.
    out = packed.copy()
    block = out[16:32, :16]
    out[16:32, :16] = (block << 4) | (block >> 4)
    return out


@pytest.fixture(scope="module")
def chain() -> tuple[onnx.ModelProto, onnx.ModelProto]:
    fp32 = matmul_chain(4, 128, seed=3)
    return fp32, _int4(fp32)


def test_healthy_model_has_no_divergent_layer_and_rows_in_graph_order(chain) -> None:
    fp32, int4 = chain
    report = cim_int4.compare(fp32, int4, dims={"M": 5})
    layers = _layers(int4)
    assert [r.name for r in report.rows] == [n.output[0] for n in layers]  # the last layer's output is the graph's
    assert report.first_divergent is None
    for row in report.rows:
        assert row.shape == (5, 128)
        # INT4 noise: neither zero (the op ran FP32) nor large (a wrong format).
        assert 1e-3 < row.rel_l2 < 0.3 and 0.95 < row.cosine < 1.0
        assert row.snr_db == pytest.approx(-20 * math.log10(row.rel_l2))
        assert row.layer is not None and row.layer.ok and row.layer.worst <= 1.0
        assert row.layer.rel_l2 < 1e-5  # alone, the op is its dequantized weights up to FP32 rounding
        assert row.layer.code_steps is not None and row.layer.code_steps <= 0.5 + 1e-3  # round to nearest
        assert 1e-3 < row.layer.own_rel_l2 <= row.rel_l2 * 1.5  # one layer's int4 error, not the chain's
    assert "first divergent" not in report.summary()


@pytest.mark.parametrize("layer", [0, 2])
def test_swapped_nibbles_in_one_block_are_found_at_exactly_that_layer(chain, layer: int) -> None:
    fp32, int4 = chain
    bad = _edit_attribute(int4, layer, "packed", _swap_nibbles_of_one_block)
    report = cim_int4.compare(fp32, bad, dims={"M": 3})
    assert report.first_divergent == _layers(int4)[layer].name
    assert [c.ok for c in report.layers] == [i != layer for i in range(4)]
    # The kernel computes what the (wrong) file says; the weights no longer round the FP32 ones.
    assert report.layers[layer].kernel_ok and report.layers[layer].code_steps > 1.5
    assert report.first_divergent in report.summary()


def test_scales_read_along_the_wrong_axis_are_found(chain) -> None:
    fp32, int4 = chain
    # The same values, laid out as if groups ran along N: what a wrong group axis reads.
    bad = _edit_attribute(int4, 1, "scales", lambda s: np.ascontiguousarray(s.T).reshape(s.shape))
    assert cim_int4.compare(fp32, bad, dims={"M": 2}).first_divergent == _layers(int4)[1].name


class _MisreadingSession:
    """A session whose CimInt4MatMul reads one block's nibbles swapped: a kernel bug with a correct file."""

    def __init__(self, model: onnx.ModelProto) -> None:
        node = model.graph.node[0]
        self.attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}

    def run(self, names, feeds):
        a = self.attrs
        packed = _swap_nibbles_of_one_block(numpy_helper.to_array(a["packed"]))
        y = reference.matmul(feeds["A"], packed, attribute_scales(a), a["K"], a["group_size"])
        return [y.astype(np.float32)]


def test_a_kernel_misreading_the_format_is_found_at_exactly_that_layer(chain, monkeypatch) -> None:
    fp32, int4 = chain
    real = layercheck.make_session
    target = _layers(int4)[1].name

    def session(model, **kwargs):
        if isinstance(model, onnx.ModelProto) and model.graph.node[0].name == target:
            return _MisreadingSession(model)
        return real(model, **kwargs)

    monkeypatch.setattr(layercheck, "make_session", session)
    report = compare_module.compare(fp32, int4, dims={"M": 3})
    assert report.first_divergent == target
    bad = report.layers[1]
    assert not bad.kernel_ok and bad.worst > 100 and bad.weights_ok
    assert "outside the bound" in report.summary()


def test_compute_mode_is_set_per_session_and_holds_each_layer_to_it(chain, monkeypatch) -> None:
    fp32, int4 = chain
    real = compare_module.make_session
    configs = []

    class Int8Kernel:
        """What a library honouring cim_int4.compute=int8 computes for a layer alone."""

        def __init__(self, model: onnx.ModelProto) -> None:
            self.attrs = {a.name: helper.get_attribute_value(a) for a in model.graph.node[0].attribute}

        def run(self, names, feeds):
            a = self.attrs
            packed, scales = numpy_helper.to_array(a["packed"]), attribute_scales(a)
            return [reference.emulate(feeds["A"], packed, scales, a["K"], a["group_size"], compute="int8")]

    def session(model, config=None, **kwargs):
        configs.append(dict(config or {}))
        if isinstance(model, onnx.ModelProto) and model.graph.name == "alone":
            return Int8Kernel(model)
        return real(model, config=config, **kwargs)

    monkeypatch.setattr(layercheck, "make_session", session)
    monkeypatch.setattr(compare_module, "make_session", session)
    report = compare_module.compare(fp32, int4, dims={"M": 4}, compute="int8")
    assert report.first_divergent is None and {c.compute for c in report.layers} == {"int8"}
    assert configs and all(c.get(COMPUTE_CONFIG) == "int8" for c in configs)
    # The same int8 results held to the nodes' own mode (fp32, no attribute) are far outside its rounding.
    report = compare_module.compare(fp32, int4, dims={"M": 4})
    assert report.first_divergent == _layers(int4)[0].name and not report.layers[0].kernel_ok
    with pytest.raises(cim_int4.CompareError, match="compute must be one of"):
        compare_module.compare(fp32, int4, compute="int4")


# ---------------------------------------------------------------- models with integer and bool inputs


def embedding_model() -> onnx.ModelProto:
    """input_ids int64 [batch, seq] -> Gather(embedding [VOCAB, 64]) -> 2 MatMuls, scaled by a bool flag."""
    rng = np.random.default_rng(7)
    nodes = [
        helper.make_node("Cast", ["input_ids"], ["ids32"], to=TensorProto.INT32),
        helper.make_node("Gather", ["embedding", "ids32"], ["x"]),
        helper.make_node("MatMul", ["x", "w0"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("MatMul", ["r", "w1"], ["y0"]),
        helper.make_node("Cast", ["use_output"], ["flag"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["y0", "flag"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "embedding",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence_length"]),
            helper.make_tensor_value_info("use_output", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "sequence_length", 32])],
        [
            initializer("embedding", rng.standard_normal((VOCAB, 64), dtype=np.float32)),
            initializer("w0", weight_matrix(rng, 64, 96)),
            initializer("w1", weight_matrix(rng, 96, 32)),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    return model


def test_generated_inputs_follow_the_input_specs() -> None:
    model = embedding_model()
    assert guess_vocabulary(model, "input_ids") == VOCAB  # through the Cast
    feeds = random_input(model, {"batch": 2})
    ids = feeds["input_ids"]
    assert ids.dtype == np.int64 and ids.shape == (2, 8)
    assert ids.min() >= 0 and ids.max() < VOCAB and len(np.unique(ids)) > 3
    assert feeds["use_output"].dtype == np.bool_ and feeds["use_output"].shape == () and feeds["use_output"]
    ranged = random_input(model, int_range=(10, 12))["input_ids"]
    assert set(np.unique(ranged)) <= {10, 11}
    unnamed = helper.make_tensor_value_info("ids", TensorProto.INT32, [None, 3])
    lone = helper.make_model(helper.make_graph([], "g", [unnamed], []))
    assert random_input(lone)["ids"].shape == (4, 3)  # DEFAULT_UNNAMED_DIM


def test_given_feeds_are_checked_and_completed() -> None:
    model = embedding_model()
    ids = np.array([[1, 2, 3]], dtype=np.int64)
    feeds = model_feeds(model, {"input_ids": ids})
    assert feeds["input_ids"] is ids and feeds["use_output"].dtype == np.bool_
    with pytest.raises(ValueError, match="'nope'"):
        model_feeds(model, {"nope": ids})
    with pytest.raises(ValueError, match="'input_ids' is float32"):
        model_feeds(model, {"input_ids": ids.astype(np.float32)})


# ---------------------------------------------------------------- external data


def _save_external(model: onnx.ModelProto, path) -> None:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    onnx.save_model(
        copy,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=path.name + ".data",
        size_threshold=0,
        convert_attribute=True,  # the int4 weights are node attributes
    )


def test_external_data_models_compare_like_in_memory_ones(tmp_path, chain) -> None:
    fp32, int4 = chain
    for sub, model in (("a", fp32), ("b", int4)):
        (tmp_path / sub).mkdir()
        _save_external(model, tmp_path / sub / "model.onnx")
    reloaded = onnx.load(str(tmp_path / "b" / "model.onnx"), load_external_data=False)
    assert any(a.t.data_location == TensorProto.EXTERNAL for n in _layers(reloaded) for a in n.attribute)
    in_memory = cim_int4.compare(fp32, int4, dims={"M": 4}, seed=1)
    on_disk = cim_int4.compare(tmp_path / "a" / "model.onnx", tmp_path / "b" / "model.onnx", dims={"M": 4}, seed=1)
    assert on_disk.first_divergent is None
    assert [(r.name, r.rel_l2, r.layer.worst) for r in on_disk.rows] == [
        (r.name, r.rel_l2, r.layer.worst) for r in in_memory.rows
    ]
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["model.onnx", "model.onnx.data"]  # nothing left


def test_a_tied_lm_head_is_checked_like_any_layer() -> None:
    # The default export of a tied model gives the LM head its codes and scales as inputs (shared with
    # the int4 embedding): validation must run that layer alone and cross-check it, not call it broken.
    from pathlib import Path

    fp32 = onnx.load(str(Path(__file__).parent / "genai" / "llama-tied-fp32" / "model.onnx"))
    int4, summary = export_with_summary(fp32)
    tied = [n for n in int4.graph.node if n.op_type == OP_TYPE and len(n.input) > 1]
    assert len(tied) == 1, "the fixture's LM head should read the embedding's tensors"
    dims = {"batch_size": 1, "sequence_length": 8, "total_sequence_length": 8, "past_sequence_length": 0,
            "kv_cache_dim": 16}
    report = cim_int4.compare(fp32, int4, dims=dims, threads=1, backend_check=True)
    assert report.first_divergent is None, report.format_table()
    checked = {layer.node: layer for layer in report.layers}
    assert tied[0].name in checked and checked[tied[0].name].error is None
    assert tied[0].name in {layer.node for layer in report.backends}
