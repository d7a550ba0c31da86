"""Does a tied embedding / LM head keep its accuracy at 2 bits if its most frequent tokens' rows keep 3?
(docs/widths.md, "Rows of the tied table by token frequency"). A measurement, not an export: SmolLM2's
tied table alone quantized in PyTorch (round-to-nearest, group 64, the error-minimising clip of 11
tried), every other weight float32, scored on eval text against the float32 model.

    /work/real/venv/bin/python tools/head_rows_split.py [ROOT]     (default /work/real)

ROOT as tools/real_llm_models.py and tools/real_llm_text.py leave it; token frequencies come from
calib.txt, the score (perplexity, KL per token from float32, all tokens of 4 windows of 512) from
eval.txt. Rows kept at 3 bits: the first T token ids ("id": BPE merge order) or the T most frequent
in calib.txt ("freq"), the rest at 2. CPU only, ~10 minutes.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

GROUP = 64
WINDOW, WINDOWS = 512, 4
CLIPS = np.linspace(0.5, 1.0, 11)


def quantize(w: torch.Tensor, bits: int) -> torch.Tensor:
    """Symmetric round-to-nearest per group of GROUP along a row, levels -2^(b-1) .. 2^(b-1) - 1."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // GROUP, GROUP)
    top, bottom = 2 ** (bits - 1) - 1, -(2 ** (bits - 1))
    amax = g.abs().amax(-1, keepdim=True).clamp_min(1e-12)
    best = err = None
    for clip in CLIPS:
        step = amax * clip / (top + 0.5)
        q = (g / step).round().clamp(bottom, top) * step
        e = ((q - g) ** 2).sum(-1, keepdim=True)
        if best is None:
            best, err = q, e
        else:
            better = e < err
            best, err = torch.where(better, q, best), torch.where(better, e, err)
    return best.reshape(rows, cols)


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "/work/real")
    torch.set_num_threads(1)
    hf = root / "smollm2" / "hf"
    tok = AutoTokenizer.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    table = model.get_input_embeddings().weight
    if model.lm_head.weight.data_ptr() != table.data_ptr():
        sys.exit(f"{hf}: the LM head is not tied to the embedding")
    original = table.data.clone()
    evaluation = tok((root / "text" / "eval.txt").read_text())["input_ids"]
    calibration = tok((root / "text" / "calib.txt").read_text())["input_ids"]
    windows = [evaluation[i * WINDOW : (i + 1) * WINDOW] for i in range(WINDOWS)]
    with torch.no_grad():
        reference = [torch.log_softmax(model(torch.tensor([w])).logits[0], -1) for w in windows]

    def score() -> tuple[float, float]:
        nll = kl = 0.0
        count = 0
        with torch.no_grad():
            for w, ref in zip(windows, reference, strict=True):
                lp = torch.log_softmax(model(torch.tensor([w])).logits[0], -1)
                nll -= lp[:-1].gather(1, torch.tensor(w[1:])[:, None]).sum().item()
                kl += (ref.exp() * (ref - lp)).sum(-1)[:-1].sum().item()
                count += len(w) - 1
        return math.exp(nll / count), kl / count

    vocab = original.shape[0]
    frequency = np.bincount(np.array(calibration), minlength=vocab)
    seen = np.bincount(np.array(evaluation), minlength=vocab)
    by_frequency = np.argsort(-frequency, kind="stable")
    three, two = quantize(original, 3), quantize(original, 2)
    print(f"float32: perplexity {score()[0]:.3f}")
    for label, weights in (("every row at 3 bits", three), ("every row at 2 bits", two)):
        table.data.copy_(weights)
        print(f"{label}: perplexity %.3f, KL %.4f" % score())
    for kept in (2048, 4096, 8192):
        for how, rows in (("id", np.arange(kept)), ("freq", by_frequency[:kept])):
            mask = torch.zeros(vocab, 1, dtype=torch.bool)
            mask[torch.from_numpy(rows)] = True
            table.data.copy_(torch.where(mask, three, two))
            ppl, kl = score()
            print(f"{kept} rows by {how} at 3 bits, the rest at 2: perplexity {ppl:.3f}, KL {kl:.4f} "
                  f"(their tokens: {seen[rows].sum() / seen.sum():.1%} of eval.txt's)")  # fmt: skip
    table.data.copy_(original)


if __name__ == "__main__":
    main()
