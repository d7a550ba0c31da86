"""The exporter's files: external data in and out, inputs never touched, atomic outputs, modes, bounded memory."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from cim_int4.exporter import writer as exporter_writer
from cim_int4.graphs import matmul_chain, mlp, random_input

from cim_int4 import ExportError, NothingToQuantize, export_int4, make_session
from cim_int4.contract import OP_TYPE


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def save_external(model: onnx.ModelProto, path: Path, location: str) -> None:
    """Save ``model`` with every tensor in ``location`` (relative to the model's folder)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    onnx.save(copy, path, save_as_external_data=True, all_tensors_to_one_file=True, location=location, size_threshold=0)


def relocate(path: Path, location: str) -> None:
    """Rewrite the external-data location of every tensor of the model at ``path`` (data files left as they are)."""
    model = onnx.load(path, load_external_data=False)
    for t in model.graph.initializer:
        for entry in t.external_data:
            if entry.key == "location":
                entry.value = location
    path.write_bytes(model.SerializeToString())


@pytest.fixture(scope="module")
def model() -> onnx.ModelProto:
    return mlp()


@pytest.fixture
def external_model(tmp_path: Path, model: onnx.ModelProto) -> Path:
    src = tmp_path / "in"
    src.mkdir()
    save_external(model, src / "model.onnx", "weights.bin")
    return src / "model.onnx"


@pytest.fixture
def small_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    # Outputs over the threshold (1 GiB in use) get <output>.data; a small one exercises that path.
    monkeypatch.setattr(exporter_writer, "EXTERNAL_DATA_THRESHOLD", 1024)


def test_external_data_input_gives_the_same_model(tmp_path: Path, model: onnx.ModelProto, external_model: Path) -> None:
    before = {p: sha256(p) for p in external_model.parent.iterdir()}
    out = tmp_path / "out.onnx"
    streamed = export_int4(external_model, out, quiet=True)
    in_memory = export_int4(model, quiet=True)
    assert streamed.SerializeToString() == in_memory.SerializeToString() == out.read_bytes()
    assert {p: sha256(p) for p in external_model.parent.iterdir()} == before
    assert listing(tmp_path) == ["in", "out.onnx"]


def test_inline_input_read_lazily_gives_the_same_model(tmp_path: Path, model: onnx.ModelProto) -> None:
    src = tmp_path / "model.onnx"
    onnx.save(model, src)
    from_file = export_int4(src, quiet=True)
    assert from_file.SerializeToString() == export_int4(model, quiet=True).SerializeToString()


def test_external_output_from_external_input_runs(
    tmp_path: Path, model: onnx.ModelProto, external_model: Path, small_threshold: None
) -> None:
    out = tmp_path / "out.onnx"
    export_int4(external_model, out, quiet=True)
    assert listing(tmp_path) == ["in", "out.onnx", "out.onnx.data"]
    x = random_input(model, {"batch": 3}, seed=5)
    expected = make_session(export_int4(model, quiet=True), threads=1).run(None, x)[0]
    np.testing.assert_array_equal(make_session(str(out), threads=1).run(None, x)[0], expected)
    # The unquantized biases were copied from the input's data file into the output's.
    loaded = onnx.load(out)
    assert {t.name for t in loaded.graph.initializer} == {"fc0.bias", "fc2.bias"}


@pytest.mark.parametrize("source", ["file", "proto", "cli"])
def test_external_data_option_moves_every_weight_out_and_runs(
    tmp_path: Path, model: onnx.ModelProto, source: str
) -> None:
    # A small model (far under the 1 GiB threshold) still gets <output>.data on request, with
    # every CimInt4MatMul tensor in it: what keeps ORT to one copy of the weights (docs/design.md,
    # "Session memory"). Loaded from the file, it computes what the one-file export does.
    src = tmp_path / "in.onnx"
    onnx.save(model, src)
    out = tmp_path / "out.onnx"
    if source == "cli":
        from cim_int4.cli import main

        assert main(["export", str(src), "-o", str(out), "--external-data", "--quiet"]) == 0
    else:
        export_int4(src if source == "file" else model, out, quiet=True, external_data=True)
    assert listing(tmp_path) == ["in.onnx", "out.onnx", "out.onnx.data"]
    stub = onnx.load(out, load_external_data=False)
    nodes = [n for n in stub.graph.node if n.op_type == OP_TYPE]
    tensors = [a.t for n in nodes for a in n.attribute if a.name in ("packed", "scales")]
    assert tensors and all(t.data_location == onnx.TensorProto.EXTERNAL and not t.raw_data for t in tensors)
    x = random_input(model, {"batch": 3}, seed=5)
    expected = make_session(export_int4(model, quiet=True), threads=1).run(None, x)[0]
    np.testing.assert_array_equal(make_session(str(out), threads=1).run(None, x)[0], expected)


# ---------------------------------------------------------------- bad external data: one-line errors


@pytest.mark.parametrize(
    "location, message",
    [
        ("missing.bin", "no such file"),
        ("/etc/weights.bin", "is absolute"),
        ("../weights.bin", "contains '..'"),
        ("sub/../weights.bin", "contains '..'"),
        ("link.bin", "symlink"),
        ("folder", "no such file"),
        ("short.bin", "bytes, the tensor needs"),
    ],
)
def test_bad_external_data_is_a_one_line_error(
    location: str, message: str, tmp_path: Path, external_model: Path
) -> None:
    folder = external_model.parent
    os.symlink("weights.bin", folder / "link.bin")
    (folder / "folder").mkdir()
    (folder / "short.bin").write_bytes(b"\0" * 16)
    relocate(external_model, location)
    out = tmp_path / "out.onnx"
    with pytest.raises(ExportError, match=re.escape(message)) as info:
        export_int4(external_model, out, quiet=True)
    assert "\n" not in str(info.value) and str(external_model) in str(info.value)
    assert not out.exists() and listing(tmp_path) == ["in"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_external_data_is_a_one_line_error(tmp_path: Path, external_model: Path) -> None:
    (external_model.parent / "weights.bin").chmod(0)
    with pytest.raises(ExportError, match="cannot read"):
        export_int4(external_model, tmp_path / "out.onnx", quiet=True)


# ---------------------------------------------------------------- never write an input file


@pytest.mark.parametrize("target", ["data", "data_symlink", "output_data_is_input_data"])
def test_export_never_writes_the_inputs_data(
    target: str, tmp_path: Path, model: onnx.ModelProto, small_threshold: None
) -> None:
    # Before: -o <the input's .data> (or an output whose .data is the input's) overwrote it in place.
    src = tmp_path / "model.onnx"
    location = "out.onnx.data" if target == "output_data_is_input_data" else "model.data"
    save_external(model, src, location)
    before = {p.name: sha256(p) for p in tmp_path.iterdir()}
    if target == "data":
        out = tmp_path / "model.data"
    elif target == "data_symlink":
        os.symlink(tmp_path / "model.data", tmp_path / "alias.onnx")
        before["alias.onnx"] = before["model.data"]
        out = tmp_path / "alias.onnx"
    else:
        out = tmp_path / "out.onnx"
    with pytest.raises(ExportError, match="a file the input model reads"):
        export_int4(src, out, quiet=True)
    assert {p.name: sha256(p) for p in tmp_path.iterdir()} == before
    onnx.checker.check_model(onnx.load(src))  # still loadable with its data


# ---------------------------------------------------------------- atomic outputs


def test_reexport_over_an_existing_data_file(tmp_path: Path, model: onnx.ModelProto, small_threshold: None) -> None:
    # Before: any existing <out>.data (e.g. from a failed export) made onnx raise FileExistsError.
    out = tmp_path / "out.onnx"
    (tmp_path / "out.onnx.data").write_bytes(b"stale")
    export_int4(model, out, quiet=True)
    first = sha256(tmp_path / "out.onnx.data")
    assert first != hashlib.sha256(b"stale").hexdigest()
    export_int4(model, out, quiet=True, group_size=64)
    assert sha256(tmp_path / "out.onnx.data") != first
    assert listing(tmp_path) == ["out.onnx", "out.onnx.data"]
    x = random_input(model, {"batch": 2})
    assert make_session(str(out), threads=1).run(None, x)[0].shape == (2, 128)


def test_failed_export_leaves_nothing_behind(
    tmp_path: Path, external_model: Path, small_threshold: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out.onnx"
    out.write_bytes(b"previous output")

    def fail(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    # Fails after the quantized attributes were streamed into the temporary data file.
    monkeypatch.setattr(exporter_writer.OutputFiles, "commit", fail)
    with pytest.raises(ExportError, match="No space left on device"):
        export_int4(external_model, out, quiet=True)
    assert listing(tmp_path) == ["in", "out.onnx"] and out.read_bytes() == b"previous output"


def test_nothing_to_quantize_leaves_nothing_behind(tmp_path: Path) -> None:
    src = tmp_path / "model.onnx"
    onnx.save(matmul_chain(1, 16), src)  # K = 16 < group size 32
    with pytest.raises(NothingToQuantize):
        export_int4(src, tmp_path / "out.onnx", quiet=True)
    assert listing(tmp_path) == ["model.onnx"]


@pytest.mark.parametrize("umask", [0o022, 0o027])
@pytest.mark.parametrize("source", ["path", "proto"])
def test_outputs_keep_the_umask_permissions(
    umask: int, source: str, tmp_path: Path, model: onnx.ModelProto, small_threshold: None
) -> None:
    # Before: mkstemp made both files 0600 whatever the umask.
    src = tmp_path / "model.onnx"
    onnx.save(model, src)
    old = os.umask(umask)
    try:
        export_int4(src if source == "path" else model, tmp_path / "out.onnx", quiet=True)
    finally:
        os.umask(old)
    for name in ("out.onnx", "out.onnx.data"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~umask, name


# ---------------------------------------------------------------- bad output paths


def test_output_that_is_a_folder(tmp_path: Path, model: onnx.ModelProto) -> None:
    with pytest.raises(ExportError, match="is a folder"):
        export_int4(model, tmp_path, quiet=True)


def test_output_in_an_unwritable_folder(
    tmp_path: Path, model: onnx.ModelProto, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(path: Path) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(exporter_writer, "_create", refuse)
    with pytest.raises(ExportError, match=re.escape(f"cannot write in folder {tmp_path} (Permission denied)")):
        export_int4(model, tmp_path / "out.onnx", quiet=True)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in any folder")
def test_output_in_a_read_only_folder(tmp_path: Path, model: onnx.ModelProto) -> None:
    folder = tmp_path / "ro"
    folder.mkdir(mode=0o555)
    with pytest.raises(ExportError, match="cannot write in folder"):
        export_int4(model, folder / "out.onnx", quiet=True)


# ---------------------------------------------------------------- already quantized


def test_reexport_of_an_int4_model_says_it_is_quantized(tmp_path: Path, model: onnx.ModelProto) -> None:
    # Before: "0 node(s) quantized, 0 skipped" and no reason.
    path = tmp_path / "q.onnx"
    export_int4(model, path, quiet=True)
    with pytest.raises(NothingToQuantize, match=r"already quantized: it has 3 INT4 node\(s\)") as info:
        export_int4(path, tmp_path / "qq.onnx", quiet=True)
    assert f"{OP_TYPE} 'fc0'" in str(info.value)


# ---------------------------------------------------------------- memory


PEAK_SCRIPT = """
import resource, sys
import onnx
from cim_int4 import export_int4
from cim_int4.graphs import matmul_chain
export_int4(matmul_chain(1, 64), quiet=True)  # imports and first-use allocations before the baseline
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
base = hwm()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM to the current RSS
base = min(base, hwm())
export_int4(sys.argv[1], sys.argv[2], quiet=True)
print(hwm() - base)
"""


@pytest.mark.parametrize("layout", ["external", "inline"])
def test_export_memory_stays_bounded(layout: str, tmp_path: Path) -> None:
    # 48 weights of 1024x1024 (4 MiB each, 192 MiB): streaming holds about one weight and its
    # temporaries, then the output (~1/6.4 of the model, one file under 1 GiB) and its serialized
    # bytes: ~0.5x here; loading the whole model and copying it (before) needed 2-4x the model.
    model = matmul_chain(48, 1024)
    src = tmp_path / "model.onnx"
    if layout == "external":
        save_external(model, src, "model.data")
    else:
        onnx.save(model, src)
    size = sum(t.ByteSize() for t in model.graph.initializer)
    del model
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PEAK_SCRIPT), str(src), str(tmp_path / "out.onnx")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    growth = int(proc.stdout.strip())
    assert growth <= 0.75 * size, f"peak RSS grew by {growth / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB model"


@pytest.mark.parametrize("quiet", [False, True])
def test_progress_bar_on_big_models_unless_quiet(
    quiet: bool, tmp_path: Path, external_model: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(exporter_writer, "PROGRESS_MIN_BYTES", 1)  # every model counts as big
    export_int4(external_model, tmp_path / "out.onnx", quiet=quiet)
    err = capsys.readouterr().err
    assert ("cim-int4 export" in err) != quiet, err
