"""Make the zoo: tiny random-init transformers models exported to ONNX by torch, as third parties export them.

Needs torch and transformers (not in the test extra; CI only reads the committed files):
    /work/torchenv/bin/python tests/zoo/make_zoo.py [NAME ...]
Writes tests/zoo/<name>.onnx (one file each, weights inside) and tests/zoo/zoo.json (what each
model takes as input). The models are random-init and seeded, so a rerun writes the same
weights; the graphs follow the installed torch/transformers versions, recorded in zoo.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
VOCAB = 256  # small enough that a model stays a few hundred KB; embeddings are not quantized anyway
SEQ = 8
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}


def _llama():  # noqa: ANN202 - torch types are not importable in CI
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, num_key_value_heads=2, max_position_embeddings=64, **TINY))


def _qwen2():  # noqa: ANN202
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, **TINY
    )
    return Qwen2ForCausalLM(config)


def _gpt2():  # noqa: ANN202
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_inner=128, n_layer=2, n_head=4))


def _bert():  # noqa: ANN202
    from transformers import BertConfig, BertModel

    return BertModel(BertConfig(vocab_size=VOCAB, max_position_embeddings=64, **TINY), add_pooling_layer=False)


def _bart():  # noqa: ANN202
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
    )
    return BartForConditionalGeneration(config)


def _cond():  # noqa: ANN202
    """torch.cond: the dynamo exporter writes an If whose branches hold Gemms on outer-scope weights."""
    import torch

    class Branches(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(64, 64)
            self.b = torch.nn.Linear(64, 64, bias=False)

        def forward(self, x):  # noqa: ANN001, ANN202
            return torch.cond(x.sum() > 0, lambda x: self.a(x), lambda x: self.b(torch.relu(x)), (x,))

    return Branches()


# name -> (model builder, family kind, exporter, fp16, keep_initializers_as_inputs)
MODELS: dict[str, tuple[Callable, str, str, bool, bool]] = {
    "llama_legacy": (_llama, "causal", "legacy", False, False),
    "llama_dynamo": (_llama, "causal", "dynamo", False, False),
    "llama_dynamo_fp16": (_llama, "causal", "dynamo", True, False),
    "llama_legacy_fp16": (_llama, "causal", "legacy", True, False),
    "qwen2_tied_dynamo": (_qwen2, "causal", "dynamo", False, False),
    "gpt2_legacy": (_gpt2, "causal", "legacy", False, False),
    "bert_legacy_inputs": (_bert, "encoder", "legacy", False, True),
    "bart_legacy": (_bart, "seq2seq", "legacy", False, False),
    "cond_dynamo": (_cond, "cond", "dynamo", False, False),
}


def _wrapper(model, kind: str):  # noqa: ANN001, ANN202
    import torch

    class Logits(torch.nn.Module):
        """Only the logits (or hidden states), no cache: one tensor out."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):  # noqa: ANN001, ANN202
            if kind == "seq2seq":
                out = self.model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=input_ids)
                return out.logits
            if kind == "encoder":
                return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            positions = torch.arange(input_ids.shape[1]).unsqueeze(0)
            return self.model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False
            ).logits

    return Logits().eval()


def all_graphs(graph):  # noqa: ANN001, ANN201 - cim_int4 is not installed in the torch venv
    """``graph`` and its subgraphs."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            for body in [attr.g] if attr.HasField("g") else list(attr.graphs):
                yield from all_graphs(body)


def make(name: str) -> dict:
    """Export model ``name`` to tests/zoo/<name>.onnx; returns its zoo.json entry."""
    import torch

    build, kind, exporter, fp16, inputs_too = MODELS[name]
    torch.manual_seed(0)
    model = build()
    path = HERE / f"{name}.onnx"
    if kind == "cond":
        program = torch.onnx.export(model.eval(), (torch.randn(2, 64),), dynamo=True, input_names=["x"])
        program.save(str(path), external_data=False)
        return _tidy(path, kind, exporter, fp16)
    model.config._attn_implementation = "eager"  # sdpa/flex masks use ops the legacy exporter lacks
    model = _wrapper(model.half() if fp16 else model.float(), kind)
    ids = torch.randint(0, VOCAB, (1, SEQ))
    mask = torch.ones(1, SEQ, dtype=torch.int64)
    names = {"input_names": ["input_ids", "attention_mask"], "output_names": ["output"]}
    with torch.no_grad():
        if exporter == "legacy":
            torch.onnx.export(
                model,
                (ids, mask),
                str(path),
                dynamo=False,
                opset_version=17,
                dynamic_axes={"input_ids": {1: "seq"}, "attention_mask": {1: "seq"}},
                keep_initializers_as_inputs=inputs_too,
                **names,
            )
        else:
            seq = torch.export.Dim("seq", min=2, max=64)
            program = torch.onnx.export(model, (ids, mask), dynamo=True, dynamic_shapes=({1: seq}, {1: seq}), **names)
            program.save(str(path), external_data=False)
    return _tidy(path, kind, exporter, fp16)


def _tidy(path: Path, kind: str, exporter: str, fp16: bool) -> dict:
    """Strip the exported file of what only adds bytes, check it; its zoo.json entry."""
    import onnx

    exported = onnx.load(str(path))
    for graph in all_graphs(exported.graph):
        for node in graph.node:  # the dynamo exporter's per-node stack traces: a third of the file
            node.ClearField("metadata_props")
            node.doc_string = ""
    onnx.save(exported, str(path))
    onnx.checker.check_model(str(path))
    return {"kind": kind, "exporter": exporter, "fp16": fp16, "vocab": VOCAB, "bytes": path.stat().st_size}


def main(argv: list[str] | None = None) -> int:
    """Make the named zoo models (all by default) and update zoo.json."""
    import torch
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"models to make (default: all): {', '.join(MODELS)}")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; known: {', '.join(MODELS)}")
    index_path = HERE / "zoo.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else {"models": {}}
    index["made_with"] = {"torch": torch.__version__, "transformers": transformers.__version__}
    for name in args.names or list(MODELS):
        try:
            index["models"][name] = make(name)
        except Exception as e:  # noqa: BLE001 - one model that does not export must not stop the others
            print(f"make_zoo: {name}: not exported ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
            continue
        print(f"make_zoo: {name}: {index['models'][name]['bytes']:,} bytes")
    index["models"] = dict(sorted(index["models"].items()))
    index_path.write_text(json.dumps(index, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
