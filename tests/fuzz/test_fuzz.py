"""A bounded, seeded fuzz run of CimInt4MatMul in child processes: no crash, no hang, clean errors or right answers.

``CIM_INT4_FUZZ_CASES`` (default 5000) and ``CIM_INT4_FUZZ_START`` (default 0) choose the seeds;
the sanitizer stage of .ci/run runs a slice. Attribute sizes near INT64_MAX (an overflow in size
arithmetic) and misaligned or huge inputs on the portable kernel are among the cases.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from harness import CRASH_ENV, Result, available_kernels, make_case, run_cases

CASES = int(os.environ.get("CIM_INT4_FUZZ_CASES", "5000"))
START = int(os.environ.get("CIM_INT4_FUZZ_START", "0"))
WORKERS = 2


@pytest.fixture(scope="module")
def kernels() -> tuple[str, ...]:
    return available_kernels()


@pytest.fixture(scope="module")
def results(kernels: tuple[str, ...]) -> dict[int, Result]:
    """Every case's result; the seeds split over WORKERS child processes at a time."""
    step = -(-CASES // WORKERS)
    chunks = [range(s, min(s + step, START + CASES)) for s in range(START, START + CASES, step)]
    with ThreadPoolExecutor(WORKERS) as pool:
        done = pool.map(lambda seeds: run_cases(seeds, kernels), chunks)
    return {r.seed: r for chunk in done for r in chunk}


def report(bad: list[Result], kernels: tuple[str, ...]) -> str:
    lines = []
    for r in bad[:40]:
        case = make_case(r.seed, kernels)
        lines.append(f"{r.outcome} seed={r.seed} {case.description}: {r.detail}")
    return f"{len(bad)} case(s) not ok:\n" + "\n".join(lines)


def test_every_case_has_an_outcome(results: dict[int, Result]) -> None:
    assert sorted(results) == list(range(START, START + CASES))


def test_fuzz_cases(results: dict[int, Result], kernels: tuple[str, ...]) -> None:
    bad = [r for r in results.values() if r.outcome != "ok"]
    assert not bad, report(bad, kernels)
    # Not vacuous: valid cases ran and matched, mutated ones were refused.
    details = [r.detail for r in results.values()]
    assert details.count("ran") > CASES // 5 and details.count("refused") > CASES // 5


def test_a_crash_is_reported_with_its_seed(kernels: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CRASH_ENV, "3")
    got = run_cases(range(0, 6), kernels)
    assert [r.seed for r in got] == list(range(6))
    assert got[3].outcome == "crash" and "exit -6" in got[3].detail
    assert all(r.outcome == "ok" for r in got if r.seed != 3), got


def test_the_harness_group_sizes_and_widths_are_the_contracts() -> None:
    from harness import BITS, GROUP_SIZES

    from cim_int4.contract import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES

    assert GROUP_SIZES == SUPPORTED_GROUP_SIZES
    assert BITS == SUPPORTED_BITS
