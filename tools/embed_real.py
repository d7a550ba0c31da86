"""Int4 embeddings on a real genai LLM: file size, session RSS, decode tokens/s and a per-op breakdown.

    .venv/bin/python tools/embed_real.py --fp32 FP32_DIR --int4 INT4_DIR --work WORK \\
        [--threads 1 2] [--steps 32] [--repeats 3] [--rounds 2] [--profile-steps 32]

FP32_DIR and INT4_DIR are the genai builder's ``-p fp32`` and ``-p int4`` folders of one
checkpoint. Makes ``WORK/export`` (``cim-int4 genai FP32_DIR``: export_int4 default options,
group 32, int4 embedding) and ``WORK/convert`` (``cim-int4 genai INT4_DIR``: convert of the
builder's int4), then reports, as JSON on stdout and in ``WORK/report.json``:

* ``size``: bytes of each decoder (model file + external data);
* ``rss``: VmRSS / VmHWM of a child process after an ORT session of each decoder is made and
  run once on a 4-token prompt (baseline: the same process before the session);
* ``decode``: genai greedy decode tokens/s of every variant at each thread count, variants
  interleaved, ``rounds`` x ``repeats`` runs, medians (cim_int4.genai_bench.greedy);
* ``profile``: ORT profiling of ``profile-steps`` single-token decode steps (past of 16 tokens)
  per variant at one thread: microseconds per token by op type (each node's median over the
  steps), the LM head and the embedding (nodes named ``embed``) apart.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx

from cim_int4.genai import prepare
from cim_int4.genai_bench import decoder_file, greedy, load

RSS_CHILD = r"""
import json, sys
from pathlib import Path
import numpy as np
from cim_int4.bench.memory_child import vm_status
from cim_int4.ops import make_session
feeds = dict(np.load(sys.argv[2]))
before = vm_status()["VmRSS"]
Path("/proc/self/clear_refs").write_text("5")
session = make_session(sys.argv[1], threads=1, pin=False)
session.run(None, feeds)
after = vm_status()
print(json.dumps({"baseline": before, "rss": after["VmRSS"], "peak": after["VmHWM"]}))
"""


KV_CAPACITY = 512


def model_bytes(model: Path) -> int:
    """The decoder file plus its external data files."""
    proto = onnx.load(str(model), load_external_data=False)
    tensors = list(proto.graph.initializer)
    tensors += [a.t for n in proto.graph.node for a in n.attribute if a.type == onnx.AttributeProto.TENSOR]
    files = {e.value for t in tensors for e in t.external_data if e.key == "location"}
    return model.stat().st_size + sum((model.parent / f).stat().st_size for f in files)


def feeds_for(model: Path, tokens: int, past: int) -> dict[str, np.ndarray]:
    """Decoder inputs: ``tokens`` new ids after an all-zero past of ``past`` positions."""
    proto = onnx.load(str(model), load_external_data=False)
    config = json.loads((model.parent / "genai_config.json").read_text())["model"]["decoder"]
    rng = np.random.default_rng(0)
    feeds = {}
    for i in proto.graph.input:
        if i.name.startswith("past_key_values"):
            # The KV buffer as genai shares it between past and present: its length is a capacity
            # (the attention mask says how much of it is used). Gemma 3's sliding-window attention
            # needs at least its window (512) there.
            capacity = max(past + tokens, KV_CAPACITY)
            feeds[i.name] = np.zeros((1, config["num_key_value_heads"], capacity, config["head_size"]), np.float32)
        elif i.name == "input_ids":
            feeds[i.name] = rng.integers(3, 1000, (1, tokens)).astype(np.int64)
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones((1, past + tokens), np.int64)
        elif i.name == "position_ids":
            feeds[i.name] = np.arange(past, past + tokens, dtype=np.int64)[None]
        else:
            raise SystemExit(f"{model}: input {i.name!r} is not one this tool knows how to feed")
    return feeds


def rss(model: Path, work: Path) -> dict:
    feeds = work / f"feeds-{model.parent.name}.npz"
    np.savez(feeds, **feeds_for(model, 4, 0))
    out = subprocess.run([sys.executable, "-c", RSS_CHILD, str(model), str(feeds)], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def category(node: str, op: str, head: set[str], embed: set[str]) -> str:
    if node in head:
        return "LM head"
    if node in embed:
        return "embedding"
    if op in ("CimInt4MatMul", "MatMulNBits", "MatMul"):
        return "other MatMuls"
    return op


def profile(model: Path, steps: int) -> dict[str, float]:
    """Microseconds per decode token by category, from ORT's profiler (one thread, past of 16)."""
    import onnxruntime as ort
    from cim_int4.ops import library_path

    proto = onnx.load(str(model), load_external_data=False)
    producers = {o: n for n in proto.graph.node for o in n.output}
    logits = producers["logits"]
    head = {logits.name}
    while logits.op_type not in ("CimInt4MatMul", "MatMulNBits", "MatMul") and logits.input:
        logits = producers[logits.input[0]]
        head.add(logits.name)
    embed = {n.name for n in proto.graph.node if "embed" in n.name}
    with tempfile.TemporaryDirectory() as tmp:
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        so.enable_profiling = True
        so.profile_file_prefix = str(Path(tmp) / "p")
        so.register_custom_ops_library(library_path())
        session = ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
        feeds = feeds_for(model, 1, 16)
        for _ in range(steps):
            session.run(None, feeds)
        trace = json.loads(Path(session.end_profiling()).read_text())
    # Per node, the median over the steps (a step preempted by another process does not count),
    # then summed by category.
    durations: dict[tuple[str, str], list[float]] = defaultdict(list)
    for event in trace:
        if event.get("cat") != "Node" or not event["name"].endswith("_kernel_time"):
            continue
        durations[(event["name"][: -len("_kernel_time")], event["args"].get("op_name", "?"))].append(event["dur"])
    per: dict[str, float] = defaultdict(float)
    for (node, op), values in durations.items():
        per[category(node, op, head, embed)] += statistics.median(values)
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def decode(folders: dict[str, Path], threads: list[int], steps: int, repeats: int, rounds: int) -> dict:
    vocab = json.loads((next(iter(folders.values())) / "genai_config.json").read_text())["model"]["vocab_size"]
    prompt = np.random.default_rng(0).integers(3, min(vocab, 30000), 16).tolist()
    out: dict[str, dict[str, float]] = {}
    for t in threads:
        models = {label: load(path, t) for label, path in folders.items()}
        times: dict[str, list[float]] = defaultdict(list)
        for model in models.values():
            greedy(model, prompt, steps, KV_CAPACITY)
        for _ in range(rounds * repeats):
            for label, model in models.items():
                times[label].append(greedy(model, prompt, steps, KV_CAPACITY).decode_s)
        out[str(t)] = {label: (steps - 1) / statistics.median(v) for label, v in times.items()}
        del models
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fp32", type=Path, required=True)
    parser.add_argument("--int4", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--profile-steps", type=int, default=32)
    parser.add_argument("--skip", nargs="*", default=[], choices=["size", "rss", "decode", "profile"])
    args = parser.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "export" / "genai_config.json").is_file():
        prepare(args.fp32, work / "export", quiet=True)
    if not (work / "convert" / "genai_config.json").is_file():
        prepare(args.int4, work / "convert", quiet=True)
    folders = {"FP32": args.fp32, "MatMulNBits acc4": args.int4, "export_int4 default": work / "export",
               "convert of builder int4": work / "convert"}
    report_path = work / "report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    decoders = {label: decoder_file(folder) for label, folder in folders.items()}
    if "size" not in args.skip:
        report["size"] = {label: model_bytes(m) for label, m in decoders.items()}
    if "rss" not in args.skip:
        report["rss"] = {label: rss(m, work) for label, m in decoders.items() if label != "FP32"}
    if "profile" not in args.skip:
        report["profile"] = {label: profile(m, args.profile_steps) for label, m in decoders.items()}
    if "decode" not in args.skip:
        report.setdefault("decode_runs", []).append(decode(folders, args.threads, args.steps, args.repeats,
                                                           args.rounds))
    report_path.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
