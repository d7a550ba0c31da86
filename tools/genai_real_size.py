"""Greedy-decode tokens/s of a real-size genai folder: MatMulNBits vs cim-int4, weight bandwidth vs the read probe, RSS.

Make the TinyLlama-1.1B-shaped folders first (torch env, ~2 min, 4.2 GB checkpoint + 0.9 GB a folder):

    /work/torchenv/bin/python tests/genai/make_models.py --size tinyllama --precision int4 \\
        --accuracy-level 4 0 --checkpoint SCRATCH/checkpoint -o SCRATCH

then time the accuracy_level 4 folder (``cim-int4 genai-bench``'s comparison, in this process,
between two read-bandwidth probes), compare each variant's logits with MatMulNBits acc0's, and
measure each variant's RSS in a child process:

    .venv/bin/python tools/genai_real_size.py SCRATCH/llama-int4-acc4 --threads 1 2 --steps 64 --repeats 5 \\
        --accuracy --memory
    .venv/bin/python tools/genai_real_size.py SCRATCH/llama-int4-acc4 --threads \\
        --accuracy --reference SCRATCH/llama-fp32     # make_models.py --precision fp32 builds it

Effective weight bandwidth = int4 bytes of the decoder's MatMulNBits nodes (packed + scales,
the quantized lm_head included; the FP32 embedding Gather reads one row a token) x tokens/s.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from cim_int4.exporter.convert import NBITS_DOMAIN, NBITS_OP

from cim_int4.bench.machine import LoadMeter
from cim_int4.bench.memory_child import vm_status
from cim_int4.bench.probe import BandwidthProbe
from cim_int4.genai_bench import compare, decoder_file, format_comparison, greedy, load, logits_along, variants


def nbits_weight_bytes(folder: Path) -> int:
    """Bytes of the decoder's MatMulNBits weight inputs (B, scales, zero points), from the graph without its data."""
    model = onnx.load(str(decoder_file(folder)), load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}
    total = 0
    for node in model.graph.node:
        if node.op_type == NBITS_OP and node.domain == NBITS_DOMAIN:
            for name in node.input[1:4]:
                if name in inits:
                    t = inits[name]
                    total += math.prod(t.dims) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    return total


def rss_child(folder: str, threads: int, steps: int) -> dict:
    """In a fresh process: RSS before loading ``folder``, after a greedy run of ``steps`` tokens, and the peak."""
    import onnxruntime_genai  # noqa: F401  (its import cost belongs to the baseline)

    before = vm_status()["VmRSS"]
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)
    model = load(folder, threads)
    greedy(model, list(range(3, 19)), steps)
    after = vm_status()  # while `model` is alive: freeing it first measured the allocator, not the session
    return {"session": after["VmRSS"] - before, "peak": after["VmHWM"] - before}


def memory(folder: Path, threads: int, steps: int) -> dict[str, dict]:
    """RSS of each comparison variant of ``folder``, one child process each."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="cim-int4-genai-mem-") as work:
        for label, path in variants(folder, work).items():
            cmd = [sys.executable, __file__, "--rss-child", str(path), str(threads), str(steps)]
            out[label] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return out


def accuracy(folder: Path, steps: int, reference_folder: Path | None = None) -> dict[str, dict]:
    """Each variant's logits along the reference's greedy tokens, against the reference's (default MatMulNBits acc0).

    Teacher forcing: every model sees the same tokens, so each step compares one forward pass.
    Returns mean/min cosine, max |diff| and how many argmax tokens equal the reference's.
    """
    prompt = list(range(3, 19))
    out = {}
    with tempfile.TemporaryDirectory(prefix="cim-int4-genai-acc-") as work:
        folders = variants(folder, work)
        reference_model = load(reference_folder or folders["MatMulNBits acc0"])
        tokens = greedy(reference_model, prompt, steps).tokens
        reference = logits_along(reference_model, prompt, tokens)
        del reference_model
        for label, path in folders.items():
            logits = logits_along(load(path), prompt, tokens)
            cos = (logits * reference).sum(1) / (np.linalg.norm(logits, axis=1) * np.linalg.norm(reference, axis=1))
            out[label] = {
                "cos_mean": float(cos.mean()),
                "cos_min": float(cos.min()),
                "max_abs_diff": float(np.abs(logits - reference).max()),
                "argmax_equal": int((logits.argmax(1) == reference.argmax(1)).sum()),
            }
    return out


def timed(folder: Path, threads: int, steps: int, repeats: int, probe: BandwidthProbe, weight_bytes: int) -> dict:
    """``compare`` between two probes of the read bandwidth, with the load other processes put on the machine."""
    meter = LoadMeter()
    before = probe.bandwidth(threads)
    report = compare(folder, steps=steps, repeats=repeats, threads=threads)
    after = probe.bandwidth(threads)
    report["probe_bytes_per_s"] = [before, after]
    report["other_load_cpus"] = meter.other_cpus()
    bw = statistics.mean([before, after])
    for r in report["results"].values():
        r["weight_bytes_per_s"] = weight_bytes * r["decode_tokens_per_s"]
        r["share_of_probe"] = r["weight_bytes_per_s"] / bw
    return report


def main() -> None:
    if sys.argv[1:2] == ["--rss-child"]:
        print(json.dumps(rss_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="genai folder with MatMulNBits (the builder's int4 output)")
    parser.add_argument("--threads", type=int, nargs="*", default=[1, 2], help="none: no timing")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--memory", action="store_true", help="also the RSS of each variant (one child process each)")
    parser.add_argument("--accuracy", action="store_true", help="also logits against MatMulNBits acc0's")
    parser.add_argument("--reference", type=Path, help="--accuracy against this genai folder (e.g. the FP32 build)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    weight_bytes = nbits_weight_bytes(args.folder)
    print(f"{args.folder}: MatMulNBits weights (packed + scales) {weight_bytes / 1e6:.1f} MB")
    probe = BandwidthProbe.for_this_machine()
    result: dict = {"weight_bytes": weight_bytes, "runs": []}
    for threads in args.threads:
        report = timed(args.folder, threads, args.steps, args.repeats, probe, weight_bytes)
        result["runs"].append(report)
        print(format_comparison(report))
        gbs = ", ".join(f"{b / 1e9:.1f}" for b in report["probe_bytes_per_s"])
        print(f"  probe before/after: {gbs} GB/s; other processes kept {report['other_load_cpus']} CPUs busy")
        for label, r in report["results"].items():
            share = f"{r['weight_bytes_per_s'] / 1e9:6.1f} GB/s = {100 * r['share_of_probe']:.0f}% of probe"
            print(f"  {label:<32} {share}")
    if args.accuracy:
        result["accuracy"] = accuracy(args.folder, args.steps, args.reference)
        ref = args.reference or "MatMulNBits acc0"
        print(f"logits along {ref}'s {args.steps} greedy tokens (teacher forcing), against its logits:")
        for label, a in result["accuracy"].items():
            print(
                f"  {label:<32} cosine mean {a['cos_mean']:.6f} min {a['cos_min']:.6f}, max |diff| "
                f"{a['max_abs_diff']:.3g}, argmax equal {a['argmax_equal']}/{args.steps}"
            )
    if args.memory:
        result["memory"] = memory(args.folder, 1, 8)
        for label, m in result["memory"].items():
            print(
                f"  RSS {label:<32} session {m['session'] / 1e9:.2f} GB ({m['session'] / weight_bytes:.2f}x weights),"
                f" peak {m['peak'] / 1e9:.2f} GB"
            )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
