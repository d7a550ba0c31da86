"""Sweep GPTQ / RTN settings on a real LLM with one FP32 session: calibrate once, score each variant by perplexity.

    # 1. tokens (needs onnxruntime-genai, e.g. /work/real/venv/bin/python):
    python tools/gptq_sweep.py tokenize FP32_FOLDER TEXT OUT.npy
    # 2. statistics of the first W 512-token windows of the calibration tokens (cached in STATS.npz):
    # 3. every variant's perplexity on the evaluation tokens (non-overlapping windows):
    python tools/gptq_sweep.py sweep FP32_FOLDER --calib calib.npy --windows 24 --stats STATS.npz \
        --eval eval.npy --eval-windows 16 --json OUT.json --variants rtn:signed gptq:mse:damp=0.01 ...

A variant is ``method:rule[:key=value...]``: method ``rtn`` or ``gptq``; keys ``group`` (32),
``damp`` (0.01), ``act`` (act order, 0/1), ``block`` (128), ``tie`` (``shared``: the token
embedding reads the head's int4 codes, as MatMulNBits' tied export and ours do; ``rtn``: the
embedding gets its own round-to-nearest codes; ``fp32``: the embedding stays FP32), ``scales``
(``float32``, the dtype of docs/methods.md's sweep; ``float16``, ``int8``).

Every MatMul weight of the FP32 decoder becomes an overridable graph input of one session;
a variant is scored by feeding its dequantized weights there (the same product CimInt4MatMul
computes in ``fp32`` mode, up to summation order). Scores per window are kept so the noise
of a gap can be estimated (paired differences over windows). Figures: docs/methods.md.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np


def _tokenize(args: argparse.Namespace) -> None:
    import onnxruntime_genai as og

    tok = og.Tokenizer(og.Config(args.folder))
    ids = np.asarray(tok.encode(Path(args.text).read_text(encoding="utf-8")), dtype=np.int64)
    np.save(args.out, ids)
    print(f"{args.out}: {len(ids)} tokens, first {ids[:3].tolist()}")


def _surgery(model, expose_inputs: bool, untie: bool):  # noqa: ANN001, ANN202
    """(weights name -> array, layer input per weight, embedding weight name or None); ``model`` changed in place.

    The weights become graph inputs without initializers (every run feeds them; the session holds no copy).
    ``untie``: the tied embedding reads its own input (else the head's, so it always gets the head's codes).
    """
    import onnx
    from cim_int4.exporter.calibration import expose
    from onnx import helper, numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    layers: dict[str, str] = {}
    for n in model.graph.node:
        if n.op_type == "MatMul" and n.input[1] in inits and len(inits[n.input[1]].dims) == 2:
            layers[n.input[1]] = n.input[0]
    weights = {name: numpy_helper.to_array(inits[name]) for name in layers}
    embed = None
    for n in model.graph.node:  # the tied table: Gather(Transpose(head weight)) in the genai builder's export
        if untie and n.op_type == "Transpose" and n.input[0] in layers:
            embed = "cim.sweep.embedding"
            weights[embed] = weights[n.input[0]]
            n.input[0] = embed
    kept = [t for t in model.graph.initializer if t.name not in weights]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    model.graph.input.extend(
        helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, list(w.shape)) for name, w in weights.items()
    )
    if expose_inputs:
        expose(model, dict.fromkeys(layers.values()))
    return weights, layers, embed


def _session(folder: Path, expose_inputs: bool, untie: bool):  # noqa: ANN202
    import onnx
    import onnxruntime as ort

    config = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    model = onnx.load(folder / config["filename"])
    weights, layers, embed = _surgery(model, expose_inputs, untie)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.enable_cpu_mem_arena = False
    session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    del model
    kv = (1, config["num_key_value_heads"], 0, config["head_size"])
    names = [i.name for i in session.get_inputs() if i.name not in weights]

    def feeds(ids: np.ndarray) -> dict[str, np.ndarray]:
        out = {}
        for name in names:
            if name == "input_ids":
                out[name] = ids[None, :]
            elif name == "attention_mask":
                out[name] = np.ones((1, len(ids)), np.int64)
            elif name == "position_ids":
                out[name] = np.arange(len(ids), dtype=np.int64)[None, :]
            else:
                out[name] = np.zeros(kv, np.float32)
        return out

    return session, weights, layers, embed, feeds


def _save(path: Path, q: dict) -> None:
    arrays = {}
    for name, qw in q.items():
        arrays[f"{name}|packed"], arrays[f"{name}|scales"] = qw.packed, qw.scales
        arrays[f"{name}|shape"] = np.array([qw.k, qw.n, qw.group_size])
    np.savez(path, **arrays)


def _load(path: Path) -> dict:
    from cim_int4.exporter.quantize import QuantizedWeight

    data = np.load(path)
    names = {key.split("|")[0] for key in data.files}
    out = {}
    for name in names:
        k, n, g = (int(v) for v in data[f"{name}|shape"])
        out[name] = QuantizedWeight(k, n, g, data[f"{name}|packed"], data[f"{name}|scales"])
    return out


def _window(tokens: np.ndarray, i: int, bos: int | None, size: int = 512) -> np.ndarray:
    """Window ``i`` of ``size`` tokens: ``bos`` (if any) then the next ``size - 1`` (or ``size``) text tokens."""
    span = size - (bos is not None)
    body = tokens[i * span : (i + 1) * span]
    if len(body) < span:
        raise SystemExit(f"only {len(tokens)} tokens: too few for window {i + 1}")
    return body if bos is None else np.concatenate([[bos], body]).astype(np.int64)


def _variant(spec: str) -> dict:
    method, rule, *rest = spec.split(":")
    v = {"spec": spec, "method": method, "rule": rule, "group": 32, "damp": 0.01, "act": 0, "block": 128,
         "tie": "shared", "scales": "float32"}  # fmt: skip
    for item in rest:
        key, value = item.split("=")
        v[key] = value if key in ("tie", "scales") else (float(value) if key == "damp" else int(value))
    return v


def _quantize(v: dict, weights: dict, layers: dict, embed: str | None, stats: dict, like: dict | None) -> dict:
    from cim_int4.exporter.gptq import factor, gptq_quantize
    from cim_int4.exporter.quantize import quantize_weight

    out = {n: like[n] for n in layers} if like is not None else {}
    factors: dict = {}
    for name, x in layers.items():
        if name in out:
            continue
        w = weights[name]
        if v["method"] == "gptq":
            if x not in factors:
                factors.clear()
                factors[x] = factor(stats[x], v["group"], v["damp"], bool(v["act"]))
            out[name] = gptq_quantize(w, factors[x], v["group"], v["rule"], block=v["block"], scale_dtype=v["scales"])
        else:
            out[name] = quantize_weight(w, v["group"], v["rule"], scale_dtype=v["scales"])
    if embed is not None:
        head = next(n for n in layers if weights[n] is weights[embed] or np.shares_memory(weights[n], weights[embed]))
        if v["tie"] == "shared":
            out[embed] = out[head]
        elif v["tie"] == "rtn":
            out[embed] = quantize_weight(weights[head], v["group"], v["rule"], scale_dtype=v["scales"])
    return out


def _sweep(args: argparse.Namespace) -> None:
    from cim_int4.exporter.calibration import collect
    from cim_int4.exporter.probe import WeightFeeding
    from cim_int4.ops.reference import dequantize

    from cim_int4.perplexity import score_window

    folder = Path(args.folder)
    variants = [_variant(s) for s in args.variants]
    untie = any(v["tie"] != "shared" for v in variants)
    session, weights, layers, embed, feeds = _session(folder, expose_inputs=True, untie=untie)
    cache = Path(args.stats) if args.stats else None
    if cache is not None and cache.exists():
        data = np.load(cache)
        stats = {x: data[x] for x in data.files}
        print(f"statistics from {cache}", flush=True)
    else:
        calib = np.load(args.calib)
        batches = [feeds(_window(calib, i, args.bos)) for i in range(args.windows)]
        ks = {x: weights[w].shape[0] for w, x in layers.items()}
        t0 = time.perf_counter()
        cal, _ = collect(WeightFeeding(session, weights), ks, batches)
        stats = {x: s.xtx for x, s in cal.stats.items()}
        print(f"calibration: {args.windows} windows in {time.perf_counter() - t0:.0f} s", flush=True)
        if cache is not None:
            np.savez(cache, **stats)
    quantized: dict[str, dict] = {}
    done: dict[tuple, dict] = {}  # variants differing only in ``tie`` share the layers' codes
    for v in variants:
        t0 = time.perf_counter()
        same = tuple(v[k] for k in ("method", "rule", "group", "damp", "act", "block"))
        cache = Path(args.stats).with_name(f"q-{v['spec'].replace(':', '_')}.npz") if args.stats else None
        if cache is not None and cache.exists():
            quantized[v["spec"]] = _load(cache)
        else:
            quantized[v["spec"]] = _quantize(v, weights, layers, embed, stats, done.get(same))
            if cache is not None:
                _save(cache, quantized[v["spec"]])
        done.setdefault(same, quantized[v["spec"]])
        v["quantize_seconds"] = time.perf_counter() - t0
        print(f"{v['spec']}: quantized in {v['quantize_seconds']:.0f} s", flush=True)
    del stats
    evals = np.load(args.eval)
    rows = {v["spec"]: {"nll": [], "kl": [], "agree": [], "tokens": []} for v in [{"spec": "fp32"}, *variants]}
    for i in range(args.eval_windows):
        ids = _window(evals, i, args.bos)
        targets = ids[1:]
        ref = session.run(["logits"], {**feeds(ids), **weights})[0][0, :-1]
        nll, _, _ = score_window(ref, None, targets)
        r = rows["fp32"]
        r["nll"].append(nll), r["kl"].append(0.0), r["agree"].append(len(targets)), r["tokens"].append(len(targets))
        for v in variants:
            q = quantized[v["spec"]]
            int4 = {n: dequantize(qw.packed, qw.scales, qw.k, qw.group_size).astype(np.float32)
                    for n, qw in q.items() if n in weights}  # fmt: skip
            out = session.run(["logits"], {**feeds(ids), **weights, **int4})[0][0, :-1]
            del int4
            nll, kl, agree = score_window(ref, out, targets)
            r = rows[v["spec"]]
            r["nll"].append(nll), r["kl"].append(kl), r["agree"].append(agree), r["tokens"].append(len(targets))
        print(f"window {i + 1}/{args.eval_windows}", flush=True)
        report = _report(rows, variants)  # rewritten after every window: a cut run still has its figures
        if args.json:
            Path(args.json).write_text(json.dumps({"settings": vars(args), **report}, indent=1, default=str))
    print(report["table"])


def _report(rows: dict, variants: list[dict]) -> dict:
    """Perplexity, gap, KL, top-1 per variant; the gap's standard error from paired per-window differences."""
    tokens = np.asarray(rows["fp32"]["tokens"], float)
    ref_nll = np.asarray(rows["fp32"]["nll"])
    ref_ppl = math.exp(ref_nll.sum() / tokens.sum())
    out, lines = [], [f"{'variant':<36} {'ppl':>8} {'gap':>7} {'+-':>6} {'KL':>7} {'top1':>6}"]
    lines.append(f"{'fp32':<36} {ref_ppl:8.4f}")
    for v in variants:
        r = rows[v["spec"]]
        nll = np.asarray(r["nll"])
        ppl = math.exp(nll.sum() / tokens.sum())
        # Paired: per-window mean NLL difference; its standard error maps to the gap through exp.
        d = (nll - ref_nll) / tokens
        se = float(np.std(d, ddof=1) / math.sqrt(len(d))) * ppl if len(d) > 1 else float("nan")
        row = {**v, "perplexity": ppl, "gap": ppl - ref_ppl, "gap_se": se, "kl": sum(r["kl"]) / tokens.sum(),
               "top1": sum(r["agree"]) / tokens.sum(), "window_nll": r["nll"]}  # fmt: skip
        out.append(row)
        lines.append(f"{v['spec']:<36} {ppl:8.4f} {ppl - ref_ppl:7.4f} {se:6.3f} {row['kl']:7.4f} {row['top1']:6.4f}")
    return {"fp32_perplexity": ref_ppl, "fp32_window_nll": rows["fp32"]["nll"], "tokens": int(tokens.sum()),
            "variants": out, "table": "\n".join(lines)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tokenize")
    t.add_argument("folder")
    t.add_argument("text")
    t.add_argument("out")
    s = sub.add_parser("sweep")
    s.add_argument("folder")
    s.add_argument("--calib")
    s.add_argument("--windows", type=int, default=24)
    s.add_argument("--stats")
    s.add_argument("--eval", required=True)
    s.add_argument("--eval-windows", type=int, default=16)
    s.add_argument("--json")
    s.add_argument("--bos", type=int, default=None, help="token id each window starts with (Gemma 3: 2)")
    s.add_argument("--variants", nargs="+", required=True)
    args = p.parse_args()
    _tokenize(args) if args.cmd == "tokenize" else _sweep(args)


if __name__ == "__main__":
    main()
