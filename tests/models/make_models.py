"""Make the small random-init transformer models of tests/models (run with a torch + transformers venv).

    /work/torchenv/bin/python tests/models/make_models.py [--out tests/models]

Each model is a Hugging Face architecture at a tiny size (hidden 128, 2 layers, a few MB),
initialised at random by its own ``_init_weights`` (seeded), exported by ``torch.onnx``
(TorchScript exporter, opset 17) with fixed input shapes. Beside ``<name>.onnx`` goes
``<name>.npz``: a batch of 4 inputs drawn like real ones (token ids within the vocabulary,
an all-ones attention mask, Gaussian pixels), keyed by input name (``cim-int4 export --feeds``). The
accuracy table of docs/accuracy.md and tests/test_accuracy.py use them; torch is not needed there.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import transformers as tf

VOCAB = 512
BATCH, SEQ = 4, 16


class _FirstOutput(torch.nn.Module):
    """Wrap a model so that it returns only its main output tensor (logits or hidden states)."""

    def __init__(self, model: torch.nn.Module, input_names: list[str]) -> None:
        super().__init__()
        self.model = model
        self.input_names = input_names

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.model(**dict(zip(self.input_names, args, strict=True)), return_dict=False)[0]


def _text_inputs(rng: np.random.Generator, names: list[str]) -> dict[str, np.ndarray]:
    feeds = {}
    for name in names:
        if name == "attention_mask":
            feeds[name] = np.ones((BATCH, SEQ), dtype=np.int64)
        else:
            feeds[name] = rng.integers(0, VOCAB, size=(BATCH, SEQ), dtype=np.int64)
    return feeds


def _pixels(rng: np.random.Generator, names: list[str]) -> dict[str, np.ndarray]:
    return {names[0]: rng.standard_normal((BATCH, 3, 32, 32)).astype(np.float32)}


SMALL = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4)

# name -> (model factory, input names in forward order, input maker)
MODELS: dict[str, tuple[Callable[[], torch.nn.Module], list[str], Callable]] = {
    "llama": (
        lambda: tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=VOCAB, num_key_value_heads=2, use_cache=False, **SMALL)),
        ["input_ids", "attention_mask"],
        _text_inputs,
    ),
    "qwen2": (
        lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(vocab_size=VOCAB, num_key_value_heads=2, use_cache=False, **SMALL)),
        ["input_ids", "attention_mask"],
        _text_inputs,
    ),
    "gpt2": (
        lambda: tf.GPT2LMHeadModel(
            tf.GPT2Config(
                vocab_size=VOCAB,
                n_embd=128,
                n_layer=2,
                n_head=4,
                n_positions=64,
                use_cache=False,
                bos_token_id=0,
                eos_token_id=0,
            )
        ),
        ["input_ids", "attention_mask"],
        _text_inputs,
    ),
    "bert": (
        lambda: tf.BertModel(tf.BertConfig(vocab_size=VOCAB, max_position_embeddings=64, **SMALL)),
        ["input_ids", "attention_mask"],
        _text_inputs,
    ),
    "t5": (
        lambda: tf.T5ForConditionalGeneration(
            tf.T5Config(vocab_size=VOCAB, d_model=128, d_kv=32, d_ff=384, num_layers=2, num_heads=4, use_cache=False)
        ),
        ["input_ids", "attention_mask", "decoder_input_ids"],
        _text_inputs,
    ),
    "vit": (
        lambda: tf.ViTModel(tf.ViTConfig(image_size=32, patch_size=4, add_pooling_layer=False, **SMALL)),
        ["pixel_values"],
        _pixels,
    ),
}


def make(name: str, out: Path, seed: int = 0) -> None:
    """Export model ``name`` to ``out/<name>.onnx`` and its inputs to ``out/<name>.npz``."""
    factory, inputs, make_inputs = MODELS[name]
    torch.manual_seed(seed)
    model = _FirstOutput(factory().eval(), inputs)
    rng = np.random.default_rng(seed)
    feeds = make_inputs(rng, inputs)
    args = tuple(torch.from_numpy(feeds[n]) for n in inputs)
    path = out / f"{name}.onnx"
    with torch.no_grad():
        torch.onnx.export(
            model, args, str(path), input_names=inputs, output_names=["output"], opset_version=17, dynamo=False
        )
    np.savez(out / f"{name}.npz", **feeds)
    print(f"{path}: {path.stat().st_size / 1e6:.2f} MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    parser.add_argument("names", nargs="*", default=list(MODELS))
    args = parser.parse_args()
    for name in args.names:
        make(name, args.out)


if __name__ == "__main__":
    main()
