"""The ``cim-int4`` command: export's flags build the API's ExportOptions; errors are one line with an exit code.

Every CLI test is here; a command's own behaviour is tested with its module.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from cim_int4.exporter import ExportOptions, quantize_weight
from cim_int4.graphs import matmul_chain, mlp
from cim_int4.ops.library import LIBRARY_ENV
from conftest import attribute_scales
from onnx import numpy_helper
from test_compare import (
    _edit_attribute,
    _int4,
    _layers,
    _save_external,
    _swap_nibbles_of_one_block,
    embedding_model,
)
from test_exporter import attributes, matmuls_model, nodes_by_name, sha256
from test_rewrite_patterns import input_initializer_model

import cim_int4
from cim_int4 import export_int4
from cim_int4.cli import DIVERGED, main
from cim_int4.contract import OP_TYPE


def cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``cim-int4 argv...`` in a child process, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "cim_int4.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    return lines[0]


@pytest.fixture
def models(tmp_path: Path) -> tuple[Path, Path]:
    """An FP32 MLP (input x [batch, 256]) and an INT4 model that does not match it (K = 64)."""
    fp32, other = tmp_path / "fp32.onnx", tmp_path / "other.int4.onnx"
    onnx.save(mlp(), fp32)
    export_int4(matmul_chain(1, 64), other, quiet=True)
    return fp32, other


def test_missing_library_is_one_line_with_exit_code_1(models: tuple[Path, Path], tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "libcim_int4_ops.so"
    proc = cli("validate", str(models[0]), str(models[1]), env={LIBRARY_ENV: str(missing)})
    assert proc.returncode == 1
    assert str(missing) in one_line_error(proc)


ARGV = {"export": ["export", "m.onnx", "-o", "o.onnx"], "validate": ["validate", "a.onnx", "b.onnx"]}


def main_with(command: str, func, monkeypatch: pytest.MonkeyPatch) -> int:
    """Exit code of ``cim-int4 COMMAND`` whose work is ``func`` (the real parser, main() and error handling)."""
    from cim_int4 import cli as cli_module

    parser = cli_module.build_parser()
    real_parse = parser.parse_args

    def parse(argv: list[str]) -> object:
        args = real_parse(argv)
        args.func = func
        return args

    monkeypatch.setattr(cli_module, "build_parser", lambda: parser)
    monkeypatch.setattr(parser, "parse_args", parse)
    return cli_module.main(ARGV.get(command, [command]))


@pytest.mark.parametrize("command", ["export", "validate", "demo", "bench"])
def test_os_error_is_one_line_with_exit_code_1(command: str, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: only FileNotFoundError was caught; PermissionError, ENOSPC and friends gave a traceback.
    def fail(args: object) -> int:
        raise PermissionError(13, "Permission denied", "/data/out.onnx")

    assert main_with(command, fail, monkeypatch) == 1
    assert capsys.readouterr().err.strip() == "cim-int4: error: /data/out.onnx: Permission denied"


@pytest.mark.parametrize("command", ["export", "validate", "demo", "bench"])
def test_ort_error_is_one_line_with_exit_code_5(command: str, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: an ORT error that a command did not catch itself ended in ORT's traceback.
    def fail(args: object) -> int:
        ort.InferenceSession(b"not a model", providers=["CPUExecutionProvider"])
        return 0

    assert main_with(command, fail, monkeypatch) == 5
    err = capsys.readouterr().err
    assert err.startswith("cim-int4: onnxruntime error: ") and err.count("\n") == 1, err


def test_export_of_bad_external_data_is_one_line(tmp_path: Path) -> None:
    src = tmp_path / "model.onnx"
    model = mlp()
    onnx.save(model, src, save_as_external_data=True, location="w.bin", size_threshold=0)
    (tmp_path / "w.bin").unlink()
    proc = cli("export", str(src), "-o", str(tmp_path / "out.onnx"))
    assert proc.returncode == 1
    assert "w.bin" in one_line_error(proc)


def test_export_of_an_int4_model_exits_3_saying_so(models: tuple[Path, Path], tmp_path: Path) -> None:
    proc = cli("export", str(models[1]), "-o", str(tmp_path / "again.onnx"))
    assert proc.returncode == 3 and "already quantized" in proc.stderr


# ---------------------------------------------------------------- export's flags are one ExportOptions


def test_export_flags_build_the_options_the_api_takes() -> None:
    from cim_int4.cli import build_parser, export_options

    argv = ["export", "m.onnx", "-o", "o.onnx", "--group-size", "64", "--compute", "int8", "--exclude", "a", "b"]
    argv += ["--min-size", "7", "--scale-rule", "signed", "--external-data", "--no-fold-input-initializers"]
    argv += ["--rotate", "--method", "gptq", "--feeds", "d.npz"]
    got = export_options(build_parser().parse_args(argv))
    assert got == ExportOptions(
        group_size=64, compute="int8", exclude=("a", "b"), min_size=7, scale_rule="signed",
        external_data=True, fold_input_initializers=False, rotate=True, method="gptq", feeds="d.npz",
    )
    assert export_options(build_parser().parse_args(["export", "m.onnx", "-o", "o.onnx"])) == ExportOptions()


def test_unknown_option_keyword_names_the_known_ones() -> None:
    with pytest.raises(TypeError, match="unknown export option.*group_sise.*group_size"):
        export_int4(mlp(), group_sise=64, quiet=True)


# ---------------------------------------------------------------- cim-int4 export


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    cli = pytest.importorskip("cim_int4.cli")
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse and sys.exit paths
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def mlp_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.onnx"
    onnx.save(mlp(), path)
    return path


def test_cli_export(mlp_file: Path, capsys) -> None:
    out = mlp_file.with_name("out.onnx")
    code, _, _ = run_cli(["export", str(mlp_file), "-o", str(out)], capsys)
    assert code == 0
    q = onnx.load(out)
    assert [n.name for n in q.graph.node if n.op_type == OP_TYPE] == ["fc0", "fc1", "fc2"]
    assert attributes(nodes_by_name(q)["fc0"])["group_size"] == 32


def test_cli_options(mlp_file: Path, capsys) -> None:
    out = mlp_file.with_name("out.onnx")
    argv = ["export", str(mlp_file), "-o", str(out), "--group-size", "64", "--exclude", "fc0", "--min-size", "100000"]
    code, _, _ = run_cli(argv, capsys)
    assert code == 0
    ops = nodes_by_name(onnx.load(out))
    # fc0 excluded, fc2 (65536 elements) under min-size: only fc1 is quantized.
    assert [n for n, node in ops.items() if node.op_type == OP_TYPE] == ["fc1"]
    assert attributes(ops["fc1"])["group_size"] == 64


@pytest.mark.parametrize(
    "exclude",
    [
        pytest.param(["--exclude", "fc0", r"fc[2]"], id="one flag, two values"),
        pytest.param(
            ["--exclude", "fc0", "--exclude", r"fc[2]"],
            id="repeated flag",
        ),
    ],
)
def test_cli_exclude_several_names_and_regex(exclude: list[str], mlp_file: Path, capsys) -> None:
    out = mlp_file.with_name("out.onnx")
    code, _, _ = run_cli(["export", str(mlp_file), "-o", str(out), *exclude], capsys)
    assert code == 0
    assert [n.name for n in onnx.load(out).graph.node if n.op_type == OP_TYPE] == ["fc1"]


def test_cli_bad_file(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"this is not an onnx model\n")
    code, _, err = run_cli(["export", str(bad), "-o", str(tmp_path / "out.onnx")], capsys)
    assert code != 0 and str(bad) in err
    assert not (tmp_path / "out.onnx").exists()


def test_cli_missing_file(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "missing.onnx"
    code, _, err = run_cli(["export", str(missing), "-o", str(tmp_path / "out.onnx")], capsys)
    assert code != 0 and str(missing) in err


def test_cli_nothing_to_quantize(tmp_path: Path, capsys) -> None:
    path = tmp_path / "dynamic.onnx"
    onnx.save(matmuls_model({"dynamic": None}), path)
    code, _, err = run_cli(["export", str(path), "-o", str(tmp_path / "out.onnx")], capsys)
    assert code != 0 and "nothing to quantize" in err
    assert not (tmp_path / "out.onnx").exists()


def test_cli_refuses_output_equal_to_input(mlp_file: Path, capsys) -> None:
    before = sha256(mlp_file)
    code, _, err = run_cli(["export", str(mlp_file), "-o", str(mlp_file)], capsys)
    assert code != 0 and "input" in err
    assert sha256(mlp_file) == before



def test_cli_scale_rule_and_compute(mlp_file: Path, capsys) -> None:
    out = mlp_file.with_name("out.onnx")
    code, stdout, _ = run_cli(
        ["export", str(mlp_file), "-o", str(out), "--scale-rule", "signed", "--compute", "int8"], capsys
    )
    assert code == 0 and "scale rule signed, compute int8" in stdout
    node = nodes_by_name(onnx.load(out))["fc0"]
    assert attributes(node)["compute"] == b"int8"
    w = numpy_helper.to_array(next(t for t in onnx.load(mlp_file).graph.initializer if t.name == "fc0.weight"))
    np.testing.assert_array_equal(attribute_scales(attributes(node)), quantize_weight(w, 32, "signed").scales)
    for bad in (["--scale-rule", "median"], ["--compute", "fp16"]):
        code, _, err = run_cli(["export", str(mlp_file), "-o", str(out), *bad], capsys)
        assert code == 2 and "invalid choice" in err



def test_cli_fold_and_simplify_flags(tmp_path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    monkeypatch.setitem(sys.modules, "onnxsim", None)
    src = tmp_path / "m.onnx"
    onnx.save(input_initializer_model(), src)
    assert _main(["export", str(src), "-o", str(tmp_path / "a.onnx"), "--simplify"]) == 0
    out = capsys.readouterr().out
    assert "warning: quantized 2 initializer(s) also listed as graph inputs" in out and "onnxsim" in out
    assert _main(["export", str(src), "-o", str(tmp_path / "b.onnx"), "--no-fold-input-initializers"]) == 3
    assert "also listed as a graph input" in capsys.readouterr().err


def _main(argv: list[str]) -> int:
    from cim_int4.cli import main

    return main(argv)


# ---------------------------------------------------------------- validate


def test_validate_cli_on_int64_and_bool_inputs_writes_json_and_plot(tmp_path, capsys) -> None:
    fp32 = embedding_model()
    onnx.save(fp32, tmp_path / "fp32.onnx")
    onnx.save(_int4(fp32), tmp_path / "int4.onnx")
    out_json, out_png = tmp_path / "v.json", tmp_path / "v.png"
    argv = [
        "validate",
        str(tmp_path / "fp32.onnx"),
        str(tmp_path / "int4.onnx"),
        "--dim",
        "sequence_length=6",
        "--json",
        str(out_json),
        "--threads",
        "1",
    ]
    plotting = importlib.util.find_spec("matplotlib") is not None
    if plotting:
        argv += ["--plot", str(out_png)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "rel L2" in out and "SNR dB" in out and "every CimInt4MatMul (2)" in out
    data = json.loads(out_json.read_text())
    assert data["first_divergent"] is None
    assert data["feeds"]["input_ids"] == {"shape": [1, 6], "dtype": "int64"}
    assert [r["name"] for r in data["rows"]] == ["h", "y0", "y"]
    assert data["rows"][2]["layer"] is None and data["rows"][0]["layer"]["worst"] <= 1.0
    if plotting:
        assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_validate_cli_reports_a_divergent_layer_with_its_exit_code(tmp_path, capsys) -> None:
    fp32 = embedding_model()
    bad = _edit_attribute(_int4(fp32), 1, "packed", _swap_nibbles_of_one_block)
    onnx.save(fp32, tmp_path / "fp32.onnx")
    onnx.save(bad, tmp_path / "bad.onnx")
    npz = tmp_path / "feeds.npz"
    np.savez(npz, input_ids=np.array([[4, 5, 6, 7]], dtype=np.int64), use_output=np.array(True))
    assert main(["validate", str(tmp_path / "fp32.onnx"), str(tmp_path / "bad.onnx"), "--feeds", str(npz)]) == DIVERGED
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(f"first divergent layer: {_layers(bad)[1].name}")


def test_mismatched_models_give_one_line_naming_the_difference(capsys, tmp_path) -> None:
    fp32 = matmul_chain(4, 128, seed=3)
    other = _int4(embedding_model())
    with pytest.raises(cim_int4.CompareError, match="input 'x' only in the FP32 model"):
        cim_int4.compare(fp32, other)
    onnx.save(fp32, tmp_path / "a.onnx")
    onnx.save(other, tmp_path / "b.onnx")
    assert main(["validate", str(tmp_path / "a.onnx"), str(tmp_path / "b.onnx")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "input 'input_ids' only in the INT4 model" in err
    assert main(["validate", str(tmp_path / "a.onnx"), str(tmp_path / "missing.onnx")]) == 1
    assert "missing.onnx: no such file" in capsys.readouterr().err


def test_external_data_embedding_model_through_the_cli(tmp_path) -> None:
    fp32 = embedding_model()
    _save_external(fp32, tmp_path / "fp32.onnx")
    _save_external(_int4(fp32), tmp_path / "int4.onnx")
    assert main(["validate", str(tmp_path / "fp32.onnx"), str(tmp_path / "int4.onnx"), "--int-range", "0:7"]) == 0
