"""Make the tiny onnxruntime-genai Llama folders in tests/genai (needs torch, transformers, onnxruntime-genai).

    /work/torchenv/bin/python tests/genai/make_models.py

A random-init Llama (2 layers, hidden 64) with a clean 1000-token byte-level BPE tokenizer
trained here on a made-up corpus, saved with ``save_pretrained``, then run through the
genai model builder offline: ``llama-fp32`` (FP32 MatMul) and ``llama-int4`` (MatMulNBits,
4 bits, block 32, the builder's CPU default accuracy_level 4). Deterministic (fixed seeds).
"""

from __future__ import annotations

import argparse
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
VOCAB = 1000
SPECIAL = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: Llama's bos 1 and eos 2


def corpus(lines: int = 4000, seed: int = 0) -> list[str]:
    """Sentences of made-up words, enough for a 1000-token BPE vocabulary."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bdfghjklmnprstvz" for v in "aeiou"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(1500)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) + "." for _ in range(lines)]


def make_checkpoint(out: Path, hidden: int = 64, intermediate: int = 128, layers: int = 2) -> None:
    """Random-init Llama + tokenizer, saved with save_pretrained into ``out``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus(), trainer)
    vocab = tok.get_vocab_size()  # at most VOCAB: the corpus may run out of merges first
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 16,
        num_key_value_heads=hidden // 32,
        max_position_embeddings=256,
        # 0.02 (the default) makes a random model repeat one token; 0.1 gives varied tokens.
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).eval().save_pretrained(out)


def build(src: Path, precision: str, out: Path, cache: Path) -> None:
    """Run the genai model builder on the local checkpoint ``src``."""
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(src), "-o", str(out)]
    cmd += ["-p", precision, "-e", "cpu", "-c", str(cache)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--out", type=Path, default=HERE)
    # Bigger shapes make a model for timing (tokens/s), not for committing.
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--precision", nargs="+", choices=["fp32", "int4"], default=["fp32", "int4"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "checkpoint"
        make_checkpoint(src, args.hidden, args.intermediate, args.layers)
        for precision in args.precision:
            out = args.out / f"llama-{precision}"
            shutil.rmtree(out, ignore_errors=True)
            build(src, precision, out, Path(tmp) / "cache")
            print(f"wrote {out}: {sorted(p.name for p in out.iterdir())}")


if __name__ == "__main__":
    main()
