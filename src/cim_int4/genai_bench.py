"""Greedy generation and tokens/s in onnxruntime-genai: MatMulNBits vs CimInt4MatMul on the same model folder.

``compare(DIR)`` (CLI: ``cim-int4 genai-bench DIR``) takes a genai folder with MatMulNBits
nodes, makes in a temporary folder the variants that compare like with like
(MatMulNBits at its own accuracy level and at level 0; the converted model with
``compute`` fp32 and, if any node had level 4, as converted), and times greedy decoding of
each, interleaved, in this process. Needs ``pip install onnxruntime-genai``.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from .exporter import ExportError, load_model, save_model
from .exporter.convert import NBITS_DOMAIN, NBITS_OP
from .genai import CONFIG_NAME, copy_folder, model_files, prepare


@dataclass(frozen=True)
class Generation:
    """One greedy run: the new tokens, seconds for the prompt (prefill) and for the decode steps."""

    tokens: list[int]
    prefill_s: float
    decode_s: float


def _genai():
    try:
        import onnxruntime_genai
    except ImportError as e:
        raise ExportError(f"onnxruntime-genai is not installed (pip install onnxruntime-genai): {e}") from e
    return onnxruntime_genai


def load(folder: str | os.PathLike, threads: int | None = None):
    """An ``onnxruntime_genai.Model`` of ``folder``, with ``threads`` intra-op threads if given."""
    og = _genai()
    config = og.Config(str(folder))
    if threads is not None:
        options = {"intra_op_num_threads": threads, "inter_op_num_threads": 1}
        config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
    return og.Model(config)


def greedy(model, prompt: Sequence[int], steps: int, capacity: int = 0) -> Generation:
    """Greedy-decode ``steps`` new tokens after ``prompt`` with a loaded genai ``model``; EOS cannot end it early.

    ``capacity``: KV-cache length at least (genai sizes it by max_length); Gemma 3's sliding-window
    attention needs its window (512).
    """
    og = _genai()
    params = og.GeneratorParams(model)
    length = max(len(prompt) + steps, capacity)
    # min_length masks EOS, so every variant decodes exactly `steps` tokens.
    params.set_search_options(do_sample=False, max_length=length, min_length=length)
    generator = og.Generator(model, params)
    t0 = time.perf_counter()
    generator.append_tokens(np.asarray(prompt, dtype=np.int32))
    generator.generate_next_token()
    tokens = [int(generator.get_next_tokens()[0])]
    t1 = time.perf_counter()
    while len(tokens) < steps:
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    t2 = time.perf_counter()
    return Generation(tokens=tokens, prefill_s=t1 - t0, decode_s=t2 - t1)


def logits_along(model, prompt: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
    """Logits [len(tokens), vocab] of ``model`` at each step, fed ``prompt`` then ``tokens`` (teacher forcing)."""
    og = _genai()
    params = og.GeneratorParams(model)
    length = len(prompt) + len(tokens)
    params.set_search_options(do_sample=False, max_length=length, min_length=length)
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray(prompt, dtype=np.int32))
    rows = []
    for token in tokens:
        rows.append(np.asarray(generator.get_logits(), dtype=np.float32).reshape(-1))
        generator.append_tokens(np.asarray([token], dtype=np.int32))
    return np.stack(rows)


def agreement(tokens: Sequence[int], reference: Sequence[int]) -> int:
    """How many leading tokens of ``tokens`` equal those of ``reference``."""
    n = min(len(tokens), len(reference))
    return next((i for i in range(n) if tokens[i] != reference[i]), n)


def decoder_file(folder: Path) -> Path:
    """The decoder ONNX file that genai_config.json of ``folder`` names."""
    config = json.loads((folder / CONFIG_NAME).read_text())
    return folder / config["model"]["decoder"]["filename"]


def with_accuracy_level(source: str | os.PathLike, output: str | os.PathLike, level: int) -> Path:
    """A copy of the genai folder ``source`` whose decoder's MatMulNBits nodes have ``accuracy_level`` = ``level``."""
    src, out = Path(source), Path(output)
    source_model = decoder_file(src)
    copy_folder(src, out, model_files(source_model))
    model = load_model(source_model)
    for node in model.graph.node:
        if node.op_type == NBITS_OP and node.domain == NBITS_DOMAIN:
            kept = [a for a in node.attribute if a.name != "accuracy_level"]
            del node.attribute[:]
            node.attribute.extend([*kept, onnx.helper.make_attribute("accuracy_level", level)])
    save_model(model, out / source_model.relative_to(src))
    return out


def accuracy_levels(folder: str | os.PathLike) -> set[int]:
    """The accuracy_level values of the decoder's MatMulNBits nodes (absent = 0)."""
    model = onnx.load(str(decoder_file(Path(folder))), load_external_data=False)
    return {
        next((a.i for a in n.attribute if a.name == "accuracy_level"), 0)
        for n in model.graph.node
        if n.op_type == NBITS_OP and n.domain == NBITS_DOMAIN
    }


def variants(folder: str | os.PathLike, workdir: str | os.PathLike) -> dict[str, Path]:
    """The genai folders to compare, made under ``workdir``: label -> folder."""
    src, work = Path(folder), Path(workdir)
    levels = accuracy_levels(src)
    if not levels:
        raise ExportError(f"{src}: the decoder has no {NBITS_DOMAIN} {NBITS_OP} node to compare against")
    out = {f"MatMulNBits acc{'/'.join(map(str, sorted(levels)))}": src}
    if levels != {0}:
        out["MatMulNBits acc0"] = with_accuracy_level(src, work / "nbits-acc0", 0)
    out["cim-int4 fp32"] = prepare(src, work / "cim-fp32", compute="fp32", quiet=True)
    if 4 in levels:
        out["cim-int4 auto (int8 where acc4)"] = prepare(src, work / "cim-auto", compute="auto", quiet=True)
    return out


def compare(
    folder: str | os.PathLike,
    *,
    prompt_len: int = 16,
    steps: int = 32,
    repeats: int = 3,
    threads: int | None = None,
) -> dict:
    """Tokens/s of greedy decoding for MatMulNBits and CimInt4MatMul variants of ``folder``: a JSON-able dict.

    Runs are interleaved (variant after variant, ``repeats`` rounds) after one warm-up each;
    decode tokens/s = (steps - 1) / median decode time (the first token is the prefill's).
    """
    if steps < 2 or prompt_len < 1 or repeats < 1:
        raise ValueError("need steps >= 2, prompt_len >= 1 and repeats >= 1")
    vocab = json.loads((Path(folder) / CONFIG_NAME).read_text())["model"]["vocab_size"]
    prompt = np.random.default_rng(0).integers(3, vocab, prompt_len).tolist()
    with tempfile.TemporaryDirectory(prefix="cim-int4-genai-") as work:
        folders = variants(folder, work)
        models = {label: load(path, threads) for label, path in folders.items()}
        runs: dict[str, list[Generation]] = {label: [] for label in models}
        for model in models.values():
            greedy(model, prompt, steps)  # warm-up: first-run allocations and weight repacking
        for _ in range(repeats):
            for label, model in models.items():
                runs[label].append(greedy(model, prompt, steps))
    results = {}
    for label, gens in runs.items():
        decode = statistics.median(g.decode_s for g in gens)
        results[label] = {
            "decode_tokens_per_s": (steps - 1) / decode,
            "prefill_ms": 1e3 * statistics.median(g.prefill_s for g in gens),
            "decode_s": [g.decode_s for g in gens],
            "tokens": gens[0].tokens,
        }
    return {
        "folder": str(folder),
        "prompt_len": prompt_len,
        "steps": steps,
        "repeats": repeats,
        "threads": threads,
        "results": results,
    }


def format_comparison(report: dict) -> str:
    """A small table of ``compare``'s result; token agreement is counted against both MatMulNBits rows."""
    results = report["results"]
    nbits = [label for label in results if label.startswith("MatMulNBits")]
    header = "".join(f" {'= ' + label:>22}" for label in nbits)
    lines = [
        f"genai greedy decode, prompt {report['prompt_len']} tokens, {report['steps']} new tokens, "
        f"median of {report['repeats']}, threads {report['threads'] or 'genai default'}",
        f"  {'variant':<32} {'decode tok/s':>12} {'prefill ms':>10}{header}  (leading tokens equal)",
    ]
    for label, r in results.items():
        same = "".join(f" {agreement(r['tokens'], results[n]['tokens']):>22}" for n in nbits)
        lines.append(f"  {label:<32} {r['decode_tokens_per_s']:>12.1f} {r['prefill_ms']:>10.2f}{same}")
    return "\n".join(lines)
