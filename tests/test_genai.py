"""onnxruntime-genai end to end: ``cim-int4 genai`` folders generate like MatMulNBits; skipped without genai."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from cim_int4.exporter import ExportError
from cim_int4.ops.library import LIBRARY_NAME

from cim_int4 import library_path
from cim_int4.cli import main
from cim_int4.contract import OP_TYPE
from cim_int4.genai import CONFIG_NAME, OPTION, default_output, prepare
from cim_int4.genai_bench import agreement, greedy, load, logits_along, with_accuracy_level

og = pytest.importorskip("onnxruntime_genai")

FIXTURES = Path(__file__).parent / "genai"  # made by tests/genai/make_models.py
INT4, FP32 = FIXTURES / "llama-int4", FIXTURES / "llama-fp32"
STEPS = 16


def tree_digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()
    }


def prompts(count: int = 3, length: int = 8) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, 1000, length).tolist() for _ in range(count)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("genai")
    before = tree_digest(INT4), tree_digest(FP32)
    made = {
        "fp32": FP32,
        "nbits_acc4": INT4,
        # The builder's CPU default is accuracy_level 4: compare like with like at level 0 / fp32 compute.
        "nbits_acc0": with_accuracy_level(INT4, work / "nbits-acc0", 0),
        "cim_fp32": prepare(INT4, work / "cim-fp32", compute="fp32", quiet=True),
        "cim_auto": prepare(INT4, work / "cim-auto", quiet=True),
        "cim_export": prepare(FP32, work / "cim-export", quiet=True),
    }
    assert (tree_digest(INT4), tree_digest(FP32)) == before, "prepare must not modify the input folder"
    return made


@pytest.mark.parametrize("name", ["cim_fp32", "cim_auto", "cim_export"])
def test_prepared_folder(name: str, folders: dict[str, Path]) -> None:
    folder = folders[name]
    lib = folder / LIBRARY_NAME
    assert lib.is_file() and not lib.is_symlink(), "genai refuses a symlink that leads out of the model folder"
    assert lib.read_bytes() == Path(library_path()).read_bytes()
    config = json.loads((folder / CONFIG_NAME).read_text())
    assert config["model"]["decoder"]["session_options"][OPTION] == LIBRARY_NAME
    model = onnx.load(str(folder / "model.onnx"))
    ops = [n.op_type for n in model.graph.node]
    assert OP_TYPE in ops and "MatMulNBits" not in ops and "MatMul" not in ops
    # 2 layers x (qkv, o, gate and up as one gated node, down) + lm_head
    assert ops.count(OP_TYPE) == 9 and "Sigmoid" not in ops and "QuickGelu" not in ops
    # The converted weights go to a new model.onnx.data (ORT then keeps one copy of them, not two).
    data = folder / "model.onnx.data"
    assert data.stat().st_size < (INT4 / "model.onnx.data").stat().st_size
    nodes = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph.node
    weights = [a.t for n in nodes if n.op_type == OP_TYPE for a in n.attribute if a.name == "packed"]
    assert len(weights) == 9 and all(t.data_location == onnx.TensorProto.EXTERNAL for t in weights)
    assert (folder / "tokenizer.json").read_bytes() == (INT4 / "tokenizer.json").read_bytes()
    compute = {a.s for n in model.graph.node for a in n.attribute if a.name == "compute"}
    # The converter writes the attribute only for int8; the exporter writes it on every node.
    # Exported from FP32, "auto" is int8: the builder's int4 (accuracy_level 4) quantizes activations too.
    expected = {"cim_fp32": set(), "cim_auto": {b"int8"}, "cim_export": {b"int8"}}
    assert compute == expected[name]


def test_converted_generates_like_matmulnbits_accuracy_level_0(folders: dict[str, Path]) -> None:
    models = {k: load(folders[k], threads=1) for k in ("fp32", "nbits_acc0", "cim_fp32")}
    for prompt in prompts():
        tokens = {k: greedy(m, prompt, STEPS).tokens for k, m in models.items()}
        # Same weights, both computing in FP32: only the summation order differs.
        assert tokens["cim_fp32"] == tokens["nbits_acc0"], prompt
        assert agreement(tokens["cim_fp32"], tokens["fp32"]) >= agreement(tokens["nbits_acc0"], tokens["fp32"])
        ref = logits_along(models["nbits_acc0"], prompt, tokens["fp32"])
        got = logits_along(models["cim_fp32"], prompt, tokens["fp32"])
        assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


def test_int4_folders_are_as_close_to_fp32_as_matmulnbits(folders: dict[str, Path]) -> None:
    """Teacher-forced logits along the FP32 model's greedy path: relative error of each INT4 variant."""
    labels = ("fp32", "nbits_acc0", "nbits_acc4", "cim_export", "cim_auto")
    models = {k: load(folders[k], threads=1) for k in labels}
    errors: dict[str, list[float]] = {k: [] for k in labels[1:]}
    for prompt in prompts():
        tokens = greedy(models["fp32"], prompt, STEPS).tokens
        ref = logits_along(models["fp32"], prompt, tokens)
        for k in errors:
            errors[k].append(np.linalg.norm(logits_along(models[k], prompt, tokens) - ref) / np.linalg.norm(ref))
    e = {k: float(np.mean(v)) for k, v in errors.items()}
    # Our exporter vs ORT's quantizer, both INT4 block 32 symmetric, both with int8 activations
    # (the export's genai default; the builder's accuracy_level 4).
    assert 0 < e["cim_export"] <= 1.25 * e["nbits_acc4"], e
    # Converted at the builder's accuracy_level 4 (compute int8): as close as MatMulNBits' int8 path.
    assert 0 < e["cim_auto"] <= 1.1 * e["nbits_acc4"], e


def test_genai_needs_the_library(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = shutil.copytree(folders["cim_fp32"], tmp_path / "nolib")
    config = json.loads((folder / CONFIG_NAME).read_text())
    del config["model"]["decoder"]["session_options"][OPTION]
    (folder / CONFIG_NAME).write_text(json.dumps(config))
    with pytest.raises(Exception, match="CimInt4MatMul"):
        og.Model(str(folder))


def test_genai_bench_cli_smoke(tmp_path: Path, capsys) -> None:
    out = tmp_path / "r.json"
    argv = ["genai-bench", str(INT4), "--prompt-len", "4", "--steps", "4", "--repeats", "1", "--threads", "1"]
    assert main([*argv, "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    labels = ["MatMulNBits acc4", "MatMulNBits acc0", "cim-int4 fp32", "cim-int4 auto (int8 where acc4)"]
    assert list(results) == labels
    assert all(r["decode_tokens_per_s"] > 0 and len(r["tokens"]) == 4 for r in results.values())
    assert results["cim-int4 fp32"]["tokens"] == results["MatMulNBits acc0"]["tokens"]
    table = capsys.readouterr().out
    assert all(label in table for label in labels)


def test_cli_genai_default_output_and_refusals(tmp_path: Path, capsys) -> None:
    src = shutil.copytree(INT4, tmp_path / "model")
    assert main(["genai", str(src)]) == 0
    out = default_output(src)
    assert out == tmp_path / "model-cim-int4" and (out / LIBRARY_NAME).is_file()
    assert "11 MatMulNBits node(s) converted" in capsys.readouterr().out
    assert main(["genai", str(src)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert main(["genai", str(tmp_path / "nowhere"), "-o", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert "not an onnxruntime-genai model folder" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], "no temporary folder left behind"


def test_folder_without_anything_to_convert(tmp_path: Path) -> None:
    src = tmp_path / "m"
    src.mkdir()
    (src / CONFIG_NAME).write_text((INT4 / CONFIG_NAME).read_text())
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "g", [x], [x])
    graph.output[0].name = "y"
    onnx.save_model(onnx.helper.make_model(graph), src / "model.onnx")
    with pytest.raises(ExportError, match="no model in the folder"):
        prepare(src, tmp_path / "out", quiet=True)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / CONFIG_NAME).write_text("{not json"), "not readable JSON"),
        (lambda d: (d / CONFIG_NAME).write_text('{"model": 3}'), "has no 'model' object"),
        (lambda d: (d / "model.onnx").unlink(), "named by genai_config.json model.decoder.filename but missing"),
        (lambda d: (d / "model.onnx").write_bytes(b"junk"), "not a readable ONNX model"),
    ],
)
def test_cli_genai_bad_folder(damage, message: str, tmp_path: Path, capsys) -> None:
    src = shutil.copytree(INT4, tmp_path / "model")
    damage(src)
    assert main(["genai", str(src), "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"], "nothing written, no temporary folder left"


def test_model_in_a_subfolder(tmp_path: Path) -> None:
    src = shutil.copytree(INT4, tmp_path / "model")
    (src / "onnx").mkdir()
    for name in ("model.onnx", "model.onnx.data"):
        (src / name).rename(src / "onnx" / name)
    config = json.loads((src / CONFIG_NAME).read_text())
    config["model"]["decoder"]["filename"] = "onnx/model.onnx"
    (src / CONFIG_NAME).write_text(json.dumps(config))
    out = prepare(src, tmp_path / "out", compute="fp32", quiet=True)
    assert sorted(p.name for p in (out / "onnx").iterdir()) == ["model.onnx", "model.onnx.data"]
    prompt = prompts(1)[0]
    acc0 = with_accuracy_level(src, tmp_path / "acc0", 0)
    assert sorted(p.name for p in (acc0 / "onnx").iterdir()) == ["model.onnx"]
    want = greedy(load(acc0, threads=1), prompt, 4).tokens
    assert greedy(load(out, threads=1), prompt, 4).tokens == want


@pytest.mark.parametrize("compute", ["int8", "fp32", "auto"])
def test_exported_folder_takes_the_compute_mode_asked_for(compute: str, tmp_path: Path) -> None:
    # An FP32 folder is exported, not converted: an explicit mode must reach its nodes; "auto" is int8
    # there, the like-for-like mode of the builder's own int4 (MatMulNBits accuracy_level 4).
    out = prepare(FP32, tmp_path / "out", compute=compute, quiet=True)
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    modes = {a.s.decode() for n in model.graph.node if n.op_type == OP_TYPE for a in n.attribute if a.name == "compute"}
    assert modes == {"int8" if compute == "auto" else compute}


@pytest.mark.parametrize("scale_dtype", [None, "float32"])
def test_exported_folder_takes_the_scale_dtype_asked_for(scale_dtype: str | None, tmp_path: Path) -> None:
    # int8 scales unless asked otherwise (`cim-int4 genai --scale-dtype float32` keeps the older files).
    args = ["genai", str(FP32), "-o", str(tmp_path / "out"), "-q"]
    assert main(args + (["--scale-dtype", scale_dtype] if scale_dtype else [])) == 0
    model = onnx.load(str(tmp_path / "out" / "model.onnx"))
    dtypes = {
        onnx.numpy_helper.to_array(a.t).dtype.name
        for n in model.graph.node
        if n.op_type == OP_TYPE
        for a in n.attribute
        if a.name == "scales"
    }
    assert dtypes == {scale_dtype or "int8"}


@pytest.mark.parametrize("source", [FP32, INT4], ids=["exported", "converted"])
def test_no_fuse_gated_keeps_each_projection_a_node(source: Path, tmp_path: Path) -> None:
    # `cim-int4 genai --no-fuse-gated`: 2 layers x (qkv, o, gate, up, down) + lm_head, as before the fusion.
    assert main(["genai", str(source), "-o", str(tmp_path / "apart"), "--no-fuse-gated", "-q"]) == 0
    ops = [n.op_type for n in onnx.load(str(tmp_path / "apart" / "model.onnx"), load_external_data=False).graph.node]
    assert ops.count(OP_TYPE) == 11
    if source == INT4:  # and `cim-int4 convert --no-fuse-gated` on the builder's int4 file
        assert main(["convert", str(INT4 / "model.onnx"), "-o", str(tmp_path / "c.onnx"), "--no-fuse-gated", "-q"]) == 0
        assert [n.op_type for n in onnx.load(str(tmp_path / "c.onnx")).graph.node].count(OP_TYPE) == 11
