"""Decode variants and the tuner: every variant gives the same bits through ORT, the per-CPU profile
round-trips, a bad profile or variant name gets one clear line, and the tuner keeps to its time budget."""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cim_int4.ops import tuning
from conftest import KERNEL_ENV, available_kernels, op_attributes, op_model, quantized

from cim_int4 import make_session

KERNELS = available_kernels()
VARIANT_ENV = tuning.VARIANT_ENV
TUNE_ENV = tuning.TUNE_ENV
PROFILE_ENV = tuning.PROFILE_ENV
STREAM_ENV = tuning.TUNE_STREAM_ENV


def _variants(kernel: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    # The op lists a table's variants in its error for an unknown one.
    monkeypatch.setenv(KERNEL_ENV, kernel)
    monkeypatch.setenv(VARIANT_ENV, "no_such_variant")
    with pytest.raises(Exception, match=r"CIM_INT4_VARIANT=no_such_variant is not a variant") as e:
        make_session(op_model(op_attributes(quantized(32, 2)), [[1, 32]]), threads=1)
    match = re.search(r"available: ([\w, -]+) \(or auto\)", str(e.value))
    assert match, str(e.value)
    return [v.strip() for v in match.group(1).split(",")]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("compute", ["fp32", "int8"])
def test_every_variant_gives_the_same_bits(kernel: str, compute: str, monkeypatch: pytest.MonkeyPatch) -> None:
    names = _variants(kernel, monkeypatch)
    assert len(names) == len(set(names)) >= 1
    if kernel != "portable":
        assert len(names) > 1, f"{kernel} offers no variants to tune"
    # N = 200 (13 tiles: 3 strips and a short one), K = 1000 (a short last group), M = 1
    # (decode, where variants differ) and M = 3 (prefill); 1 and 2 threads (range splits).
    qw = quantized(1000, 200, 32, seed=7)
    rng = np.random.default_rng(7)
    inputs = {
        "A0": rng.standard_normal((1, 1000), dtype=np.float32),
        "A1": rng.standard_normal((3, 1000), dtype=np.float32),
    }
    model = op_model(op_attributes(qw, None, compute=compute), [[1, 1000], [3, 1000]])
    outputs = {}
    for name in names:
        monkeypatch.setenv(VARIANT_ENV, name)
        for threads in (1, 2):
            ys = make_session(model, threads=threads).run(None, inputs)
            outputs[(name, threads)] = b"".join(y.tobytes() for y in ys)
    monkeypatch.setenv(VARIANT_ENV, "auto")
    reference = b"".join(y.tobytes() for y in make_session(model, threads=1).run(None, inputs))
    differ = [key for key, got in outputs.items() if got != reference]
    assert not differ, f"{kernel} {compute}: variants (name, threads) not bit-identical to the default: {differ}"


def _child(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Runs ``code`` in a fresh interpreter (the op decides a profile once per process)."""
    full = {k: v for k, v in os.environ.items() if k not in (TUNE_ENV, PROFILE_ENV, VARIANT_ENV, STREAM_ENV)}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=300)


_SESSION_CODE = f"""
import numpy as np, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from conftest import op_attributes, op_model, quantized
from cim_int4 import make_session
qw = quantized(256, 64, 32, seed=3)
a = np.random.default_rng(3).standard_normal((1, 256), dtype=np.float32)
y = make_session(op_model(op_attributes(qw, None, compute="int8"), [[1, 256]]), threads=1).run(None, {{"A0": a}})[0]
sys.stdout.write(y.tobytes().hex())
"""

_CHOICE_CODE = "import json; from cim_int4.ops import tuning; print(json.dumps(tuning.current_variants()))"


def test_profile_round_trips(tmp_path: Path) -> None:
    profile = tmp_path / "cache" / "kernel-profile.json"
    report = json.loads(
        _child(
            "import json; from cim_int4.ops import tuning; print(json.dumps(tuning.tune(seconds=0.05)))",
            {PROFILE_ENV: str(profile)},
        ).stdout
    )
    assert report["saved"], report["save_error"]
    entries = json.loads(profile.read_text())
    key = report["key"]
    assert entries[f"{key}/{report['kernel']}/int8"] == report["chosen"]["int8"]
    assert entries[f"{key}/{report['kernel']}/fp32"] == report["chosen"]["fp32"]
    assert entries[f"{key}/cpu"] == report["cpu"]
    # A later process reads the choice back, and says nothing.
    choice = json.loads(_child(_CHOICE_CODE, {PROFILE_ENV: str(profile), TUNE_ENV: "off"}).stdout)
    assert choice["source"] == f"profile {profile}"
    assert (choice["fp32"], choice["int8"]) == (report["chosen"]["fp32"], report["chosen"]["int8"])
    assert choice["message"] == ""
    # Entries of other CPUs are kept when this one re-tunes.
    entries["SomeVendor-1-2-avx2-g1/avx2/int8"] = "t4-nopf"
    profile.write_text(json.dumps(entries))
    _child("from cim_int4.ops import tuning; tuning.tune(seconds=0.05)", {PROFILE_ENV: str(profile)})
    assert json.loads(profile.read_text())["SomeVendor-1-2-avx2-g1/avx2/int8"] == "t4-nopf"


def test_profile_entry_is_used_by_the_op(tmp_path: Path) -> None:
    if "avx2" not in KERNELS:
        pytest.skip("no x86 variants on this CPU")
    profile = tmp_path / "kernel-profile.json"
    untuned = json.loads(_child(_CHOICE_CODE, {PROFILE_ENV: str(profile), TUNE_ENV: "off"}).stdout)
    assert untuned["source"] == "defaults" and untuned["default"] == {"fp32": untuned["fp32"], "int8": untuned["int8"]}
    key = untuned["key"]
    kernel = KERNELS[0]
    profile.write_text(json.dumps({f"{key}/{kernel}/int8": "t2-pf6k", f"{key}/{kernel}/fp32": "t4-nopf"}))
    choice = json.loads(_child(_CHOICE_CODE, {PROFILE_ENV: str(profile)}).stdout)
    assert (choice["int8"], choice["fp32"], choice["source"]) == ("t2-pf6k", "t4-nopf", f"profile {profile}")
    assert choice["default"] == untuned["default"]  # the table's own, whatever the profile says
    # A name this build does not have: one line naming the file, the entry and the fallback.
    profile.write_text(json.dumps({f"{key}/{kernel}/int8": "t9-warp"}))
    run = _child(_SESSION_CODE, {PROFILE_ENV: str(profile)})
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stderr.splitlines() if "cim-int4" in line]
    assert len(lines) == 1 and str(profile) in lines[0] and "t9-warp" in lines[0], run.stderr


@pytest.mark.parametrize("text", ["{not json", '{"a": 1}', "", '["x"]', '{"format": "something else"}'])
def test_corrupt_profile_warns_once_falls_back_and_is_not_overwritten(tmp_path: Path, text: str) -> None:
    profile = tmp_path / "kernel-profile.json"
    profile.write_text(text)
    run = _child(_SESSION_CODE, {PROFILE_ENV: str(profile)})
    assert run.returncode == 0, run.stderr
    default = _child(_SESSION_CODE, {PROFILE_ENV: str(tmp_path / "none.json"), TUNE_ENV: "off"})
    assert run.stdout == default.stdout, "a bad profile must not change results"
    lines = [line for line in run.stderr.splitlines() if "cim-int4" in line]
    if "avx2" in KERNELS:
        assert len(lines) == 1 and str(profile) in lines[0] and "default" in lines[0], run.stderr
    assert profile.read_text() == text, "a profile we cannot read must never be overwritten"


def test_implicit_tuning_runs_once_per_cpu_and_says_so(tmp_path: Path) -> None:
    if "avx2" not in KERNELS:
        pytest.skip("no x86 variants on this CPU")
    profile = tmp_path / "kernel-profile.json"
    first = _child(_SESSION_CODE, {PROFILE_ENV: str(profile)})
    assert first.returncode == 0, first.stderr
    lines = [line for line in first.stderr.splitlines() if "cim-int4" in line]
    assert len(lines) == 1 and "tuned the" in lines[0] and str(profile) in lines[0], first.stderr
    assert profile.is_file()
    second = _child(_SESSION_CODE, {PROFILE_ENV: str(profile)})
    assert "cim-int4" not in second.stderr, "the saved profile must be used without tuning again"
    assert first.stdout == second.stdout
    # CIM_INT4_TUNE=off: no tuning, no file.
    off = tmp_path / "off.json"
    quiet = _child(_SESSION_CODE, {PROFILE_ENV: str(off), TUNE_ENV: "off"})
    assert "cim-int4" not in quiet.stderr and not off.exists()
    assert quiet.stdout == first.stdout


def test_tuner_keeps_to_its_budget(tmp_path: Path) -> None:
    budget = 0.15
    report = tuning.tune(seconds=budget, save=False)
    min_rounds = report["min_rounds"]
    assert report["rounds"] >= min_rounds
    # Past the minimum, a round starts only if it fits what is left of the budget, or, while a
    # candidate leads unsteadily (`extended`), of twice it; the first rounds are the longest.
    limit = report["extend_factor"] * budget if report["extended"] else budget
    longest = report["longest_round_seconds"]
    assert report["elapsed_seconds"] <= max(limit, min_rounds * longest) + longest
    assert report["stream_bytes"] >= min(2 * report["llc_bytes"], 256 << 20) * 0.9
    names = [row["name"] for row in report["variants"]]
    assert report["chosen"]["int8"] in names and report["chosen"]["fp32"] in names
    assert report["saved"] is False
    for mode in ("fp32", "int8"):
        rows = {row["name"]: row for row in report["variants"]}
        # The default runs every round; a chosen variant other than the default ran every round too.
        assert rows[report["default"][mode]][f"{mode}_rounds"] == report["rounds"]
        assert rows[report["chosen"][mode]][f"{mode}_rounds"] == report["rounds"]
        for row in report["variants"]:
            assert 1 <= row[f"{mode}_rounds"] <= report["rounds"]
            if row[f"{mode}_rounds"] < report["rounds"]:  # dropped: far behind after two rounds at least
                assert row[f"{mode}_rounds"] >= 2
    # An n4 row's fp32 entry is its t4 row's function, and a t4x2 row's int8 entry its t4 row's:
    # timed once, reported alike.
    for row in report["variants"]:
        for prefix, mode in (("n4-", "fp32"), ("t4x2-", "int8")):
            if row["name"].startswith(prefix):
                twin = rows["t4-" + row["name"].split("-", 1)[1]]
                assert row[f"{mode}_seconds"] == twin[f"{mode}_seconds"]
                assert row[f"{mode}_rounds"] == twin[f"{mode}_rounds"]


def test_large_stream_is_timed_in_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream larger than 64 MiB is read a window per pass (each pass bounded, each window cold when read again)."""
    monkeypatch.setenv(STREAM_ENV, "256")
    large = tuning.tune(seconds=0.05, save=False)
    if len(large["variants"]) < 2:
        pytest.skip("a table with one variant is not timed")
    assert 0.99 * (256 << 20) <= large["stream_bytes"] <= 256 << 20
    assert large["windows"] == 4 and large["windows"] * large["window_bytes"] == large["stream_bytes"]
    assert large["window_bytes"] <= 64 << 20
    # Up to 64 MiB: one window, the whole stream per pass.
    monkeypatch.setenv(STREAM_ENV, "64")
    small = tuning.tune(seconds=0.05, save=False)
    assert small["windows"] == 1 and small["window_bytes"] == small["stream_bytes"] > 0.99 * (64 << 20)
    for bad in ("0", "-5", "12x", "5000"):
        monkeypatch.setenv(STREAM_ENV, bad)
        with pytest.raises(tuning.TuneError, match=rf"^{STREAM_ENV}={bad} is not a whole number of MiB in 1..4096$"):
            tuning.tune(seconds=0.05, save=False)


def test_unknown_kernel_in_tune_is_one_line_error() -> None:
    with pytest.raises(tuning.TuneError, match=r"kernel 'no_such_isa' is not one this CPU runs; available: "):
        tuning.tune("no_such_isa", seconds=0.05, save=False)


def test_tune_command_prints_table(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    run = _child(
        f"from cim_int4.cli import main; raise SystemExit(main(['tune', '--seconds', '0.05', '--json', {str(out)!r}]))",
        {PROFILE_ENV: str(tmp_path / "p.json")},
    )
    assert run.returncode == 0, run.stderr
    assert "CPU: " in run.stdout and "chosen" in run.stdout and "saved to" in run.stdout
    assert json.loads(out.read_text())["kernel"] in KERNELS
    again = _child(
        f"from cim_int4.cli import main; raise SystemExit(main(['tune', '--seconds', '0.05', '--json', {str(out)!r}]))",
        {PROFILE_ENV: str(tmp_path / "p.json")},
    )
    assert again.returncode == 1 and "not overwriting" in again.stderr, "the report file must never be overwritten"


@pytest.mark.parametrize("seconds", [float("nan"), float("inf"), -1.0, 0.0])
def test_tuner_library_refuses_a_budget_that_is_not_positive_and_finite(seconds: float) -> None:
    # The library's own entry point (the Python wrapper refuses these before it): one line, no
    # endless rounds (a NaN budget once compared false both ways).
    with pytest.raises(tuning.TuneError, match="budget_seconds must be a positive finite number"):
        tuning._call("cim_int4_tune", b"auto", ctypes.c_double(seconds), ctypes.c_int(0))
