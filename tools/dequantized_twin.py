"""The dequantized-FP32 twin of an exported model: every CimInt4MatMul / CimInt4Gather back to MatMul / Gather.

    python tools/dequantized_twin.py EXPORTED.onnx OUT.onnx

A command around ``cim_int4.exporter.tune.twin`` (scale tuning runs the twin too): each node's
weight is ``reference.dequantize`` of its codes and scales, so the twin computes what the op's fp32
compute mode computes, up to summation order, in plain ONNX Runtime: the accuracy of widths whose
kernels are not in the op library yet can be measured (``cim-int4 perplexity`` on a genai folder
holding the twin). A genai folder's side files (genai_config.json, tokenizer) are copied next to OUT.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import onnx
from cim_int4.exporter.tune.twin import twin

SIDE_FILES = ("genai_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "chat_template.jinja", "tokenizer.model")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("output")
    args = parser.parse_args()
    src, out = Path(args.model), Path(args.output)
    model = twin(onnx.load(src))
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, out, save_as_external_data=True, location=out.name + ".data")
    for name in SIDE_FILES:
        if (src.parent / name).exists() and src.parent != out.parent:
            shutil.copy(src.parent / name, out.parent / name)


if __name__ == "__main__":
    main()
