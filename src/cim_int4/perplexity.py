"""Perplexity, KL divergence and top-1 agreement of causal LMs on a text: ``cim-int4 perplexity``.

``perplexity(REFERENCE, [MODEL, ...], text=FILE)`` tokenizes the text once (the tokenizer of
an onnxruntime-genai folder, or of ``tokenizer=DIR``), cuts the tokens into fixed windows and
runs every model on the same windows with plain ONNX Runtime (our op library registered, so
CimInt4MatMul models run too). A model is an ONNX file with a ``logits`` output
``[batch, sequence, vocab]`` or a genai folder (its decoder); KV-cache inputs are fed empty
(``[batch, kv_heads, 0, head_size]``), ``attention_mask`` all ones, ``position_ids`` 0..n-1.

Windows: the text's tokens (without special tokens) from position 0 in steps of ``stride``,
each ``window`` tokens long including a leading BOS when the tokenizer adds one; the tail
that does not fill a window is dropped. Each window predicts its token j from tokens < j;
a text position is scored once, in the first window where it sits at index >= ``score_from``
(default 1: every token but a window's first; ``window // 2`` scores what llama.cpp's
llama-perplexity scores). Log-softmax in float64. Per model: perplexity ``exp(mean NLL)``,
mean ``KL(reference || model)`` per scored token, and the share of positions whose argmax
equals the reference's. Memory: every session, plus two windows of logits and a float64
chunk of at most ~64 MiB; no logits are kept across windows.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .contract import COMPUTE_MODES
from .exporter import ExportError

GENAI_CONFIG = "genai_config.json"
LOGITS = "logits"
# float64 elements per log-softmax chunk (8 MiB of them = 64 MiB).
CHUNK_ELEMENTS = 1 << 23


class PerplexityError(ExportError):
    """Bad input to the perplexity tool (file, model, tokenizer, window); the message is one line."""


@dataclass(frozen=True)
class Window:
    """One model input: ``ids`` (BOS included when used) and the indices of ``ids`` that are scored."""

    ids: np.ndarray
    first: int  # scored indices: first .. len(ids) - 1


def windows(
    tokens: Sequence[int], window: int, stride: int | None = None, bos: int | None = None, score_from: int = 1
) -> list[Window]:
    """The fixed windows over ``tokens`` (module doc); every model is run on exactly these."""
    if window < 2:
        raise PerplexityError(f"--window must be >= 2 tokens, got {window}")
    span = window - (bos is not None)  # text tokens per window
    if span < 1:
        raise PerplexityError(f"--window {window} leaves no text token after the BOS")
    stride = span if stride is None else stride
    if stride < 1:
        raise PerplexityError(f"--stride must be >= 1, got {stride}")
    if not 1 <= score_from < window:
        raise PerplexityError(f"score_from must be in 1..window-1, got {score_from}")
    ids = np.asarray(tokens, dtype=np.int64)
    out = []
    scored_to = 0  # text positions below this are scored already
    for start in range(0, len(ids) - span + 1, stride):
        body = ids[start : start + span]
        full = np.concatenate([[bos], body]) if bos is not None else body
        offset = window - span  # index in `full` of text position `start`
        first = max(score_from, scored_to - start + offset)
        if first < window:
            out.append(Window(full, first))
            scored_to = start + span
    if not out:
        raise PerplexityError(f"the text has {len(ids)} tokens: too few for one window of {window}")
    return out


# ---------------------------------------------------------------------------------------------
# Tokenizers


def _genai_config(folder: Path) -> dict:
    path = folder / GENAI_CONFIG
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PerplexityError(f"{path}: not readable JSON ({e})") from e


def load_tokenizer(folder: str | os.PathLike) -> tuple[Callable[[str], list[int]], int | None]:
    """(encode, bos) of the tokenizer in ``folder``: a genai folder (onnxruntime-genai) or one with tokenizer.json.

    ``encode`` returns ids without special tokens; ``bos`` is the id the tokenizer puts
    first (None if it adds none): windows start with it, as the model saw in training.
    """
    folder = Path(folder)
    if (folder / GENAI_CONFIG).is_file():
        try:
            import onnxruntime_genai as og
        except ImportError as e:
            raise PerplexityError(
                f"{folder}: tokenizing with a genai folder needs onnxruntime-genai (pip install onnxruntime-genai), "
                "or pass --tokenizer DIR with a tokenizer.json"
            ) from e
        bos_id = _genai_config(folder).get("model", {}).get("bos_token_id")
        try:
            tok = og.Tokenizer(og.Config(str(folder)))  # the tokenizer alone, no weights loaded
        except Exception as e:  # noqa: BLE001 - genai raises plain RuntimeError
            why = " ".join(str(e).split())
            raise PerplexityError(f"{folder}: onnxruntime-genai cannot load its tokenizer ({why})") from e
        probe = [int(t) for t in tok.encode("a")]
        adds_bos = isinstance(bos_id, int) and len(probe) > 1 and probe[0] == bos_id

        def encode(text: str) -> list[int]:
            ids = [int(t) for t in tok.encode(text)]
            return ids[1:] if adds_bos and ids and ids[0] == bos_id else ids

        return encode, bos_id if adds_bos else None
    if (folder / "tokenizer.json").is_file():
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise PerplexityError(f"{folder}: reading tokenizer.json needs the tokenizers package") from e
        hf = Tokenizer.from_file(str(folder / "tokenizer.json"))
        with_special = hf.encode("a", add_special_tokens=True).ids
        without = hf.encode("a", add_special_tokens=False).ids
        bos = with_special[0] if len(with_special) > len(without) and with_special[1:] == without else None
        return (lambda text: hf.encode(text, add_special_tokens=False).ids), bos
    raise PerplexityError(f"{folder}: no tokenizer there (expected {GENAI_CONFIG} or tokenizer.json)")


# ---------------------------------------------------------------------------------------------
# Models


def _is_past(name: str) -> bool:
    return name.startswith("past") or ".past" in name or "past_key" in name or "past_value" in name


@dataclass
class CausalLM:
    """A causal LM run with plain ORT: ``logits(ids)`` -> float32 [len(ids), vocab]."""

    label: str
    path: Path  # the ONNX file
    session: object
    feeds_for: Callable[..., dict]  # (ids, past=0): feeds for ids after `past` cached tokens (zeros)
    context: int | None = None  # the longest sequence the model accepts, when its config says
    # present output -> past input it shares a buffer with, when genai runs it so (its config's
    # search.past_present_share_buffer): op_profile.bind_step binds each pair to one buffer.
    shared_kv: dict[str, str] = field(default_factory=dict)

    def logits(self, ids: np.ndarray) -> np.ndarray:
        out = self.session.run([LOGITS], self.feeds_for(ids))[0]
        if out.ndim != 3 or out.shape[:2] != (1, len(ids)):
            raise PerplexityError(
                f"{self.label}: output {LOGITS!r} has shape {list(out.shape)}, expected [1, {len(ids)}, vocab]"
            )
        return out[0]


_NP_TYPES = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32,
             "tensor(float16)": np.float16}


def open_model(
    source: str | os.PathLike,
    threads: int | None = None,
    compute: str | None = None,
    label: str | None = None,
    profile_prefix: str | None = None,
) -> CausalLM:
    """Load an ONNX causal LM or a genai folder's decoder into an ORT session that can run CimInt4MatMul.

    ``profile_prefix``: turn on ORT's profiler, its JSON written at ``session.end_profiling()`` (op_profile.py).
    """
    import onnxruntime as ort

    from .ops import session_options

    src = Path(source)
    label = label or str(source)
    kv_dims: dict[str, int] = {}
    context = None
    shares_kv: dict | None = None  # the genai decoder config, when it shares past and present buffers
    if src.is_dir() and not (src / GENAI_CONFIG).is_file():
        raise PerplexityError(f"{src}: a folder without {GENAI_CONFIG} (expected an .onnx file or a genai folder)")
    # A file inside a genai folder takes its KV shapes and context length from the folder's config.
    folder = src if src.is_dir() else src.parent
    path = src
    if (folder / GENAI_CONFIG).is_file():
        config = _genai_config(folder)
        model_cfg = config.get("model", {})
        decoder = model_cfg.get("decoder", {})
        if src.is_dir():
            if not isinstance(decoder.get("filename"), str):
                raise PerplexityError(f"{src / GENAI_CONFIG}: no model.decoder.filename")
            path = src / decoder["filename"]
        for key in ("num_key_value_heads", "head_size"):
            if isinstance(decoder.get(key), int):
                kv_dims[key] = decoder[key]
        context = model_cfg.get("context_length") if isinstance(model_cfg.get("context_length"), int) else None
        if config.get("search", {}).get("past_present_share_buffer") is True and path.name == decoder.get("filename"):
            shares_kv = decoder
    if not path.is_file():
        raise PerplexityError(f"{path}: no such model file")
    try:
        so = session_options(threads, pin=False, compute=compute)
        # No arena: each session would keep its peak activations (a window of logits, 0.5 GB
        # for a 262k vocabulary) between runs, and a call holds several sessions.
        so.enable_cpu_mem_arena = False
        if profile_prefix is not None:
            so.enable_profiling = True
            so.profile_file_prefix = profile_prefix
        session = ort.InferenceSession(os.fspath(path), sess_options=so, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - ORT's load errors are plain exceptions; say which file
        raise PerplexityError(f"{path}: onnxruntime cannot load it ({' '.join(str(e).split())[:300]})") from e
    if LOGITS not in [o.name for o in session.get_outputs()]:
        names = ", ".join(o.name for o in session.get_outputs())
        raise PerplexityError(f"{path}: no {LOGITS!r} output (outputs: {names}); not a causal LM this tool can score")

    makers: list[Callable[[np.ndarray], tuple[str, np.ndarray]]] = []
    for inp in session.get_inputs():
        dtype = _NP_TYPES.get(inp.type)
        name = inp.name
        if dtype is None:
            raise PerplexityError(f"{path}: input {name!r} has type {inp.type}, which the tool cannot feed")
        if name == "input_ids":
            makers.append(lambda ids, past, n=name, t=dtype: (n, ids[None, :].astype(t)))
        elif name == "attention_mask":
            makers.append(lambda ids, past, n=name, t=dtype: (n, np.ones((1, past + len(ids)), dtype=t)))
        elif name == "position_ids":
            makers.append(lambda ids, past, n=name, t=dtype: (n, np.arange(past, past + len(ids), dtype=t)[None, :]))
        elif _is_past(name):
            shape = _empty_past_shape(path, name, inp.shape, kv_dims)
            makers.append(
                lambda ids, past, n=name, t=dtype, s=shape: (n, np.zeros((*s[:2], past, s[3]), dtype=t))
            )
        else:
            raise PerplexityError(
                f"{path}: input {name!r} is none of input_ids, attention_mask, position_ids, past key/values"
            )
    if not any(i.name == "input_ids" for i in session.get_inputs()):
        raise PerplexityError(f"{path}: no 'input_ids' input")

    def feeds_for(ids: np.ndarray, past: int = 0) -> dict:
        return dict(make(ids, past) for make in makers)

    shared = _shared_kv(session, shares_kv) if shares_kv is not None else {}
    return CausalLM(label, path, session, feeds_for, context, shared)


def _shared_kv(session, decoder: dict) -> dict[str, str]:
    """present output -> past input per layer, from a genai decoder config's name patterns (genai's
    defaults where it gives none); empty unless every pair names an output and an input the session has."""
    layers = decoder.get("num_hidden_layers")
    if not isinstance(layers, int) or layers < 1:
        return {}
    have_in = {i.name for i in session.get_inputs()}
    have_out = {o.name for o in session.get_outputs()}
    pairs = {}
    for kind in ("key", "value"):
        past = decoder.get("inputs", {}).get(f"past_{kind}_names", f"past_key_values.%d.{kind}")
        present = decoder.get("outputs", {}).get(f"present_{kind}_names", f"present.%d.{kind}")
        if not (isinstance(past, str) and isinstance(present, str) and "%d" in past and "%d" in present):
            return {}
        for layer in range(layers):
            if present % layer not in have_out or past % layer not in have_in:
                return {}
            pairs[present % layer] = past % layer
    return pairs


def _empty_past_shape(path: Path, name: str, shape: list, kv_dims: dict[str, int]) -> tuple[int, ...]:
    """[batch=1, kv_heads, 0, head_size] for a past key/value input: its static dims, else the genai config's."""
    if len(shape) != 4:
        raise PerplexityError(f"{path}: past input {name!r} has rank {len(shape)}, expected 4")
    heads = shape[1] if isinstance(shape[1], int) else kv_dims.get("num_key_value_heads")
    size = shape[3] if isinstance(shape[3], int) else kv_dims.get("head_size")
    if heads is None or size is None:
        raise PerplexityError(
            f"{path}: past input {name!r} has symbolic heads/head size {shape}, and no {GENAI_CONFIG} beside it"
        )
    return (1, heads, 0, size)


# ---------------------------------------------------------------------------------------------
# Statistics


@dataclass
class Score:
    """Running sums for one model over the scored tokens."""

    label: str
    path: str
    nll: float = 0.0
    kl: float = 0.0
    agree: int = 0
    tokens: int = 0
    seconds: float = 0.0
    window_nll: list[float] = field(default_factory=list)  # mean NLL per window (for spread)

    def row(self, reference_ppl: float | None) -> dict:
        ppl = math.exp(self.nll / self.tokens) if self.tokens else float("nan")
        row = {
            "model": self.label,
            "path": self.path,
            "perplexity": ppl,
            "nll": self.nll / self.tokens if self.tokens else float("nan"),
            "kl": self.kl / self.tokens if self.tokens else float("nan"),
            "top1_agreement": self.agree / self.tokens if self.tokens else float("nan"),
            "tokens": self.tokens,
            "seconds": self.seconds,
        }
        if reference_ppl is not None:
            row["gap"] = ppl - reference_ppl
        return row


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x


def score_window(
    ref_logits: np.ndarray, logits: np.ndarray | None, targets: np.ndarray
) -> tuple[float, float, int]:
    """(sum NLL, sum KL(ref || model), top-1 agreements) over rows of [n, vocab] logits predicting ``targets``.

    ``logits`` None scores the reference itself (KL 0, agreement n).
    """
    n, vocab = ref_logits.shape
    rows = max(1, CHUNK_ELEMENTS // max(1, vocab))
    nll = kl = 0.0
    agree = 0
    for s in range(0, n, rows):
        e = min(n, s + rows)
        lr = _log_softmax(ref_logits[s:e])
        if logits is None:
            nll -= float(lr[np.arange(e - s), targets[s:e]].sum())
            agree += e - s
            continue
        lm = _log_softmax(logits[s:e])
        nll -= float(lm[np.arange(e - s), targets[s:e]].sum())
        kl += float((np.exp(lr) * (lr - lm)).sum())
        agree += int((ref_logits[s:e].argmax(axis=-1) == logits[s:e].argmax(axis=-1)).sum())
    return nll, kl, agree


@dataclass
class PerplexityReport:
    """Per-model rows (the reference first) and the settings they were measured with."""

    rows: list[dict]
    settings: dict

    def to_json(self) -> dict:
        return {"settings": self.settings, "models": self.rows}

    def format_table(self) -> str:
        head = f"{'model':<40} {'perplexity':>11} {'gap':>9} {'KL/token':>10} {'top-1 agree':>11} {'tokens':>7}"
        lines = [head, "-" * len(head)]
        for r in self.rows:
            label = r["model"] if len(r["model"]) <= 40 else "..." + r["model"][-37:]
            lines.append(
                f"{label:<40} {r['perplexity']:>11.4f} {r.get('gap', 0.0):>+9.4f} {r['kl']:>10.5f} "
                f"{r['top1_agreement']:>11.4f} {r['tokens']:>7d}"
            )
        s = self.settings
        lines.append(
            f"{s['windows']} windows of {s['window']} tokens (stride {s['stride']}, scored from index "
            f"{s['score_from']}, BOS {s['bos']}), {s['text_tokens']} text tokens of {s['text']}"
        )
        return "\n".join(lines)


def evaluate(
    reference: CausalLM,
    models: Sequence[CausalLM],
    wins: Sequence[Window],
    progress: bool = True,
) -> list[Score]:
    """Run every model on every window; return one Score per model, the reference's first."""
    from tqdm import tqdm

    for m in (reference, *models):
        if m.context is not None and len(wins[0].ids) > m.context:
            raise PerplexityError(
                f"{m.label}: window of {len(wins[0].ids)} tokens exceeds its context length {m.context}"
            )
    scores = [Score(m.label, str(m.path)) for m in (reference, *models)]
    bar = tqdm(wins, desc="perplexity", unit="window", disable=not progress, leave=False)
    for w in bar:
        targets = w.ids[w.first :]
        t0 = time.perf_counter()
        ref = reference.logits(w.ids)[w.first - 1 : -1]
        scores[0].seconds += time.perf_counter() - t0
        _add(scores[0], score_window(ref, None, targets), len(targets))
        for m, sc in zip(models, scores[1:], strict=True):
            t0 = time.perf_counter()
            out = m.logits(w.ids)
            sc.seconds += time.perf_counter() - t0
            if out.shape[-1] != ref.shape[-1]:
                raise PerplexityError(
                    f"{m.label}: vocabulary {out.shape[-1]} differs from the reference's {ref.shape[-1]}"
                )
            _add(sc, score_window(ref, out[w.first - 1 : -1], targets), len(targets))
            del out
    return scores


def _add(score: Score, sums: tuple[float, float, int], n: int) -> None:
    nll, kl, agree = sums
    score.nll += nll
    score.kl += kl
    score.agree += agree
    score.tokens += n
    score.window_nll.append(nll / n)


def perplexity(
    reference: str | os.PathLike,
    models: Sequence[str | os.PathLike] = (),
    *,
    text: str | os.PathLike,
    window: int = 512,
    stride: int | None = None,
    score_from: int = 1,
    tokenizer: str | os.PathLike | None = None,
    threads: int | None = None,
    compute: str | None = None,
    max_tokens: int | None = None,
    bos: int | str | None = "auto",
    progress: bool = True,
) -> PerplexityReport:
    """Perplexity, KL(reference || model) and top-1 agreement of ``models`` vs ``reference`` on the text file ``text``.

    Models are ONNX files with a ``logits`` output or onnxruntime-genai folders; the tokenizer is
    ``tokenizer`` (a genai folder or a folder with tokenizer.json), else the first genai folder
    among the models. ``compute`` ("fp32"/"int8") runs every CimInt4MatMul in that mode;
    ``max_tokens`` keeps the text's first N tokens. ``bos``: the id each window starts with;
    "auto" (default) the one the tokenizer adds, None none. See the module doc for the windows.
    """
    text_path = Path(text)
    try:
        content = text_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PerplexityError(f"{text_path}: cannot read the text ({getattr(e, 'strerror', None) or e})") from e
    sources = [Path(reference), *map(Path, models)]
    for src in sources:
        if not src.exists():
            raise PerplexityError(f"{src}: no such model file or folder")
    genai_folders = (s for s in sources if (s / GENAI_CONFIG).is_file())
    tok_dir = Path(tokenizer) if tokenizer is not None else next(genai_folders, None)
    if tok_dir is None:
        raise PerplexityError("no tokenizer: pass --tokenizer DIR (a genai folder or one with tokenizer.json)")
    if max_tokens is not None and max_tokens < 1:
        raise PerplexityError(f"--max-tokens must be >= 1, got {max_tokens}")
    encode, tokenizer_bos = load_tokenizer(tok_dir)
    if bos == "auto":
        bos = tokenizer_bos
    elif bos is not None and (isinstance(bos, bool) or not isinstance(bos, int) or bos < 0):
        raise PerplexityError(f"bos must be 'auto', None or a token id >= 0, got {bos!r}")
    tokens = encode(content)
    if max_tokens is not None:
        tokens = tokens[:max_tokens]
    wins = windows(tokens, window, stride, bos, score_from)
    ref = open_model(reference, threads, compute)
    others = [open_model(m, threads, compute) for m in models]
    scores = evaluate(ref, others, wins, progress)
    ref_ppl = math.exp(scores[0].nll / scores[0].tokens)
    rows = [s.row(ref_ppl) for s in scores]
    for s, r in zip(scores, rows, strict=True):
        r["window_nll_std"] = float(np.std(s.window_nll))
        r["window_nll"] = [float(v) for v in s.window_nll]  # paired across models: for bootstrap spreads
    settings = {
        "text": str(text_path),
        "text_tokens": len(tokens),
        "window": window,
        "stride": stride if stride is not None else window - (bos is not None),
        "score_from": score_from,
        "bos": bos,
        "windows": len(wins),
        "scored_tokens": scores[0].tokens,
        "tokenizer": str(tok_dir),
        "threads": threads,
        "compute": compute,
    }
    return PerplexityReport(rows, settings)


def _positive(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _bos(text: str) -> int | str | None:
    import argparse

    if text in ("auto", "none"):
        return None if text == "none" else text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected auto, none or a token id, got {text!r}")
    return int(text)


def add_arguments(p) -> None:
    """The arguments of ``cim-int4 perplexity`` on the argparse parser ``p``."""
    p.add_argument("reference", help="the reference (FP32) model: .onnx file with a 'logits' output, or genai folder")
    p.add_argument("models", nargs="*", metavar="MODEL", help="models to compare with it (same kinds)")
    p.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text to score")
    p.add_argument("--window", type=_positive, default=512, help="tokens per window, BOS included (default 512)")
    p.add_argument(
        "--stride", type=_positive, default=None, help="tokens between window starts (default: a window's text tokens)"
    )
    p.add_argument(
        "--score-from",
        type=_positive,
        default=1,
        metavar="J",
        help="score a window's tokens from index J on (default 1; window/2 scores what llama-perplexity scores)",
    )
    p.add_argument(
        "--tokenizer", metavar="DIR", help="genai folder or folder with tokenizer.json (default: the first genai model)"
    )
    p.add_argument("--threads", type=_positive, default=None, help="intra-op threads (default: one per physical core)")
    p.add_argument("--compute", choices=COMPUTE_MODES, default=None, help="run every CimInt4MatMul in this mode")
    p.add_argument("--max-tokens", type=_positive, default=None, metavar="N", help="use the text's first N tokens")
    p.add_argument(
        "--bos",
        type=_bos,
        default="auto",
        metavar="auto|none|ID",
        help="token each window starts with (default auto: the tokenizer's BOS if it adds one)",
    )
    p.add_argument("--json", metavar="OUT.json", help="also write the results as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def run(args) -> int:
    """``cim-int4 perplexity``: measure, print the table, write the JSON if asked; the exit code."""
    from .report import write_json

    report = perplexity(
        args.reference,
        args.models,
        text=args.text,
        window=args.window,
        stride=args.stride,
        score_from=args.score_from,
        tokenizer=args.tokenizer,
        threads=args.threads,
        compute=args.compute,
        max_tokens=args.max_tokens,
        bos=args.bos,
        progress=not args.quiet,
    )
    print(report.format_table())
    if args.json:
        write_json(report.to_json(), args.json)
        print(f"cim-int4: wrote {args.json}")
    return 0


__all__ = [
    "CausalLM",
    "PerplexityError",
    "PerplexityReport",
    "add_arguments",
    "Window",
    "evaluate",
    "load_tokenizer",
    "open_model",
    "perplexity",
    "score_window",
    "run",
    "windows",
]
