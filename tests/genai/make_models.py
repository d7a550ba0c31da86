"""Make the tiny onnxruntime-genai Llama folders in tests/genai (needs torch, transformers, onnxruntime-genai).

    /work/torchenv/bin/python tests/genai/make_models.py

A random-init Llama (2 layers, hidden 64) with a clean 1000-token byte-level BPE tokenizer
trained here on a made-up corpus, saved with ``save_pretrained``, then run through the
genai model builder offline: ``llama-fp32`` (FP32 MatMul) and ``llama-int4`` (MatMulNBits,
4 bits, block 32, the builder's CPU default accuracy_level 4). Deterministic (fixed seeds).

``--size tinyllama`` makes a TinyLlama-1.1B-shaped model for timing (not for committing):
hidden 2048, intermediate 5632, 22 layers, 32 heads, 4 KV heads, a 32000-token vocabulary,
2048 positions; ``--tied`` ties the LM head to the token embedding (folders ``llama-tied-*``:
the builder's int4 then reads one tensor from GatherBlockQuantized and MatMulNBits);
``--accuracy-level 0 4`` builds one int4 folder per level
(``llama-int4-acc0``, ``llama-int4-acc4``); ``--checkpoint DIR`` keeps the checkpoint
(and reuses it on the next run).
"""

from __future__ import annotations

import argparse
import random
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
VOCAB = 1000
SPECIAL = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: Llama's bos 1 and eos 2


@dataclass(frozen=True)
class Size:
    """The shapes of one random-init Llama and of the corpus its tokenizer is trained on."""

    hidden: int = 64
    intermediate: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    vocab: int = VOCAB
    positions: int = 256
    words: int = 1500  # distinct made-up words: a bigger vocabulary needs more of them to merge
    lines: int = 4000


SIZES = {
    "tiny": Size(),
    # TinyLlama-1.1B's shapes; 40000 words x 60000 lines give the BPE trainer merges for 32000 tokens.
    "tinyllama": Size(2048, 5632, 22, 32, 4, 32000, 2048, words=40000, lines=60000),
}


def corpus(lines: int = 4000, seed: int = 0, words: int = 1500) -> list[str]:
    """Sentences of made-up words, enough for a 1000-token BPE vocabulary (more ``words`` for more)."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bdfghjklmnprstvz" for v in "aeiou"]
    vocab = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(words)]
    return [" ".join(rng.choice(vocab) for _ in range(rng.randint(4, 12))) + "." for _ in range(lines)]


def make_checkpoint(out: Path, size: Size = SIZES["tiny"], tied: bool = False) -> None:
    """Random-init Llama + tokenizer of ``size``, saved with save_pretrained into ``out``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size.vocab, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus(size.lines, words=size.words), trainer)
    vocab = tok.get_vocab_size()  # at most size.vocab: the corpus may run out of merges first
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        max_position_embeddings=size.positions,
        # 0.02 (the default) makes a random model repeat one token; 0.1 gives varied tokens.
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=tied,
    )
    LlamaForCausalLM(config).eval().save_pretrained(out)


def build(src: Path, precision: str, out: Path, cache: Path, accuracy_level: int | None = None) -> None:
    """Run the genai model builder on the local checkpoint ``src`` (int4: ``accuracy_level``, else its default)."""
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(src), "-o", str(out)]
    cmd += ["-p", precision, "-e", "cpu", "-c", str(cache)]
    if accuracy_level is not None:
        cmd += ["--extra_options", f"accuracy_level={accuracy_level}"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--out", type=Path, default=HERE)
    # Bigger shapes make a model for timing (tokens/s), not for committing.
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--hidden", type=int, help="override the size's hidden (heads = hidden/16, KV heads = /32)")
    parser.add_argument("--intermediate", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--precision", nargs="+", choices=["fp32", "int4"], default=["fp32", "int4"])
    parser.add_argument("--accuracy-level", type=int, nargs="+", help="int4 folders llama-int4-accN, one per level")
    parser.add_argument("--tied", action="store_true", help="tie the LM head to the embedding (llama-tied-* folders)")
    parser.add_argument("--checkpoint", type=Path, help="keep the checkpoint here; reused if it has a config.json")
    args = parser.parse_args()
    size = SIZES[args.size]
    if args.hidden:
        size = replace(size, hidden=args.hidden, heads=args.hidden // 16, kv_heads=args.hidden // 32)
    size = replace(size, intermediate=args.intermediate or size.intermediate, layers=args.layers or size.layers)
    with tempfile.TemporaryDirectory() as tmp:
        src = args.checkpoint or Path(tmp) / "checkpoint"
        if not (src / "config.json").is_file():
            make_checkpoint(src, size, args.tied)
        stem = "llama-tied" if args.tied else "llama"
        builds = [(p, None, f"{stem}-{p}") for p in args.precision if p != "int4" or not args.accuracy_level]
        if "int4" in args.precision:
            builds += [("int4", level, f"{stem}-int4-acc{level}") for level in args.accuracy_level or []]
        for precision, level, name in builds:
            out = args.out / name
            shutil.rmtree(out, ignore_errors=True)
            build(src, precision, out, Path(tmp) / "cache", level)
            print(f"wrote {out}: {sorted(p.name for p in out.iterdir())}")


if __name__ == "__main__":
    main()
