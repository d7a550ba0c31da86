"""rotate=True: the residual stream turned by an orthogonal matrix folded into the weights, the same function."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cim_int4.exporter import ExportError, export_int4, export_with_summary, load_model
from cim_int4.exporter.rotate import FOLD_BITS, ROTATION_FOLD, NotRotatable, orthogonal, rotate_residual
from conftest import init, model_of, w
from onnx import helper, numpy_helper

from cim_int4 import make_session
from cim_int4.contract import OP_TYPE

GENAI = Path(__file__).resolve().parent / "genai"


def genai_feeds(model: onnx.ModelProto, ids: list[int]) -> dict[str, np.ndarray]:
    feeds = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, len(ids)), np.int64)}
    for i in model.graph.input:
        if i.name.startswith("past_key_values"):
            feeds[i.name] = np.zeros((1, 2, 0, 16), np.float32)
    return feeds


def logits(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(["logits"], feeds)[0]


def initializer(model: onnx.ModelProto, name: str) -> np.ndarray:
    return numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == name))


def test_orthogonal_is_orthogonal_and_reproducible() -> None:
    q = orthogonal(48, seed=3)
    np.testing.assert_allclose(q @ q.T, np.eye(48), atol=1e-12)
    np.testing.assert_array_equal(q, orthogonal(48, seed=3))
    assert not np.allclose(q, orthogonal(48, seed=4))


@pytest.mark.parametrize("folder", ["llama-fp32", "llama-tied-fp32"])
def test_rotation_keeps_the_builders_model_the_same_function(folder: str) -> None:
    model = load_model(GENAI / folder / "model.onnx")
    feeds = genai_feeds(model, [1, 17, 400, 999, 3, 250, 42])
    before = logits(model, feeds)
    rotated = onnx.ModelProto()
    rotated.CopyFrom(model)
    summary = rotate_residual(rotated)
    after = logits(rotated, feeds)
    np.testing.assert_allclose(after, before, rtol=0, atol=2e-5 * float(np.abs(before).max()))
    norms = [n for n in rotated.graph.node if "LayerNormalization" in n.op_type]
    assert summary.norms == len(norms) > 2
    for n in norms:  # every norm's weight went into its readers
        np.testing.assert_array_equal(initializer(rotated, n.input[-1]), 1.0)
    # The weights changed (not an identity), each MatMul's still 2-D float32 of its shape.
    head = next(n for n in model.graph.node if n.name == "/lm_head/MatMul")
    assert not np.allclose(initializer(model, head.input[1]), initializer(rotated, head.input[1]))
    fold = [n for n in rotated.graph.node if n.name == ROTATION_FOLD]
    assert (summary.fold_node == ROTATION_FOLD) == bool(fold) == (folder == "llama-tied-fp32")


def test_a_rotated_export_keeps_the_tied_table_once_and_the_fold_at_8_bits(tmp_path: Path) -> None:
    src = GENAI / "llama-tied-fp32" / "model.onnx"
    model = load_model(src)
    out = tmp_path / "rot.onnx"
    calib = genai_feeds(model, [5, 60, 700, 21, 900, 2, 33, 444])
    export_int4(src, out, quiet=True, external_data=True, rotate=True, bits=8, method="gptq", feeds=calib)
    # The rotated copy the export streamed from (beside the output) is gone.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rot.onnx", "rot.onnx.data"]
    q = load_model(out)
    fold = [n for n in q.graph.node if n.name == ROTATION_FOLD]
    assert [n.op_type for n in fold] == [OP_TYPE]
    assert {a.name: a.i for a in fold[0].attribute}["bits"] == FOLD_BITS  # near exact, hidden x hidden
    assert sum(n.op_type == OP_TYPE for n in q.graph.node) > 4
    # The head reads the table's int4 tensors (stored once), as without rotation.
    tables = [t for t in q.graph.initializer if t.data_type == onnx.TensorProto.UINT8 and t.dims[0] == 1000]
    assert len(tables) == 1
    feeds = genai_feeds(q, [1, 17, 400, 999, 3])
    got = make_session(q, threads=1).run(["logits"], feeds)[0]
    ref = logits(model, feeds)
    cos = float(np.dot(got.ravel(), ref.ravel()) / np.linalg.norm(got) / np.linalg.norm(ref))
    assert cos > 0.999  # 8-bit codes: the rotated export is the model's function up to their rounding
    # The summary says what the rotation did; the caller's proto is left as it was.
    before = model.SerializeToString()
    _, summary = export_with_summary(model, rotate=True, method="gptq", feeds=calib)
    assert model.SerializeToString() == before
    assert "rotation: hidden 64" in summary.format() and "final_norm_fold" in summary.format()


@pytest.mark.parametrize(
    ("bits", "fold_bits"),
    [
        (3, FOLD_BITS),
        ({"rotation/final_norm_fold": 6, ".*": 3}, 6),
        ({"rotation/.*": 5, ".*": 3}, 5),
        ({"/lm_head/MatMul": 5}, FOLD_BITS),
        ({"/lm_head/MatMul": 2, ".*": 3}, FOLD_BITS),  # the catch-all is the user's other layers, not the fold
    ],
)
def test_the_fold_gets_its_own_width_unless_bits_names_it(bits, fold_bits: int) -> None:
    model = load_model(GENAI / "llama-tied-fp32" / "model.onnx")
    calib = genai_feeds(model, [5, 60, 700, 21, 900, 2, 33, 444])
    q, summary = export_with_summary(model, rotate=True, bits=bits, method="gptq", feeds=calib)
    fold = next(n for n in q.graph.node if n.name == ROTATION_FOLD)
    assert {a.name: a.i for a in fold.attribute}.get("bits", 4) == fold_bits, summary.format()


# ---------------------------------------------------------------- graphs it refuses, in one line

H, V = 16, 40


def block(
    post_norm: bool = False,
    shared: bool = False,
    add_reader: bool = False,
    bad_gamma: bool = False,
    shared_writer: bool = False,
    subgraph: bool = False,
) -> onnx.ModelProto:
    """ids -> table -> norm -> MatMul -> (post norm) -> Skip norm -> MatMul: a stream that is or is not rotatable."""
    ms = "com.microsoft"
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["x"], name="embed"),
        helper.make_node("SimplifiedLayerNormalization", ["x", "g0"], ["n0"], name="norm0", axis=-1),
        helper.make_node("MatMul", ["n0", "W0"], ["b0"], name="proj0"),
    ]
    branch = "b0"
    if post_norm:  # Gemma's: the branch is normalized before it joins the stream
        nodes.append(helper.make_node("SimplifiedLayerNormalization", ["b0", "gp"], ["bp"], name="post", axis=-1))
        branch = "bp"
    nodes.append(
        helper.make_node(
            "SkipSimplifiedLayerNormalization", ["x", branch, "g1"], ["n1", "", "", "s1"], name="norm1", domain=ms
        )
    )
    nodes.append(helper.make_node("MatMul", ["n1", "W1"], ["y"], name="proj1"))
    outputs = [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 3, H])]
    if add_reader:
        nodes.append(helper.make_node("Add", ["s1", "s1"], ["z"], name="tap"))
        outputs.append(helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [1, 3, H]))
    if shared:
        nodes.append(helper.make_node("Identity", ["W1"], ["w1"], name="copy"))
        outputs.append(helper.make_tensor_value_info("w1", onnx.TensorProto.FLOAT, [H, H]))
    if shared_writer:  # W0 turns on both sides for proj0 (reads n0, writes b0): proj2 reads n1 through it
        nodes.append(helper.make_node("MatMul", ["n1", "W0"], ["y2"], name="proj2"))
        outputs.append(helper.make_tensor_value_info("y2", onnx.TensorProto.FLOAT, [1, 3, H]))
    if subgraph:
        body = helper.make_graph(
            [helper.make_node("Identity", ["y"], ["yy"])], "then", [], [helper.make_tensor_value_info("yy", 1, None)]
        )
        cond = helper.make_tensor("cond", onnx.TensorProto.BOOL, [], [True])
        nodes.append(helper.make_node("Constant", [], ["c"], value=cond))
        nodes.append(helper.make_node("If", ["c"], ["z2"], name="branch", then_branch=body, else_branch=body))
        outputs.append(helper.make_tensor_value_info("z2", onnx.TensorProto.FLOAT, [1, 3, H]))
    inits = [
        init("table", w(0, V, H)),
        init("g0", w(1, H + 2 * bad_gamma) + 2),
        init("g1", w(2, H) + 2),
        init("gp", w(3, H) + 2),
        init("W0", w(4, H, H)),
        init("W1", w(5, H, H)),
    ]
    ids = helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [1, 3])
    graph = helper.make_graph(nodes, "block", [ids], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ms, 1)])


FEEDS = {"ids": np.array([[3, 0, 39]], np.int64)}


def test_a_plain_rotatable_block_keeps_its_function() -> None:
    model = block()
    feeds = FEEDS
    sess = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])  # noqa: E731
    before = sess(model).run(["y"], feeds)[0]
    summary = rotate_residual(model)
    assert (summary.hidden, summary.norms, summary.readers, summary.writers, summary.tables) == (H, 2, 2, 1, 1)
    np.testing.assert_allclose(sess(model).run(["y"], feeds)[0], before, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("post_norm", r"node 'post' \(SimplifiedLayerNormalization\): its normalized output joins the residual stream"),
        ("add_reader", r"node 'tap' \(Add\): reads the residual stream 's1' but is not an RMS norm"),
        ("shared", r"node 'copy' \(Identity\): shares weight 'W1' with the MatMuls rotation turns"),
        ("shared_writer", r"node 'proj2' \(MatMul\): weight 'W0' is shared with the writer node 'proj0'"),
        ("subgraph", r"node 'branch' \(If\): holds a subgraph"),
        ("bad_gamma", r"node 'norm0' \(SimplifiedLayerNormalization\): its weight 'g0' has shape \[18\], not \[16\]"),
    ],
)
def test_a_stream_it_cannot_turn_is_refused_in_one_line(kind: str, message: str) -> None:
    model = block(**{kind: True})
    before = model.SerializeToString()
    with pytest.raises(NotRotatable, match=message):
        rotate_residual(model)
    assert model.SerializeToString() == before  # every check runs before the first weight changes
    with pytest.raises(ExportError, match="^rotate: .*" + message) as e:
        export_with_summary(block(**{kind: True}), rotate=True, method="gptq", feeds=FEEDS)
    assert "\n" not in str(e.value)


def test_a_graph_without_an_embedding_is_refused() -> None:
    model = model_of([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], [("x", [1, H])], [("y", [1, H])],
                     [init("W", w(1, H, H))])  # fmt: skip
    with pytest.raises(ExportError, match="rotate: no Gather on a 2-D float32 table"):
        export_with_summary(model, rotate=True, method="gptq", feeds={"x": w(2, 1, H)})


@pytest.mark.parametrize(("method", "feeds"), [("rtn", True), ("awq", True), ("auto", True), ("gptq", False)])
def test_rotation_without_a_calibrated_method_is_refused(method: str, feeds: bool) -> None:
    with pytest.raises(ValueError, match="rotate=True needs method 'gptq' or 'awq\\+gptq' and feeds"):
        export_with_summary(block(), rotate=True, method=method, feeds=FEEDS if feeds else None)


def test_a_refused_file_leaves_nothing_behind(tmp_path: Path) -> None:
    src = tmp_path / "in" / "post.onnx"
    src.parent.mkdir()
    onnx.save(block(post_norm=True), src)
    out = tmp_path / "out" / "q.onnx"
    out.parent.mkdir()
    with pytest.raises(ExportError, match="^rotate: .*post-norm"):
        export_int4(src, out, quiet=True, rotate=True, method="gptq", feeds=FEEDS)
    assert list(out.parent.iterdir()) == [] and [p.name for p in src.parent.iterdir()] == ["post.onnx"]


def test_a_rotated_file_exported_without_an_output_returns_a_whole_model(tmp_path: Path) -> None:
    src = tmp_path / "block.onnx"
    onnx.save(block(), src, save_as_external_data=True, location="block.onnx.data", size_threshold=0)
    q = export_int4(src, None, quiet=True, rotate=True, method="gptq", feeds=FEEDS, bits=8, group_size=16)
    got = make_session(q, threads=1).run(["y"], FEEDS)[0]
    ref = ort.InferenceSession(block().SerializeToString(), providers=["CPUExecutionProvider"]).run(["y"], FEEDS)[0]
    np.testing.assert_allclose(got, ref, rtol=0.05, atol=0.05 * float(np.abs(ref).max()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["block.onnx", "block.onnx.data"]
