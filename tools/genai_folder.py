"""An onnxruntime-genai folder from an export folder of tools/widths_real_llm.py (model + genai config + tokenizer).

    python tools/genai_folder.py EXPORT_DIR OUT_DIR [--compute int8]

Copies EXPORT_DIR to OUT_DIR (which must not exist), sets every CimInt4MatMul node's ``compute``
attribute (the decode speed of a calibrated or mixed-width export is measured in the mode
``cim-int4 genai`` gives an export from FP32, int8), copies the op library in and names it in
genai_config.json, as ``cim-int4 genai`` does. The weights' external data file is copied as is.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import onnx
from cim_int4.ops.library import LIBRARY_NAME, library_path
from onnx import helper

from cim_int4.contract import ATTR_COMPUTE, COMPUTE_MODES, is_op_node
from cim_int4.genai import CONFIG_NAME, OPTION


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--compute", default="int8", choices=COMPUTE_MODES)
    args = parser.parse_args()
    if args.out_dir.exists():
        raise SystemExit(f"{args.out_dir}: already exists")
    config = json.loads((args.export_dir / CONFIG_NAME).read_text())
    decoder = config["model"]["decoder"]
    shutil.copytree(args.export_dir, args.out_dir)
    path = args.out_dir / decoder["filename"]
    model = onnx.load(path, load_external_data=False)
    changed = 0
    for node in model.graph.node:
        if is_op_node(node):
            kept = [a for a in node.attribute if a.name != ATTR_COMPUTE]
            del node.attribute[:]
            node.attribute.extend([*kept, helper.make_attribute(ATTR_COMPUTE, args.compute)])
            changed += 1
    onnx.save(model, path)
    decoder.setdefault("session_options", {})[OPTION] = LIBRARY_NAME
    shutil.copyfile(library_path(), args.out_dir / LIBRARY_NAME)
    (args.out_dir / CONFIG_NAME).write_text(json.dumps(config, indent=4) + "\n")
    print(f"{args.out_dir}: {changed} CimInt4MatMul node(s) compute={args.compute}, {LIBRARY_NAME} in {CONFIG_NAME}")


if __name__ == "__main__":
    main()
