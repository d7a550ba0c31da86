"""Where one decode step's time goes: per-operator kernel time from ONNX Runtime's profiler.

``breakdown(source, past=128, steps=16, threads=1)`` (CLI: ``cim-int4 op-profile SOURCE``) opens a
causal-LM ONNX file or a genai folder's decoder (as ``cim-int4 perplexity`` does), runs one warm-up
and then ``steps`` single-token steps after a KV cache of ``past`` tokens (zeros: attention's cost
depends on the length, not the values) with ORT's profiler on, and sums each node's kernel time per
step: per operator type, with the weight ops split by role, since on a small LLM the LM head and the
embedding are a large share of the bytes:

- ``LM head``: the last weight op (MatMul, Gemm, MatMulNBits, CimInt4MatMul) in graph order;
- ``embedding``: a Gather on a constant table, GatherBlockQuantized or CimInt4Gather;
- every other node by its operator type (the layers' MatMuls under their op's name).

The profiler's per-node times exclude ORT's scheduling between nodes; ``step`` (the whole
``run``) includes it, and the difference is reported as ``other (between nodes)``.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from .perplexity import PerplexityError, open_model

WEIGHT_OPS = {"MatMul", "Gemm", "MatMulNBits", "CimInt4MatMul"}
TABLE_OPS = {"GatherBlockQuantized", "CimInt4Gather"}
LM_HEAD = "LM head"
EMBEDDING = "embedding"
BETWEEN = "other (between nodes)"


@dataclass
class Breakdown:
    """Microseconds per decode step by row (op type or role), and the step's median wall time."""

    source: str
    past: int
    steps: int
    threads: int | None
    step_us: float
    rows: dict[str, float] = field(default_factory=dict)  # row -> µs per step (mean over steps)
    nodes: dict[str, int] = field(default_factory=dict)  # row -> nodes in it

    def to_json(self) -> dict:
        return {"source": self.source, "past": self.past, "steps": self.steps, "threads": self.threads,
                "step_us": self.step_us, "rows": self.rows, "nodes": self.nodes}  # fmt: skip

    def format(self) -> str:
        lines = [
            f"{self.source}: one decode step after {self.past} cached tokens, {self.steps} steps, "
            f"threads {self.threads or 'ORT default'}: {self.step_us:.0f} us per step (median)",
            f"  {'row':<28} {'nodes':>5} {'us/step':>9} {'share':>6}",
        ]
        for row, us in sorted(self.rows.items(), key=lambda kv: -kv[1]):
            share = us / self.step_us if self.step_us > 0 else 0.0
            lines.append(f"  {row:<28} {self.nodes.get(row, 0):>5} {us:>9.1f} {share:>6.1%}")
        return "\n".join(lines)


def node_roles(path: Path) -> dict[str, str]:
    """Node name -> its row: LM head, embedding, or its op type (the graph only; no weights are read)."""
    graph = onnx.load(os.fspath(path), load_external_data=False).graph
    constants = {i.name for i in graph.initializer} | {
        o for n in graph.node if n.op_type == "Constant" for o in n.output
    }
    roles = {}
    weight_nodes = []
    for node in graph.node:
        roles[node.name] = node.op_type
        if node.op_type in WEIGHT_OPS:
            weight_nodes.append(node.name)
        if node.op_type in TABLE_OPS or (node.op_type == "Gather" and node.input and node.input[0] in constants):
            roles[node.name] = EMBEDDING
    if weight_nodes:
        roles[weight_nodes[-1]] = LM_HEAD
    return roles


def breakdown(source: str | os.PathLike, past: int = 128, steps: int = 16, threads: int | None = 1) -> Breakdown:
    """Per-row kernel time of ``steps`` profiled decode steps of ``source`` (see the module docstring)."""
    if past < 0 or steps < 1:
        raise PerplexityError(f"op-profile: need past >= 0 and steps >= 1, got past={past}, steps={steps}")
    with tempfile.TemporaryDirectory(prefix="cim-int4-profile-") as work:
        model = open_model(source, threads=threads, profile_prefix=os.path.join(work, "ort"))
        if model.context is not None and past + 1 > model.context:
            raise PerplexityError(f"op-profile: --past {past} + 1 exceeds the model's context ({model.context})")
        feeds = model.feeds_for(np.array([1], dtype=np.int64), past)
        for _ in range(steps + 1):  # the first is a warm-up, left out below
            model.session.run(None, feeds)
        trace = json.loads(Path(model.session.end_profiling()).read_text())
    roles = node_roles(model.path)
    runs = sorted((e for e in trace if e.get("cat") == "Session" and e.get("name") == "model_run"),
                  key=lambda e: e["ts"])[1:]  # fmt: skip
    if len(runs) != steps:
        raise PerplexityError(f"op-profile: the profile holds {len(runs) + 1} runs, expected {steps + 1}")
    first = runs[0]["ts"]
    totals: dict[str, float] = defaultdict(float)
    nodes: dict[str, set[str]] = defaultdict(set)
    for e in trace:
        name = e.get("name", "")
        if e.get("cat") != "Node" or not name.endswith("_kernel_time") or e["ts"] < first:
            continue
        node = name[: -len("_kernel_time")]
        row = roles.get(node, e.get("args", {}).get("op_name", "?"))
        totals[row] += e["dur"]
        nodes[row].add(node)
    step_us = statistics.median(e["dur"] for e in runs)
    rows = {row: us / steps for row, us in totals.items()}
    rows[BETWEEN] = max(0.0, statistics.mean(e["dur"] for e in runs) - sum(rows.values()))
    return Breakdown(str(source), past, steps, threads, step_us, rows, {r: len(n) for r, n in nodes.items()})


def add_arguments(p) -> None:
    """The ``op-profile`` command's options."""
    p.add_argument("source", nargs="+", help="causal-LM ONNX files or genai folders (each profiled in turn)")
    p.add_argument("--past", type=int, default=128, help="cached tokens before the profiled step (default 128)")
    p.add_argument("--steps", type=int, default=16, help="profiled decode steps (default 16)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON (never overwritten)")


def run(args) -> int:
    """Profiles each source and prints its table; returns the exit code."""
    if args.json and Path(args.json).exists():
        raise PerplexityError(f"op-profile: --json {args.json} exists; not overwriting it")
    reports = [breakdown(s, past=args.past, steps=args.steps, threads=args.threads) for s in args.source]
    print("\n\n".join(r.format() for r in reports))
    if args.json:
        with open(args.json, "x") as f:
            json.dump([r.to_json() for r in reports], f, indent=1)
    return 0
