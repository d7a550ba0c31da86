"""exporter/tune/graph.py: the NumPy decoder against ONNX Runtime's forward and against finite differences."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cim_int4.exporter.tune.graph import Graph
from cim_int4.graphs.genai_like import genai_feeds as feeds
from cim_int4.graphs.genai_like import genai_like


@pytest.mark.parametrize("gemma", [False, True])
def test_forward_matches_onnx_runtime(gemma):
    """Gemma's first layer attends locally (4 tokens of 12): ORT's window and ours must agree."""
    model = genai_like(gemma=gemma)
    f = feeds()
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(["logits"], f)[0]
    got = Graph(model).forward(f)[0]["logits"]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def _kl(logits: np.ndarray, ref: np.ndarray) -> tuple[float, np.ndarray]:
    z = logits - logits.max(-1, keepdims=True)
    lq = z - np.log(np.exp(z).sum(-1, keepdims=True))
    p = np.exp(ref)
    return float((p * (ref - lq)).sum()), np.exp(lq) - p


NAMES = ["lm_head.weight", "l0.qkv", "l0.o", "l1.gate", "l1.up", "l1.down", "l0.n1", "final"]
GEMMA = ["l0.qkv", "l1.qkv", "l0.q_norm", "l1.k_norm", "l0.post_attention", "l1.post_feedforward", "l1.gate", "l0.down"]


@pytest.mark.parametrize(("gemma", "name"), [(False, n) for n in NAMES] + [(True, n) for n in GEMMA])
def test_gradients_match_finite_differences(gemma, name):
    model = genai_like(gemma=gemma)
    graph = Graph(model, np.float64)
    f = feeds()
    values, tape = graph.forward(f)
    rng = np.random.default_rng(2)
    ref = values["logits"] + rng.normal(size=values["logits"].shape)
    ref = ref - np.log(np.exp(ref - ref.max(-1, keepdims=True)).sum(-1, keepdims=True)) - ref.max(-1, keepdims=True)
    _, dlogits = _kl(values["logits"], ref)
    grad = graph.backward(tape, {"logits": dlogits}, [name])[name]
    w = graph.constants[name]
    direction = rng.normal(size=w.shape)
    eps = 1e-6
    lp = _kl(graph.forward(f, {name: w + eps * direction})[0]["logits"], ref)[0]
    lm = _kl(graph.forward(f, {name: w - eps * direction})[0]["logits"], ref)[0]
    assert (grad * direction).sum() == pytest.approx((lp - lm) / (2 * eps), rel=1e-6)


def test_an_unknown_op_is_a_one_line_error():
    model = genai_like()
    model.graph.node[7].op_type = "Softmax"
    with pytest.raises(ValueError, match="node '.*': op Softmax is not one scale tuning runs"):
        Graph(model)


def test_a_padded_window_is_a_one_line_error():
    f = feeds()
    f["attention_mask"][0, :3] = 0
    with pytest.raises(ValueError, match="GroupQueryAttention node '.*': padded windows"):
        Graph(genai_like()).forward(f)


def test_a_reduction_on_the_gradient_path_is_a_one_line_error():
    model = genai_like()
    final = next(n for n in model.graph.node if n.output and n.output[0] == "logits")
    final.output[0] = "raw"
    model.graph.node.append(onnx.helper.make_node("ReduceSum", ["raw", "one"], ["logits"], name="sum", keepdims=1))
    graph = Graph(model)
    values, tape = graph.forward(feeds())
    with pytest.raises(ValueError, match="ReduceSum node 'sum': on the path from the weights to the loss"):
        graph.backward(tape, {"logits": np.ones_like(values["logits"])}, ["l0.qkv"])


def test_split_and_reshape_follow_onnx():
    """Split into equal parts (ceil, last smaller) and by sizes; Reshape's 0 and -1; a bad split names the node."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 7])
    nodes = [
        helper.make_node("Split", ["x"], ["a", "b", "c"], axis=1, num_outputs=3),
        helper.make_node("Split", ["x", "sizes"], ["d", "e"], axis=1),
        helper.make_node("Reshape", ["x", "shape"], ["f"]),
    ]
    inits = [onnx.numpy_helper.from_array(np.array([2, 5], np.int64), "sizes"),
             onnx.numpy_helper.from_array(np.array([0, -1, 7], np.int64), "shape")]  # fmt: skip
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "abcdef"]
    graph = helper.make_graph(nodes, "g", [x], outs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    f = {"x": np.arange(14, dtype=np.float32).reshape(2, 7)}
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, f)
    got = Graph(model).forward(f)[0]
    for name, e in zip("abcdef", expected, strict=True):
        np.testing.assert_array_equal(got[name], e)
    model.graph.initializer[0].CopyFrom(onnx.numpy_helper.from_array(np.array([2, 4], np.int64), "sizes"))
    with pytest.raises(ValueError, match=r"Split node 'd': parts \[2, 4\] of 7 into 2 outputs"):
        Graph(model).forward(f)
