"""Serving without Ray: request bodies to feeds (and every bad-input message), batching by rows, CPU claims."""

from __future__ import annotations

import ctypes
import io
import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from cim_int4.cli import main
from cim_int4.serving import commands
from cim_int4.serving.cpus import claim_cpus, claim_order
from cim_int4.serving.tensors import (
    BodyTooLarge,
    InputSpec,
    RequestError,
    batch_key,
    check_size,
    concat,
    encode_outputs,
    parse_request,
    split,
)

SYS_TGKILL = 234  # x86-64 Linux: a signal to one thread of a process
SPECS = {
    "x": InputSpec("x", np.dtype(np.float32), (None, 3)),
    "ids": InputSpec("ids", np.dtype(np.int64), (None,)),
}


def npz(**arrays: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def test_json_and_npz_bodies_give_the_same_feeds() -> None:
    x = np.array([[0.1, -2.5, 3e-8], [1, 2, 3]], dtype=np.float32)
    ids = np.array([4, 5], dtype=np.int64)
    body = json.dumps({"inputs": {"x": x.tolist(), "ids": ids.tolist()}}).encode()
    from_json, was_npz = parse_request(body, "application/json", SPECS)
    assert not was_npz
    from_npz, was_npz = parse_request(npz(x=x, ids=ids), "", SPECS)  # recognised by its zip signature
    assert was_npz
    for feeds in (from_json, from_npz):
        assert feeds["x"].dtype == np.float32 and feeds["ids"].dtype == np.int64
        np.testing.assert_array_equal(feeds["x"], x)
        np.testing.assert_array_equal(feeds["ids"], ids)


def test_json_outputs_round_trip_float32_exactly() -> None:
    y = np.random.default_rng(0).standard_normal((4, 7)).astype(np.float32)
    body, media = encode_outputs(["y"], [y], npz=False)
    assert media == "application/json"
    back = np.asarray(json.loads(body)["outputs"]["y"], dtype=np.float32)
    assert back.tobytes() == y.tobytes()
    body, media = encode_outputs(["y"], [y], npz=True)
    assert np.load(io.BytesIO(body))["y"].tobytes() == y.tobytes()


GOOD_X = [[1.0, 2.0, 3.0]]
BAD = {
    "unknown name": (json.dumps({"inputs": {"x": GOOD_X, "ids": [1], "z": [1]}}), "input 'z': not an input"),
    "missing input": (json.dumps({"inputs": {"x": GOOD_X}}), "input 'ids': missing (expected int64 [?])"),
    "wrong rank": (
        json.dumps({"inputs": {"x": [1.0, 2.0, 3.0], "ids": [1]}}),
        "input 'x': expected shape float32 [?, 3]",
    ),
    "wrong fixed dim": (json.dumps({"inputs": {"x": [[1.0, 2.0]], "ids": [1]}}), "got [1, 2]"),
    "no rows": (json.dumps({"inputs": {"x": GOOD_X, "ids": []}}), "input 'ids': expected shape int64 [?], got [0]"),
    "float for int": (json.dumps({"inputs": {"x": GOOD_X, "ids": [1.5]}}), "input 'ids': expected int64 values"),
    "text": (
        json.dumps({"inputs": {"x": [["a", "b", "c"]], "ids": [1]}}),
        "input 'x': expected float32 values, got text",
    ),
    "ragged": (json.dumps({"inputs": {"x": [[1.0, 2.0, 3.0], [1.0]], "ids": [1, 2]}}), "input 'x': not a rectangular"),
    "malformed JSON": ('{"inputs": {"x": [[1.0,', "body is not valid JSON"),
    "not an object": (json.dumps([1, 2]), 'body must be a JSON object {"inputs"'),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_json_is_one_line_naming_the_problem(case: str) -> None:
    body, expected = BAD[case]
    with pytest.raises(RequestError) as e:
        parse_request(body.encode(), "application/json", SPECS)
    assert expected in str(e.value) and "\n" not in str(e.value) and e.value.status == 400


def test_bad_npz_is_one_line() -> None:
    x, ids = np.ones((1, 3), np.float32), np.ones(1, np.int64)
    with pytest.raises(RequestError, match=r"input 'x': expected float32, got float64"):
        parse_request(npz(x=x.astype(np.float64), ids=ids), NPZ := "application/x-npz", SPECS)
    with pytest.raises(RequestError, match=r"body is not a valid \.npz archive"):
        parse_request(b"PK\x03\x04 broken", NPZ, SPECS)
    with pytest.raises(RequestError, match=r"not a valid \.npz"):  # pickled object arrays are refused
        parse_request(npz(x=np.array([object()]), ids=ids), NPZ, SPECS)
    with pytest.raises(BodyTooLarge, match="limit is 10") as e:
        check_size(11, 10)
    assert e.value.status == 413


def test_batching_concatenates_rows_and_splits_outputs_back() -> None:
    rng = np.random.default_rng(0)
    requests = [{"x": rng.standard_normal((m, 3)).astype(np.float32)} for m in (1, 3, 2)]
    assert len({batch_key(r) for r in requests}) == 1
    assert batch_key({"x": np.ones((1, 4), np.float32)}) != batch_key(requests[0])
    merged = concat(requests)
    assert merged["x"].shape == (6, 3)
    doubled = [merged["x"] * 2, merged["x"].sum(axis=1)]
    parts = split(doubled, [1, 3, 2])
    for request, (y, s) in zip(requests, parts, strict=True):
        np.testing.assert_array_equal(y, request["x"] * 2)
        np.testing.assert_array_equal(s, request["x"].sum(axis=1))
    assert split([np.ones((5, 3))], [1, 3, 2]) is None  # not row-major in the batch: run one by one


def test_cpu_claims_are_disjoint_and_released(tmp_path) -> None:
    cpus = claim_order([[0, 2], [1, 3]])
    assert cpus == [0, 1, 2, 3]  # one per physical core before siblings
    first = claim_cpus(1, wait_s=0, folder=tmp_path)
    assert first is not None
    second = claim_cpus(1, wait_s=0, folder=tmp_path)
    if second is None:
        pytest.skip("this process may run on one CPU only")
    assert set(first.cpus).isdisjoint(second.cpus)
    everything = len(claim_order(__import__("cim_int4").ops.physical_cores()))
    assert claim_cpus(everything, wait_s=0, folder=tmp_path) is None  # two are held
    first.release()
    second.release()
    whole = claim_cpus(everything, wait_s=0, folder=tmp_path)
    assert whole is not None and len(whole.cpus) == everything
    whole.release()


def test_core_package_does_not_import_ray() -> None:
    code = "import sys, cim_int4, cim_int4.cli, cim_int4.serving.commands; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_serve_without_the_extra_says_how_to_install(monkeypatch, capsys) -> None:
    real = commands.importlib.util.find_spec
    monkeypatch.setattr(commands.importlib.util, "find_spec", lambda name: None if name == "ray" else real(name))
    assert main(["serve", "model.onnx"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "cim-int4: error: serving needs Ray Serve: pip install 'cim-int4[serve]'"


def test_bench_report_table_targets_and_plot(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from dataclasses import asdict

    from cim_int4.serving.bench import BenchOptions, format_report, targets, write_plot
    from cim_int4.serving.load import Point

    options = BenchOptions(clients=(1, 16), rounds=2)

    def point(label: str, clients: int, rps: float, p50: float) -> dict:
        return asdict(Point(label, clients, 100, 0, 1.0, rps, p50, p50 * 1.5, p50 * 2))

    rounds = []
    for scale in (1.0, 1.2):  # two rounds: the tables take medians
        points = [point("plain loop, 1 process", 1, 400 * scale, 2.0)]
        for replicas, on, rps in ((1, False, 100), (2, False, 180), (1, True, 160), (2, True, 200)):
            label = f"{replicas} replica(s) x 1 thread(s), batching {'on' if on else 'off'}"
            points += [point(label, 1, rps / 2, 5.0), point(label, 16, rps * scale, 50.0)]
        rounds.append({"points": points, "cpu_independence": 1.9})
    report = {"date": "2026-12-02T01:00:00+00:00", "cpu": "AMD EPYC", "model": "demo", "options": asdict(options)}
    report |= {"other_load_cpus": 0.5, "rounds": rounds}
    t = targets(report)
    assert t["two_vs_one_replica"] == pytest.approx(1.8)
    assert t["batching_on_vs_off"] == pytest.approx(1.6)
    assert t["serving_overhead_ms"] == pytest.approx(3.0)
    assert t["batching_on_p99_ms"] == pytest.approx(100.0)
    text = format_report(report)
    assert "two_vs_one_replica: 1.80" in text and "1.90, 1.90" in text
    write_plot(report, tmp_path / "load.png")
    assert (tmp_path / "load.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("to_worker", [True, False], ids=["sigint-to-a-worker-thread", "sigterm"])
def test_the_serve_commands_wait_stops_on_ctrl_c_and_sigterm(to_worker: bool) -> None:
    # Linux gives a process's SIGINT to any thread that does not block it (here: a worker thread), and
    # a process started in a script's background inherits SIGINT ignored (here: on purpose); SIGTERM is kill's.
    script = (
        "import threading, time\n"
        "from cim_int4.serving.commands import take_stop_signals, wait_for_ctrl_c\n"
        "take_stop_signals()\n"
        "t = threading.Thread(target=lambda: time.sleep(60), daemon=True)\n"
        "t.start()\n"
        "print(t.native_id, flush=True)\n"
        "try:\n"
        "    wait_for_ctrl_c()\n"
        "except KeyboardInterrupt:\n"
        "    print('stopped', flush=True)\n"
    )
    ignore = lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)  # noqa: E731
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, preexec_fn=ignore)
    try:
        worker = int(proc.stdout.readline())
        time.sleep(0.5)  # into the wait
        if to_worker:
            assert ctypes.CDLL(None).syscall(SYS_TGKILL, proc.pid, worker, signal.SIGINT) == 0
        else:
            proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
        assert out.strip() == "stopped"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
