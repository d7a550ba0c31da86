"""The CLI turns OSError and ONNX Runtime errors into one-line messages with an exit code, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest
from cim_int4.graphs import matmul_chain, mlp
from cim_int4.ops.library import LIBRARY_ENV

from cim_int4 import export_int4


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
