"""A timing-only copy of a genai folder without its SkipSimplifiedLayerNormalization nodes but the first:
what fusing the norms into the weight ops could save at most (docs/real-llm.md, "the KV cache as genai
binds it"). The outputs are wrong on purpose; only step times mean anything.

    python tools/knockout_norms.py FOLDER OUT
    python tools/step_ab.py --threads 1 2 with=FOLDER without=OUT

Every consumer of a removed norm's output (and of its residual sum) reads the first norm's instead, so
the activations keep a sane scale (feeding the un-normed sums makes them overflow, and non-finite values
take slow paths). Files are copied, not linked: ORT refuses external data behind a link.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import onnx

from cim_int4.genai_bench import decoder_file

NORM = "SkipSimplifiedLayerNormalization"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    if args.out.exists():
        parser.error(f"{args.out} exists; not overwriting it")
    decoder = decoder_file(args.folder)
    shutil.copytree(args.folder, args.out)
    model = onnx.load(decoder, load_external_data=False)
    norms = [n for n in model.graph.node if n.op_type == NORM]
    if len(norms) < 2:
        parser.error(f"{decoder}: {len(norms)} {NORM} node(s); nothing to knock out")
    first = norms[0]
    renamed = {}
    for norm in norms[1:]:
        for i in (0, 3):  # the normed output and the residual sum
            if i < len(norm.output) and norm.output[i]:
                renamed[norm.output[i]] = first.output[i]
    kept = [n for n in model.graph.node if n.op_type != NORM or n is first]
    for node in kept:
        node.input[:] = [renamed.get(name, name) for name in node.input]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    onnx.save(model, args.out / decoder.relative_to(args.folder))
    print(f"{args.out}: {len(norms) - 1} of {len(norms)} {NORM} nodes removed")


if __name__ == "__main__":
    main()
