"""Where one decode step's time goes: per-operator kernel time from ONNX Runtime's profiler.

``breakdown(source, past=128, steps=16, threads=1)`` (CLI: ``cim-int4 op-profile SOURCE``) opens a
causal-LM ONNX file or a genai folder's decoder (as ``cim-int4 perplexity`` does), runs one warm-up
and then ``steps`` single-token steps after a KV cache of ``past`` tokens (zeros: attention's cost
depends on the length, not the values; bound once with IOBinding, in one buffer with the present
outputs where genai shares them: ``bind_step``) with ORT's profiler on, and sums each node's kernel time per
step: per operator type, with the weight ops split by role, since on a small LLM the LM head and the
embedding are a large share of the bytes:

- ``LM head``: the last weight op (MatMul, Gemm, MatMulNBits, CimInt4MatMul) in graph order;
- ``embedding``: a Gather on a constant table, GatherBlockQuantized or CimInt4Gather;
- every other node by its operator type (the layers' MatMuls under their op's name).

The profiler's per-node times exclude ORT's scheduling between nodes; the profiled ``run``
includes it, and the difference is reported as ``other (between nodes)``.

The profiler is not free, and on a decode step of a small LLM (about 200 nodes of a few
microseconds each) its cost is a large share: it adds several microseconds to each node's
recorded kernel time (one SkipSimplifiedLayerNormalization of 576 floats: 1.4 us per node
unprofiled, 4-6 us as recorded) and more between nodes (SmolLM2-135M on a Zen 3: 11.0 ms per step
unprofiled, 13.3 ms profiled at 1 thread; 6.7 vs 9.6 ms at 2). So the report also times the step
without the profiler (``unprofiled_step_us``: a second session, the same step bound the same
way, as a C++ caller runs it), measures what the profiler records for a node that does nothing
(``node_cost_us``: a chain of one-float Adds, on this machine, after the run), and gives each row
less that cost per node (``rows_less_profiler``): an estimate, since the profiler also slows the
nodes' own work; read the rows of many tiny nodes with that in mind. ``rows`` (with ``other
(between nodes)``) add up to the profiled runs' mean; ``step_us`` is their median and
``unprofiled_step_us`` the step without the profiler.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from .perplexity import CausalLM, PerplexityError, open_model

WEIGHT_OPS = {"MatMul", "Gemm", "MatMulNBits", "CimInt4MatMul"}
TABLE_OPS = {"GatherBlockQuantized", "CimInt4Gather"}
LM_HEAD = "LM head"
EMBEDDING = "embedding"
BETWEEN = "other (between nodes)"
KV_SHARED = "in one buffer with the present outputs, as genai runs it"
KV_FED = "fed as arrays, the present outputs apart"


@dataclass
class Breakdown:
    """Microseconds per decode step by row (op type or role), and the step's median wall time."""

    source: str
    past: int
    steps: int
    threads: int | None
    step_us: float  # median step under the profiler
    rows: dict[str, float] = field(default_factory=dict)  # row -> µs per step as profiled (mean over steps)
    nodes: dict[str, int] = field(default_factory=dict)  # row -> nodes in it
    unprofiled_step_us: float = 0.0  # median step without the profiler
    node_cost_us: float = 0.0  # what the profiler records for a node that does nothing
    rows_less_profiler: dict[str, float] = field(default_factory=dict)  # rows less node_cost_us per node
    shared_kv: bool = False  # past and present key / value bound to one buffer (bind_step), as genai runs it

    def to_json(self) -> dict:
        return {"source": self.source, "past": self.past, "steps": self.steps, "threads": self.threads,
                "step_us": self.step_us, "rows": self.rows, "nodes": self.nodes,
                "unprofiled_step_us": self.unprofiled_step_us, "node_cost_us": self.node_cost_us,
                "rows_less_profiler": self.rows_less_profiler, "shared_kv": self.shared_kv}  # fmt: skip

    def format(self) -> str:
        total = sum(self.rows.values())  # the profiled runs' mean
        lines = [
            f"{self.source}: one decode step after {self.past} cached tokens, threads {self.threads or 'ORT default'}: "
            f"{self.unprofiled_step_us:.0f} us unprofiled, {self.step_us:.0f} us under ORT's profiler (medians); "
            f"KV cache {KV_SHARED if self.shared_kv else KV_FED}",
            f"  rows: {self.steps} profiled steps, share of their mean; the profiler records {self.node_cost_us:.1f} "
            "us for a node that does nothing, taken out of each node in the last column (an estimate)",
            f"  {'row':<32} {'nodes':>5} {'us/step':>9} {'share':>6} {'less profiler':>13}",
        ]
        for row, us in sorted(self.rows.items(), key=lambda kv: -kv[1]):
            share = us / total if total > 0 else 0.0
            less = f"{self.rows_less_profiler[row]:>13.1f}" if row in self.rows_less_profiler else ""
            lines.append(f"  {row:<32} {self.nodes.get(row, 0):>5} {us:>9.1f} {share:>6.1%} {less}".rstrip())
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
        shared_kv = bool(model.shared_kv)
        timed_runs(model.session, bind_step(model, past), steps + 1)  # the first is a warm-up, left out below
        trace = json.loads(Path(model.session.end_profiling()).read_text())
        path = model.path
        del model  # one session's weights in memory at a time
        plain = open_model(source, threads=threads)
        binding = bind_step(plain, past)
        timed_runs(plain.session, binding, 1)
        unprofiled = statistics.median(timed_runs(plain.session, binding, max(steps, UNPROFILED_STEPS))) * 1e6
        del plain, binding
        node_cost = profiler_node_cost(threads, os.path.join(work, "noop"))
    roles = node_roles(path)
    runs = _runs(trace)[1:]
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
    rows = {row: us / steps for row, us in totals.items()}
    less = {row: max(0.0, us - len(nodes[row]) * node_cost) for row, us in rows.items()}
    rows[BETWEEN] = max(0.0, statistics.mean(e["dur"] for e in runs) - sum(rows.values()))
    step_us = statistics.median(e["dur"] for e in runs)
    return Breakdown(str(source), past, steps, threads, step_us, rows, {r: len(n) for r, n in nodes.items()},
                     unprofiled, node_cost, less, shared_kv)  # fmt: skip


def _runs(trace: list[dict]) -> list[dict]:
    """The profile's session runs (``model_run`` events), in time order."""
    return sorted((e for e in trace if e.get("cat") == "Session" and e.get("name") == "model_run"),
                  key=lambda e: e["ts"])  # fmt: skip


UNPROFILED_STEPS = 16  # at least this many timed steps without the profiler
NOOP_NODES = 64


def bind_step(model: CausalLM, past: int):  # returns an onnxruntime IOBinding
    """One decode step of ``model`` (token 1 after ``past`` cached zeros) bound once, as genai runs it.

    With ``model.shared_kv`` (genai's ``past_present_share_buffer``), each layer's past and present
    key / value are one buffer of ``past + 1`` positions: GroupQueryAttention writes the new token
    in place and copies nothing, where a present output of its own makes it copy the whole cache
    every step (SmolLM2's 30 GroupQueryAttention nodes on an Intel Xeon, past 32: ~8 against 12-15 us
    each; docs/real-llm.md). Else the feeds as ``bind_feeds`` binds them.
    """
    import onnxruntime as ort

    feeds = model.feeds_for(np.array([1], dtype=np.int64), past)
    if not model.shared_kv:
        return bind_feeds(model.session, feeds)
    binding = model.session.io_binding()
    buffers = {}
    for name, value in feeds.items():
        if name in model.shared_kv.values():
            # the cache's first `past` positions (zeros) and room for the step's token
            buffers[name] = np.zeros((*value.shape[:2], past + 1, *value.shape[3:]), dtype=value.dtype)
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(buffers[name]))
        else:
            binding.bind_cpu_input(name, value)
    for out in model.session.get_outputs():
        if out.name in model.shared_kv:
            binding.bind_ortvalue_output(out.name, ort.OrtValue.ortvalue_from_numpy(buffers[model.shared_kv[out.name]]))
        else:
            binding.bind_output(out.name)
    binding.kv_buffers = buffers  # the OrtValues borrow these arrays: they live as long as the binding
    return binding


def bind_feeds(session, feeds: dict):  # returns an onnxruntime IOBinding
    """``feeds`` bound once to ``session``'s inputs and every output to ORT-allocated CPU memory (no per-run copies)."""
    binding = session.io_binding()
    for name, value in feeds.items():
        binding.bind_cpu_input(name, value)
    for out in session.get_outputs():
        binding.bind_output(out.name)
    return binding


def timed_runs(session, binding, runs: int) -> list[float]:
    """Wall time (s) of each of ``runs`` runs of ``session`` with ``binding``."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run_with_iobinding(binding)
        times.append(time.perf_counter() - start)
    return times


BLOCK = 10  # steps a block of interleaved_blocks, its median kept
PAUSE_S = 0.02  # before each block: the previous session's pool threads stop spinning


def interleaved_blocks(runs, rounds: int) -> list[list[float]]:
    """Per (session, binding) of ``runs``: the median seconds of each of ``rounds`` blocks of BLOCK runs.

    After 5 warm-up runs each, the sessions take turns block by block, in reverse order every other
    round, each block after a PAUSE_S pause: sessions alternated step by step steal each other's
    second core on a 2-vCPU guest. Paired blocks give ratios to trust on a shared host.
    """
    for session, binding in runs:
        timed_runs(session, binding, 5)
    times: list[list[float]] = [[] for _ in runs]
    for r in range(rounds):
        for i in range(len(runs)) if r % 2 else reversed(range(len(runs))):
            time.sleep(PAUSE_S)
            times[i].append(statistics.median(timed_runs(*runs[i], BLOCK)))
    return times


def profiler_node_cost(threads: int | None, prefix: str) -> float:
    """Median kernel time (µs) ORT's profiler records for a node that does nothing: a chain of one-float Adds.

    The session is made as the model's (``session_options``, no arena): what the profiler adds
    depends on the thread pool. Its first run is left out, as the model's warm-up is. A node with
    more inputs and outputs than an Add's two and one costs the profiler a little more.
    """
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from .ops import session_options

    nodes = [helper.make_node("Add", [f"x{i}", "one"], [f"x{i + 1}"]) for i in range(NOOP_NODES)]
    graph = helper.make_graph(
        nodes, "noop", [helper.make_tensor_value_info("x0", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info(f"x{NOOP_NODES}", TensorProto.FLOAT, [1])],
        [numpy_helper.from_array(np.ones(1, np.float32), "one")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    so = session_options(threads, pin=False)
    so.enable_cpu_mem_arena = False
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # keep every Add
    so.enable_profiling = True
    so.profile_file_prefix = prefix
    session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    x = np.zeros(1, np.float32)
    for _ in range(UNPROFILED_STEPS + 1):
        session.run(None, {"x0": x})
    trace = json.loads(Path(session.end_profiling()).read_text())
    runs = _runs(trace)
    after = runs[1]["ts"] if len(runs) > 1 else 0
    times = [e["dur"] for e in trace
             if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time") and e["ts"] >= after]  # fmt: skip
    return statistics.median(times) if times else 0.0


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
