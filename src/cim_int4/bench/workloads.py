"""What is timed: FP32 graphs from graphs/ (workloads), at M tokens and a thread count (cases), in suites."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import onnx

from ..graphs import LlamaConfig, llama_decoder, matmul_chain, single_matmul


def _matrix_dims(m: int) -> dict[str, int]:
    return {"M": m}


def _decoder_dims(m: int) -> dict[str, int]:
    return {"batch": 1, "seq": m}


@dataclass(frozen=True)
class Workload:
    """One FP32 graph from graphs/; ``dims(M)`` maps the token count M to its symbolic input dims."""

    name: str
    build: Callable[[], onnx.ModelProto] = field(compare=False)
    dims: Callable[[int], dict[str, int]] = field(compare=False)


def layer(k: int, n: int) -> Workload:
    """A single MatMul [M, k] x [k, n]."""
    return Workload(f"matmul {k}x{n}", partial(single_matmul, k, n), _matrix_dims)


def chain(layers: int, dim: int) -> Workload:
    """``layers`` MatMuls [dim, dim] in series."""
    return Workload(f"chain {layers}x{dim}x{dim}", partial(matmul_chain, layers, dim), _matrix_dims)


def decoder(cfg: LlamaConfig) -> Workload:
    """The graphs/ Llama decoder stack; M is the sequence length (batch 1, no KV cache)."""
    name = f"llama {cfg.layers}L h{cfg.hidden} i{cfg.intermediate}"
    return Workload(name, partial(llama_decoder, cfg), _decoder_dims)


@dataclass(frozen=True)
class Case:
    """One timed configuration: a workload at M tokens with ``threads`` pinned intra-op threads."""

    workload: Workload
    m: int
    threads: int

    @property
    def name(self) -> str:
        return f"{self.workload.name} M={self.m} t={self.threads}"

    @property
    def id(self) -> str:
        """The name with no spaces, for pytest ids and benchmark groups."""
        return f"{self.workload.name.replace(' ', '-')}-M{self.m}-t{self.threads}"


@dataclass(frozen=True)
class Suite:
    """Workloads x token counts, and how long to time each case."""

    name: str
    workloads: tuple[Workload, ...]
    ms: tuple[int, ...]
    min_rounds: int
    max_rounds: int
    max_time: float  # seconds per case; rounds stop after this once min_rounds are done
    buffer_cap: int | None = None  # caps the probe/eviction buffer (tiny shapes need no DRAM-sized one)
    retries: int = 1  # times a case is measured again when other processes kept CPUs busy during it
    memory: bool = True  # measure each variant's resident memory per workload (a fresh process each, ~1 s)

    def cases(self, threads: Sequence[int]) -> list[Case]:
        """Every (workload, threads, M), in the order they are run."""
        return [Case(w, m, t) for w in self.workloads for t in threads for m in self.ms]


SUITES: dict[str, Suite] = {
    "full": Suite(
        "full",
        (layer(4096, 4096), layer(4096, 11008), layer(11008, 4096), chain(16, 4096), decoder(LlamaConfig())),
        ms=(1, 16, 128),  # decode, and prefill at M = 16 and 128
        min_rounds=7,
        max_rounds=60,
        max_time=10.0,
    ),
    "quick": Suite(
        "quick",
        (layer(4096, 4096), decoder(LlamaConfig())),
        ms=(1,),
        min_rounds=7,
        max_rounds=60,
        max_time=8.0,
    ),
    # Smoke test of every code path in seconds (CI): tiny shapes, a few rounds.
    "tiny": Suite(
        "tiny",
        (
            layer(128, 256),
            layer(256, 64),
            chain(3, 128),
            decoder(LlamaConfig(hidden=64, intermediate=128, layers=2, heads=4)),
        ),
        ms=(1, 5),
        min_rounds=3,
        max_rounds=3,
        max_time=0.0,
        buffer_cap=64 << 20,
        retries=0,
    ),
}
DEFAULT_THREADS = (1, 2)
