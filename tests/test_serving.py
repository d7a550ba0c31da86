"""cim-int4 on Ray Serve, end to end on a local Ray instance (num_cpus=2), only on 127.0.0.1.

One Ray instance serves the whole module (starting one is slow); each test deploys the
configuration it needs under the one application name. Every response is checked against
a direct session on the same input.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ray.serve", reason="needs the serve extra: pip install 'cim-int4[serve]'")

import psutil  # noqa: E402 - a dependency of ray
from cim_int4.exporter import export_with_summary, save_model  # noqa: E402
from cim_int4.graphs import LlamaConfig, llama_decoder  # noqa: E402

from cim_int4 import make_session  # noqa: E402
from cim_int4.cli import main  # noqa: E402
from cim_int4.serving.app import Replica, ServeConfig, build_app, deploy  # noqa: E402
from cim_int4.serving.cluster import start_http, start_ray, stop  # noqa: E402
from cim_int4.serving.cpus import LOCK_DIR_ENV, thread_affinities  # noqa: E402
from cim_int4.serving.load import HOST, npz_body, send_load  # noqa: E402

HIDDEN = 128
TIMEOUT_S = 60.0
GENAI_INT4 = Path(__file__).parent / "genai" / "llama-int4"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Client:
    """Requests to the Serve proxy on 127.0.0.1, with a timeout on each."""

    def __init__(self, port: int) -> None:
        self.port = port

    def request(self, method: str, path: str, body: bytes | None = None, content_type: str = "application/json"):
        import http.client

        conn = http.client.HTTPConnection(HOST, self.port, timeout=TIMEOUT_S)
        try:
            conn.request(method, path, body=body, headers={"Content-Type": content_type})
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def infer_json(self, feeds: dict[str, np.ndarray]) -> tuple[int, dict]:
        body = json.dumps({"inputs": {k: v.tolist() for k, v in feeds.items()}}).encode()
        status, raw = self.request("POST", "/v1/infer", body)
        return status, json.loads(raw)

    def health(self) -> dict:
        status, raw = self.request("GET", "/healthz")
        assert status == 200, raw
        return json.loads(raw)

    def replica_pids(self, count: int) -> dict[int, dict]:
        """The /healthz answers of ``count`` distinct replicas (asked until each has answered)."""
        seen: dict[int, dict] = {}
        deadline = time.monotonic() + TIMEOUT_S
        while len(seen) < count and time.monotonic() < deadline:
            status, raw = self.request("GET", "/healthz")
            if status == 200:  # else a replica that died and is not yet out of the routing
                h = json.loads(raw)
                seen[h["pid"]] = h
        assert len(seen) >= count, f"only {len(seen)} replica(s) answered /healthz"
        return seen


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    cfg = LlamaConfig(hidden=HIDDEN, intermediate=256, layers=2, heads=4)
    int4, _ = export_with_summary(llama_decoder(cfg), group_size=32)
    path = tmp_path_factory.mktemp("serving") / "decoder.int4.onnx"
    save_model(int4, path)
    return path


def hidden(batch: int, seq: int, seed: int) -> dict[str, np.ndarray]:
    x = np.random.default_rng(seed).standard_normal((batch, seq, HIDDEN)).astype(np.float32)
    return {"hidden_states": x}


@pytest.fixture(scope="module")
def serve_port(tmp_path_factory):
    # The replicas' CPU locks in a folder of this run: no other server on the machine counts.
    os.environ[LOCK_DIR_ENV] = str(tmp_path_factory.mktemp("cpu-locks"))
    port = free_port()
    start_ray(None, num_cpus=2)
    ray_processes = psutil.Process().children(recursive=True)
    try:
        start_http(HOST, port)
        yield port
    finally:
        stop()
        os.environ.pop(LOCK_DIR_ENV, None)
    _, alive = psutil.wait_procs(ray_processes, timeout=TIMEOUT_S)
    assert not alive, f"Ray left processes running: {[p.name() for p in alive]}"


_deployed: dict[str, object] = {}


def deployed(port: int, model: Path | str, **config) -> Client:
    """A client of ``model`` served with ``config``; redeploys only when the model or config changed."""
    key = (str(model), tuple(sorted(config.items())))
    if _deployed.get("key") != key:
        deploy(build_app(model, ServeConfig(**config)))
        _deployed["key"] = key
    return Client(port)


BATCHING_OFF = {"replicas": 2, "threads": 1, "max_batch": 1, "max_body": 1 << 20}


def test_infer_equals_a_direct_session_bit_for_bit(serve_port, model) -> None:
    client = deployed(serve_port, model, **BATCHING_OFF)
    direct = make_session(model, threads=1)
    for i, (batch, seq) in enumerate([(1, 1), (2, 5), (1, 16)]):
        feeds = hidden(batch, seq, i)
        (expected,) = direct.run(["output"], feeds)
        status, doc = client.infer_json(feeds)
        assert status == 200, doc
        got = np.asarray(doc["outputs"]["output"], dtype=np.float32)
        assert got.tobytes() == expected.tobytes()
        status, raw = client.request("POST", "/v1/infer", npz_body(feeds), "application/x-npz")
        assert status == 200
        assert np.load(io.BytesIO(raw))["output"].tobytes() == expected.tobytes()


def test_bad_inputs_are_4xx_one_line_and_the_replica_keeps_serving(serve_port, model) -> None:
    client = deployed(serve_port, model, **BATCHING_OFF)
    pids = set(client.replica_pids(2))
    good = hidden(1, 2, 0)
    buffer = io.BytesIO()
    np.savez(buffer, hidden_states=good["hidden_states"].astype(np.float64))
    cases = [
        (json.dumps({"inputs": {"hidden": good["hidden_states"].tolist()}}), 400, "input 'hidden': not an input"),
        (json.dumps({"inputs": {"hidden_states": [[[1.0] * 7]]}}), 400, "input 'hidden_states': expected shape"),
        (json.dumps({"inputs": {"hidden_states": [[["x"] * HIDDEN]]}}), 400, "expected float32 values, got text"),
        ('{"inputs": {"hidden_states": [[[1.0, ', 400, "body is not valid JSON"),
        (buffer.getvalue(), 400, "input 'hidden_states': expected float32, got float64"),
        (b"PK\x03\x04 not a zip", 400, "not a valid .npz"),
        (b"{" + b" " * (2 << 20) + b"}", 413, "limit is 1048576"),
    ]
    for body, status, message in cases:
        body = body.encode() if isinstance(body, str) else body
        got_status, raw = client.request("POST", "/v1/infer", body)
        text = raw.decode()
        assert got_status == status, text
        assert message in json.loads(text)["error"] and "\n" not in text.strip(), text
    status, doc = client.infer_json(good)
    assert status == 200
    assert set(client.replica_pids(2)) == pids, "a bad request must not restart a replica"


def test_two_replicas_pin_disjoint_cpus(serve_port, model) -> None:
    client = deployed(serve_port, model, **BATCHING_OFF)
    replicas = client.replica_pids(2)
    used = []
    for pid, health in replicas.items():
        assert health["cpus"] is not None, "two 1-thread replicas on 2 CPUs must both be pinned"
        threads = thread_affinities(pid)
        cpus = set().union(*threads.values())
        assert cpus == set(health["cpus"]), f"replica {pid}: threads on {cpus}, claimed {health['cpus']}"
        used.append(cpus)
    assert used[0].isdisjoint(used[1]), used


def expected_outputs(model: Path, bodies: list[dict]) -> list[np.ndarray]:
    direct = make_session(model, threads=1)
    return [direct.run(["output"], feeds)[0] for feeds in bodies]


def test_bounded_load_with_batching_nothing_lost_or_duplicated(serve_port, model) -> None:
    client = deployed(serve_port, model, replicas=2, threads=1, max_batch=16, batch_wait_ms=5)
    inputs = [hidden(1, 1, seed) for seed in range(40)]
    expected = expected_outputs(model, inputs)
    exchanges, _ = send_load(client.port, [npz_body(f) for f in inputs], clients=8, max_requests=400, max_seconds=120)
    assert [e.index for e in exchanges] == list(range(400)), "a request was lost or answered twice"
    assert all(e.status == 200 for e in exchanges), {e.status for e in exchanges}
    worst = 0.0
    for e in exchanges:
        want = expected[e.index % len(inputs)]
        got = np.load(io.BytesIO(e.body))["output"]
        assert got.shape == want.shape
        worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
    # Batched rows run through the M > 1 kernels: the same arithmetic per row, so the same
    # answer up to FP32 rounding of the op (README "Compute modes"); a mixed-up row is off by O(1).
    largest = max(h["largest_batch"] for h in client.replica_pids(2).values())
    print(f"batching on: largest batch {largest}, worst relative difference to a direct M = 1 run {worst:.2e}")
    assert largest > 1, "8 concurrent clients never made a batch of two"
    assert worst < 1e-5, worst


def test_killed_replica_is_replaced_and_requests_fail_cleanly(serve_port, model) -> None:
    client = deployed(serve_port, model, **BATCHING_OFF)
    victim = next(iter(client.replica_pids(2)))
    inputs = [hidden(1, 1, seed) for seed in range(10)]
    expected = expected_outputs(model, inputs)

    def kill_once(answered: int) -> None:
        if answered == 40:
            os.kill(victim, signal.SIGKILL)

    exchanges, _ = send_load(
        client.port, [npz_body(f) for f in inputs], clients=4, max_requests=300, max_seconds=120, on_answer=kill_once
    )
    assert len(exchanges) == 300 and len({e.index for e in exchanges}) == 300
    failed = [e for e in exchanges if e.status != 200]
    for e in exchanges:
        if e.status == 200:
            got = np.load(io.BytesIO(e.body))["output"]
            assert got.tobytes() == expected[e.index % len(inputs)].tobytes()
        else:  # the requests the dead replica held: a clean server error, not a hang or a wrong answer
            assert 500 <= e.status < 600, (e.status, e.body[:200])
    print(f"killed replica {victim} after 40 answers: {len(failed)} of 300 requests failed")
    assert len(failed) <= 4, f"{len(failed)} failures: more than the 4 clients had in flight"
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if victim not in set(client.replica_pids(2)):
            break
        time.sleep(0.5)
    replicas = client.replica_pids(2)
    assert victim not in replicas and len(replicas) == 2, "Serve did not replace the killed replica"
    cpus = [set(h["cpus"] or ()) for h in replicas.values()]
    assert all(cpus) and cpus[0].isdisjoint(cpus[1]), f"the replacement did not get the freed CPU: {cpus}"
    later, _ = send_load(client.port, [npz_body(f) for f in inputs], clients=2, max_requests=40, max_seconds=60)
    assert [e.status for e in later] == [200] * 40


def sampled(model, prompt: list[int], steps: int, options: dict) -> list[int]:  # noqa: ANN001
    """Tokens of a direct onnxruntime-genai run with sampling ``options``."""
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    length = len(prompt) + steps
    params.set_search_options(max_length=length, min_length=length, **options)
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray(prompt, dtype=np.int32))
    tokens = []
    while not generator.is_done():
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    return tokens


def test_generate_equals_direct_genai(serve_port, tmp_path) -> None:
    pytest.importorskip("onnxruntime_genai")
    from cim_int4.genai import prepare
    from cim_int4.genai_bench import greedy, load

    folder = prepare(GENAI_INT4, tmp_path / "cim", compute="fp32", quiet=True)
    client = deployed(serve_port, folder, replicas=1, threads=1)
    prompt = np.random.default_rng(0).integers(3, 1000, 8).tolist()
    steps = 12
    want = greedy(load(folder, threads=1), prompt, steps).tokens
    body = {"tokens": prompt, "max_tokens": steps, "min_tokens": steps}
    status, raw = client.request("POST", "/v1/generate", json.dumps(body).encode())
    assert status == 200, raw
    assert json.loads(raw)["tokens"] == want
    status, raw = client.request("POST", "/v1/generate", json.dumps({**body, "stream": True}).encode())
    lines = [json.loads(line) for line in raw.decode().splitlines()]
    assert status == 200 and lines[-1] == {"done": True}
    assert [line["token"] for line in lines[:-1]] == want
    sampling = {"do_sample": True, "top_k": 50, "top_p": 0.9, "temperature": 0.8, "random_seed": 3}
    answers = [
        json.loads(client.request("POST", "/v1/generate", json.dumps({**body, **sampling}).encode())[1])["tokens"]
        for _ in range(2)
    ]
    assert answers[0] == answers[1] == sampled(load(folder, threads=1), prompt, steps, sampling)
    assert answers[0] != want, "sampling options were ignored"
    status, raw = client.request("POST", "/v1/generate", json.dumps({"prompt": "ba da", "max_tokens": 4}).encode())
    doc = json.loads(raw)
    assert status == 200 and len(doc["tokens"]) <= 4 and isinstance(doc["text"], str)
    for bad, message in [
        ({"tokens": prompt, "max_tokens": "8"}, "field 'max_tokens': expected int >= 1"),
        ({"prompt": "x", "tokens": prompt}, "exactly one of 'prompt'"),
        ({"tokens": prompt, "max_tokens": 10_000}, "context length is 256"),
        ({"tokens": prompt, "temprature": 1.0}, "field 'temprature': unknown"),
    ]:
        status, raw = client.request("POST", "/v1/generate", json.dumps(bad).encode())
        assert status == 400 and message in json.loads(raw)["error"], raw


def test_serve_command_checks_the_model_before_starting_ray(capsys) -> None:
    assert main(["serve", "no-such-model.onnx"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        "cim-int4: error: no-such-model.onnx: neither an ONNX file nor an onnxruntime-genai folder "
        "(with genai_config.json)"
    )


def test_replica_without_enough_free_cpus_runs_unpinned_with_one_log_line(caplog, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(LOCK_DIR_ENV, str(tmp_path))
    before = os.sched_getaffinity(0)
    with caplog.at_level("WARNING", logger="ray.serve"):
        replica = Replica(threads=len(before) + 1)
    assert replica.claim is None and replica.pin == "none" and os.sched_getaffinity(0) == before
    assert [r.getMessage() for r in caplog.records] == [
        f"cim-int4: not enough free CPUs to pin {len(before) + 1} thread(s); this replica runs unpinned"
    ]


def test_serve_command_starts_ray_and_stops_cleanly_on_ctrl_c(model, tmp_path) -> None:
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", LOCK_DIR_ENV: str(tmp_path)}
    command = [sys.executable, "-m", "cim_int4.cli", "serve", str(model), "--port", str(port)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 2 * TIMEOUT_S
        children = []
        while time.monotonic() < deadline:
            try:
                if Client(port).request("GET", "/healthz")[0] == 200:
                    break
            except OSError:
                pass  # the proxy is not listening yet
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.5)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children, "a local Ray instance was not started"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=TIMEOUT_S)
        assert proc.returncode == 0, out
        assert "cim-int4: shutting down" in out
        _, alive = psutil.wait_procs(children, timeout=TIMEOUT_S)
        assert not alive, f"left running: {[p.name() for p in alive]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_stop_bounds_a_serve_shutdown_that_hangs(monkeypatch, capsys) -> None:
    # Serve's graceful stop once took over a minute on a loaded machine: stop() waits a bounded time, then stops Ray.
    import ray
    from ray import serve

    released, stopped = threading.Event(), []
    monkeypatch.setattr(serve, "shutdown", lambda: released.wait(30))
    monkeypatch.setattr(ray, "shutdown", lambda: stopped.append(True))
    start = time.monotonic()
    stop(serve_timeout_s=0.2)
    released.set()
    assert time.monotonic() - start < 5
    assert stopped == [True]
    assert "Serve did not stop within 0.2 s; stopping Ray" in capsys.readouterr().err


def test_stop_stops_ray_after_serve_and_on_a_second_ctrl_c(monkeypatch) -> None:
    import ray
    from ray import serve

    calls = []
    monkeypatch.setattr(serve, "shutdown", lambda: calls.append("serve"))
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("ray"))
    stop()
    assert calls == ["serve", "ray"]

    calls.clear()
    monkeypatch.setattr(serve, "shutdown", lambda: time.sleep(30))

    wait = threading.Event.wait

    def interrupted(self, timeout=None):  # Ctrl-C during stop()'s bounded wait (Thread.start waits unbounded)
        if timeout is None:
            return wait(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(threading.Event, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        stop()
    assert calls == ["ray"]
