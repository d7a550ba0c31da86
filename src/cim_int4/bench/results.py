"""What a run measured: results per case and variant, derived rows (speed-ups, bandwidth, accuracy), JSON."""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field

from .memory import MemoryResult
from .variants import BASELINE, VARIANTS

# Largest relative RMS error vs FP32 an INT4 (block 32) variant may show on the bench graphs.
# Measured: 0.09-0.10 on single layers, 0.34-0.37 through the 16-layer chain, 0.21-0.40 on the
# decoder (the graphs plant 10x outlier columns, see graphs/_common.py). Wrong nibble order or
# scales give ~1.4, all zeros 1.0.
REL_ERROR_BOUND = 0.7


@dataclass
class Result:
    """Timings of one variant in one case."""

    case: str
    case_id: str
    workload: str
    m: int
    threads: int
    variant: str
    weight_bytes: int
    rel_error: float
    samples: list[float]
    # Probe read bandwidth (bytes/s) sampled once per round of this case, at its thread count;
    # empty for a warm run, whose case bandwidth is the run's.
    bandwidth_samples: list[float] = field(default_factory=list)
    # CPUs that other processes (and the hypervisor) kept busy during the case, on average.
    other_load: float | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread(self) -> float:
        """Half the interquartile range over the median: the noise of this measurement."""
        if len(self.samples) < 2:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.samples, n=4, method="inclusive")
        return (q3 - q1) / 2 / self.median


@dataclass
class Row:
    """One line of the table."""

    result: Result
    vs_fp32: float | None
    vs_nbits: float | None
    peer: str | None
    gbps: float
    pct_bandwidth: float | None
    accurate: bool


@dataclass
class Report:
    """Everything one run measured, with the machine it ran on."""

    meta: dict
    bandwidth: dict[int, float]  # threads -> bytes/s
    results: list[Result]
    memory: list[MemoryResult] = field(default_factory=list)  # per workload and variant, when measured

    def rows(self) -> list[Row]:
        """The results with speed-ups, effective bandwidth and accuracy verdicts, in run order."""
        peers = {v.name: v.peer for v in VARIANTS}
        by_case: dict[str, dict[str, Result]] = {}
        for r in self.results:
            by_case.setdefault(r.case, {})[r.variant] = r
        rows = []
        for r in self.results:
            same = by_case[r.case]
            fp32 = same.get(BASELINE)
            peer = peers.get(r.variant)
            nbits = same.get(peer) if peer else None
            gbps = r.weight_bytes / r.median / 1e9
            bw = statistics.median(r.bandwidth_samples) if r.bandwidth_samples else self.bandwidth.get(r.threads)
            rows.append(
                Row(
                    result=r,
                    vs_fp32=fp32.median / r.median if fp32 else None,
                    vs_nbits=nbits.median / r.median if nbits else None,
                    peer=peer if nbits else None,
                    gbps=gbps,
                    pct_bandwidth=100.0 * gbps * 1e9 / bw if bw else None,
                    accurate=r.rel_error <= REL_ERROR_BOUND,
                )
            )
        return rows

    def case_bandwidth(self, threads: int) -> list[float]:
        """Median probe bandwidth (bytes/s) of each case run with ``threads`` threads (empty for a warm run)."""
        per_case = {r.case: r.bandwidth_samples for r in self.results if r.threads == threads and r.bandwidth_samples}
        return [statistics.median(v) for v in per_case.values()]

    def to_json(self) -> dict:
        """A JSON-ready dict: meta, bandwidth per thread count, one entry per row with its raw samples."""
        entries = []
        for row in self.rows():
            entry = dataclasses.asdict(row.result)
            entry.update(
                median_s=row.result.median,
                spread=row.result.spread,
                speedup_vs_fp32=row.vs_fp32,
                speedup_vs_nbits=row.vs_nbits,
                nbits_peer=row.peer,
                effective_gbps=row.gbps,
                pct_of_bandwidth=row.pct_bandwidth,
                case_bandwidth_gbps=statistics.median(row.result.bandwidth_samples) / 1e9
                if row.result.bandwidth_samples
                else None,
                accurate=row.accurate,
            )
            entries.append(entry)
        return {
            "meta": self.meta,
            "bandwidth_gbps": {str(t): bw / 1e9 for t, bw in self.bandwidth.items()},
            "results": entries,
            "memory": [
                dataclasses.asdict(m)
                | {"session_ratio": m.session_ratio, "net_ratio": m.net_ratio, "peak_ratio": m.peak_ratio}
                for m in self.memory
            ],
        }
