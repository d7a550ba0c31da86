"""Benchmarks: FP32 ORT vs ORT MatMulNBits vs CimInt4MatMul, as pytest-benchmark groups, and checks of the engine.

CIM_INT4_BENCH picks the suite: tiny (the default, what CI runs: tiny shapes, a few
rounds, seconds), quick (a 4096x4096 layer and the decoder at M=1) or full (every case,
~10 min). The full run, one pytest-benchmark group per case with the variants side by side:

    CIM_INT4_BENCH=full pytest tests/bench -k test_latency \\
        --benchmark-columns=median,iqr,min,max,rounds --benchmark-sort=name

Timings come from cim_int4.bench, which runs the variants of a case interleaved (A B C D,
B C D A, ...) with the cache evicted before every call. pytest-benchmark runs each test
on its own, which would time the variants minutes apart; so each test hands the
engine's samples of its variant to pytest-benchmark through a replay clock (the public
``timer`` option): its table, --benchmark-json and --benchmark-compare show the
interleaved numbers, and the CLI and the tests can never disagree.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import numpy as np
import onnx
import pytest
from cim_int4.graphs import random_input, single_matmul
from cim_int4.ops import make_session
from onnx import numpy_helper

from cim_int4 import bench
from cim_int4.contract import OP_TYPE

MODE_ENV = "CIM_INT4_BENCH"
THREADS = bench.DEFAULT_THREADS
VARIANT_NAMES = [v.name for v in bench.VARIANTS]


def _selected_suite() -> bench.Suite:
    name = os.environ.get(MODE_ENV, "tiny")
    if name not in bench.SUITES:
        raise pytest.UsageError(f"{MODE_ENV}={name!r}: choose one of {', '.join(bench.SUITES)}")
    return bench.SUITES[name]


# Fixtures live here, not in a conftest.py: the other test modules import tests/conftest.py
# as "conftest", which a second conftest.py would shadow.


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # "case": every case of the selected suite; "probe_threads": the thread counts timed.
    if "case" in metafunc.fixturenames:
        cases = _selected_suite().cases(THREADS)
        metafunc.parametrize("case", cases, ids=[c.id for c in cases])
    if "probe_threads" in metafunc.fixturenames:
        metafunc.parametrize("probe_threads", THREADS)


@pytest.fixture(scope="module")
def suite() -> bench.Suite:
    return _selected_suite()


@pytest.fixture(scope="module")
def threads() -> tuple[int, ...]:
    return THREADS


@pytest.fixture(scope="module")
def probe(suite: bench.Suite) -> bench.BandwidthProbe:
    return bench.BandwidthProbe.for_this_machine(cap=suite.buffer_cap)


@pytest.fixture(scope="module")
def report(suite: bench.Suite, probe: bench.BandwidthProbe) -> bench.Report:
    """Every case of the suite, every variant, measured once (interleaved, cold cache) and shared by the tests."""
    # Long suites report progress past pytest's capture; the tiny one stays silent.
    progress = bench.Progress(stream=sys.__stderr__, quiet=suite.name == "tiny")
    return bench.run_suite(suite, threads=THREADS, probe=probe, progress=progress)


class ReplayClock:
    """A clock for pytest-benchmark that advances by recorded durations, one per call of ``step``."""

    def __init__(self) -> None:
        self.now = 0.0
        self.pending: list[float] = []

    def __call__(self) -> float:
        return self.now

    def load(self, samples: list[float]) -> None:
        self.pending = list(samples)

    def step(self) -> None:
        self.now += self.pending.pop(0)


REPLAY = ReplayClock()


def _result(report: bench.Report, case: bench.Case, variant: str) -> bench.Result:
    matches = [r for r in report.results if r.case == case.name and r.variant == variant]
    assert len(matches) == 1, f"{case.name} / {variant}: {len(matches)} results"
    return matches[0]


# ---------------------------------------------------------------- the benchmarks


@pytest.mark.benchmark(timer=REPLAY)
@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_latency(benchmark, report: bench.Report, suite: bench.Suite, case: bench.Case, variant: str) -> None:
    # One test per (case, variant); "case" is parametrized by pytest_generate_tests.
    result = _result(report, case, variant)
    row = next(r for r in report.rows() if r.result is result)
    benchmark.group = case.name
    benchmark.extra_info.update(
        variant=variant,
        weight_bytes=result.weight_bytes,
        effective_gbps=row.gbps,
        pct_of_bandwidth=row.pct_bandwidth,
        speedup_vs_fp32=row.vs_fp32,
        speedup_vs_nbits=row.vs_nbits,
        rel_error=result.rel_error,
    )
    REPLAY.load(result.samples)
    benchmark.pedantic(REPLAY.step, rounds=len(result.samples), iterations=1)

    assert len(result.samples) >= suite.min_rounds
    assert all(s > 0 for s in result.samples)
    assert result.rel_error <= bench.REL_ERROR_BOUND, (
        f"{variant} on {case.name}: output is {result.rel_error:.3f} (relative RMS) from FP32, "
        f"beyond the INT4 bound {bench.REL_ERROR_BOUND}"
    )
    if variant == bench.BASELINE:
        assert result.rel_error == 0.0
    else:
        # INT4 weights cannot reproduce FP32 exactly; zero error would mean the variant ran FP32.
        assert result.rel_error > 1e-3


# ---------------------------------------------------------------- the report


def test_report_has_every_variant_for_every_case(report: bench.Report, suite: bench.Suite, threads) -> None:
    cases = suite.cases(threads)
    got = [(r.case, r.variant) for r in report.results]
    assert sorted(got) == sorted((c.name, v) for c in cases for v in VARIANT_NAMES)
    table = bench.format_table(report)
    blocks = [b.splitlines() for b in table.split("\n\n")]
    assert len(blocks) == len(cases)
    for case, lines in zip(cases, blocks, strict=True):
        body = [line for line in lines if not line.startswith(("case ", "---"))]
        assert body[0].startswith(case.name)
        # Variant names hold spaces ("cim-int4 int8"); columns are separated by two or more.
        assert [line[len(case.name) :].strip().split("  ")[0] for line in body] == VARIANT_NAMES


def test_derived_columns_are_consistent(report: bench.Report, suite: bench.Suite, threads) -> None:
    for row in report.rows():
        r = row.result
        assert row.gbps == pytest.approx(r.weight_bytes / r.median / 1e9)
        assert row.vs_fp32 is not None and row.vs_fp32 > 0
        assert row.pct_bandwidth is not None and row.pct_bandwidth > 0
        assert len(r.bandwidth_samples) == len(r.samples)  # one probe sample per round
        if r.variant == "cim-int4 fp32":
            assert row.peer == "nbits-acc0" and row.vs_nbits is not None
        if r.variant == "cim-int4 int8":
            assert row.peer == "nbits-acc4" and row.vs_nbits is not None
    # INT4 weights with block-32 float scales are 4.5 bits per weight, FP32 is 32.
    for name in VARIANT_NAMES[1:]:
        for case in suite.cases(threads):
            fp32 = _result(report, case, bench.BASELINE).weight_bytes
            q = _result(report, case, name).weight_bytes
            assert 0.10 < q / fp32 < 0.25, (name, case.name, q, fp32)


def test_json_holds_every_sample(report: bench.Report, threads) -> None:
    data = json.loads(json.dumps(report.to_json()))
    assert len(data["results"]) == len(report.results)
    entry = data["results"][0]
    assert entry["samples"] and entry["median_s"] == pytest.approx(float(np.median(entry["samples"])))
    assert set(data["bandwidth_gbps"]) == {str(t) for t in threads}


# ---------------------------------------------------------------- the bandwidth probe


def _ones_checksum(nbytes: int) -> int:
    # The probe sums whole pages as 64-bit words (0x0101..01 each: the buffer holds ones)
    # and the bytes past the last whole page one by one, modulo 2**64.
    pages = nbytes // 4096 * 4096
    return (pages // 8 * 0x0101010101010101 + (nbytes - pages)) % 2**64


def test_probe_reads_every_byte_and_reports_plausible_bandwidth(
    probe: bench.BandwidthProbe, probe_threads: int
) -> None:
    rate, checksum = probe.read(probe.probe_bytes, probe_threads)
    assert checksum == _ones_checksum(probe.probe_bytes)
    odd = probe.probe_bytes - 4096 - 3
    assert probe.read(odd, probe_threads)[1] == _ones_checksum(odd)
    assert 0.2e9 < rate < 5e12
    assert 0.2e9 < probe.bandwidth(probe_threads, passes=2) < 5e12


def test_probe_refuses_bad_arguments(probe: bench.BandwidthProbe) -> None:
    with pytest.raises(ValueError):
        probe.read(probe.probe_bytes + 1, 1)
    with pytest.raises(bench.BenchError):
        probe.read(100, 1)  # less than a page per thread


def test_missing_probe_library_names_the_override(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv(bench.BWPROBE_ENV, str(tmp_path / "nope.so"))
    with pytest.raises(bench.BenchError, match=bench.BWPROBE_ENV):
        bench.bwprobe_path()


def test_cache_size_parsing() -> None:
    assert bench.probe._parse_cache_size("491520K\n") == 480 << 20
    assert bench.probe._parse_cache_size("2M") == 2 << 20
    assert bench.probe._parse_cache_size("1024") == 1024
    llc = bench.last_level_cache_bytes()
    assert llc is None or llc >= 1 << 16


# ---------------------------------------------------------------- timing


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_interleaving_rotates_and_keeps_eviction_out_of_the_timings() -> None:
    clock = FakeClock()
    log: list[str] = []
    cost = {"a": 1.0, "b": 2.0, "c": 3.0}

    def call(name: str) -> None:
        log.append(name)
        clock.now += cost[name]

    def evict(name: str) -> None:
        log.append("evict")
        clock.now += 100.0

    samples = bench.interleaved(
        {name: (lambda n=name: call(n)) for name in cost},
        min_rounds=4,
        max_rounds=4,
        max_time=0.0,
        before_each=evict,
        between_rounds=lambda: log.append("probe"),
        clock=clock,
    )
    assert samples == {name: [c] * 4 for name, c in cost.items()}
    calls = [x for x in log if x not in ("evict", "probe")]
    assert calls == [*"abc", *"bca", *"cab", *"abc"]  # rotated each round
    assert all(log[i - 1] == "evict" for i, x in enumerate(log) if x in cost)
    assert log.count("probe") == 4


def test_rounds_stop_at_the_time_budget_but_not_before_min_rounds() -> None:
    clock = FakeClock()

    def tick() -> None:
        clock.now += 1.0

    samples = bench.interleaved({"a": tick, "b": tick}, min_rounds=3, max_rounds=50, max_time=10.0, clock=clock)
    assert len(samples["a"]) == 5  # 2 s per round: the budget of 10 s ends round 5
    samples = bench.interleaved({"a": tick}, min_rounds=3, max_rounds=50, max_time=0.0, clock=clock)
    assert len(samples["a"]) == 3
    with pytest.raises(ValueError):
        bench.interleaved({"a": tick}, min_rounds=3, max_rounds=2, max_time=0.0)


# ---------------------------------------------------------------- the accuracy check can fail


def test_error_bound_catches_a_wrong_nibble_order() -> None:
    model = single_matmul(256, 128, seed=5)
    good = bench.quantize_cim_int4(model)
    bad = onnx.ModelProto()
    bad.CopyFrom(good)
    node = next(n for n in bad.graph.node if n.op_type == OP_TYPE)
    attr = next(a for a in node.attribute if a.name == "packed")
    packed = numpy_helper.to_array(attr.t)
    swapped = ((packed << 4) | (packed >> 4)).astype(np.uint8)
    attr.t.CopyFrom(numpy_helper.from_array(swapped, attr.t.name))
    feeds = random_input(model, {"M": 4})
    (ref,) = make_session(model, threads=1).run(None, feeds)
    (ok,) = make_session(good, threads=1).run(None, feeds)
    (wrong,) = make_session(bad, threads=1).run(None, feeds)
    assert bench.relative_error(ok, ref) <= bench.REL_ERROR_BOUND
    assert bench.relative_error(wrong, ref) > bench.REL_ERROR_BOUND


# ---------------------------------------------------------------- variants and the command line


def test_variants_are_a_table_with_fp32_first() -> None:
    assert bench.VARIANTS[0].name == bench.BASELINE
    assert len({v.name for v in bench.VARIANTS}) == len(bench.VARIANTS)
    names = {v.name for v in bench.VARIANTS}
    for v in bench.COMPUTE_MODES:
        assert v.peer in names
    assert [v.name for v in bench.select_variants(["cim-int4 int8"])] == ["fp32", "cim-int4 int8"]
    modes = {v.name: dict(v.config) for v in bench.COMPUTE_MODES}
    assert modes == {"cim-int4 fp32": {"cim_int4.compute": "fp32"}, "cim-int4 int8": {"cim_int4.compute": "int8"}}
    with pytest.raises(ValueError, match="unknown variant"):
        bench.select_variants(["int3"])


def test_missing_onnx_ir_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "onnx_ir", None)  # makes "import onnx_ir" fail
    monkeypatch.delitem(sys.modules, "onnxruntime.quantization.matmul_nbits_quantizer", raising=False)
    with pytest.raises(bench.BenchError, match="pip install onnx-ir"):
        bench.nbits_quantizer()


def test_cli_prints_the_table_and_writes_json_and_plot(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["--tiny", "--threads", "1", "--no-memory", "--json", str(out_json)]
    plotting = importlib.util.find_spec("matplotlib") is not None
    if plotting:
        argv += ["--plot", str(out_png)]
    assert bench.run(parser.parse_args(argv)) == 0
    out = capsys.readouterr().out
    tiny_cases = bench.SUITES["tiny"].cases([1])
    for case in tiny_cases:
        assert case.name in out
    assert "session/int4" not in out  # --no-memory
    data = json.loads(out_json.read_text())
    assert data["memory"] == []
    assert {(e["case"], e["variant"]) for e in data["results"]} == {
        (c.name, v) for c in tiny_cases for v in VARIANT_NAMES
    }
    assert data["meta"]["cold"] is True and data["meta"]["threads"] == [1]
    if plotting:
        assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_refuses_unknown_variants(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.run(parser.parse_args(["--tiny", "--variants", "fp32,int3"])) == 2
    assert "unknown variant" in capsys.readouterr().err


def test_cli_warm_run_takes_no_bandwidth_samples(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out_json = tmp_path / "warm.json"
    argv = ["--tiny", "--warm", "--threads", "1", "--variants", "cim-int4 fp32", "--json", str(out_json)]
    assert bench.run(parser.parse_args(argv)) == 0
    out = capsys.readouterr().out
    assert "cache: warm" in out and "session/int4" in out  # the memory table, for the variants run
    data = json.loads(out_json.read_text())
    assert {e["variant"] for e in data["results"]} == {"fp32", "cim-int4 fp32"}
    workloads = [w.name for w in bench.SUITES["tiny"].workloads]
    assert [(m["workload"], m["variant"]) for m in data["memory"]] == [
        (w, v) for w in workloads for v in ("fp32", "cim-int4 fp32", "cim-int4 fp32 (external data)")
    ]
    assert all(not e["bandwidth_samples"] and e["pct_of_bandwidth"] > 0 for e in data["results"])


# ---------------------------------------------------------------- resident memory


def test_memory_has_every_variant_of_every_workload(report: bench.Report, suite: bench.Suite) -> None:
    # Every variant, then the first CimInt4MatMul one again from a file with external data.
    first_int4 = next(v for v in VARIANT_NAMES if v.startswith("cim-int4"))
    assert [(m.workload, m.variant) for m in report.memory] == [
        (w.name, v) for w in suite.workloads for v in [*VARIANT_NAMES, first_int4 + " (external data)"]
    ]
    empty = report.meta["empty_session_bytes"]
    assert empty > 0  # even an Identity session allocates
    for w in suite.workloads:
        int4 = bench.int4_weight_bytes(bench.quantize_cim_int4(w.build()))
        for m in (m for m in report.memory if m.workload == w.name):
            assert m.int4_bytes == int4 and m.empty_bytes == empty
            assert m.session_bytes > 0 and m.session_ratio == pytest.approx(m.session_bytes / int4)
            if m.peak_reset:
                assert m.peak_bytes >= m.session_bytes
    data = json.loads(json.dumps(report.to_json()))
    assert len(data["memory"]) == len(report.memory) and "net_ratio" in data["memory"][0]
    table = bench.format_memory(report)
    assert all(v in table for v in VARIANT_NAMES) and "session/int4" in table


def test_memory_sees_the_weights_a_session_holds() -> None:
    # FP32 ORT keeps its 8 MiB initializer resident: the measurement must see that much beyond an empty session.
    model = single_matmul(1024, 2048, seed=2)
    fp32_bytes = bench.constant_bytes(model)
    variant = bench.select_variants(None)[0]
    m = bench.measure_memory("w", variant, model, random_input(model, {"M": 1}), 1, bench.memory.empty_session_bytes())
    assert m.session_bytes - m.empty_bytes > 0.9 * fp32_bytes


GENAI_INT4 = os.path.join(os.path.dirname(__file__), "..", "genai", "llama-int4")


@pytest.mark.skipif(importlib.util.find_spec("onnxruntime_genai") is None, reason="onnxruntime-genai not installed")
def test_bench_genai_tokens_per_second(tmp_path, capsys) -> None:
    # `cim-int4 bench --genai DIR`: the tokens/s comparison lands in the printout and the JSON.
    out = tmp_path / "b.json"
    argv = ["--tiny", "--no-memory", "--threads", "1", "--variants", "cim-int4 int8", "--genai", GENAI_INT4]
    assert bench.main([*argv, "--json", str(out)]) == 0
    assert "genai greedy decode" in capsys.readouterr().out
    results = json.loads(out.read_text())["genai"]["results"]
    assert {"MatMulNBits acc4", "cim-int4 fp32"} <= set(results)
    assert all(r["decode_tokens_per_s"] > 0 for r in results.values())
