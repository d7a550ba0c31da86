"""Prepare an onnxruntime-genai model folder to run CimInt4MatMul: ``cim-int4 genai DIR [-o OUT]``.

genai loads a custom-op library named by ``custom_ops_library`` in a model's
``session_options`` (genai_config.json), but only from an allowed folder: the model folder
(a symlink is resolved first, so it must be a real copy), an execution-provider library
folder or the current directory; a path with ``..`` or into site-packages is refused
(checked with onnxruntime-genai 0.18). So the prepared folder holds a copy of the library
and names it relative to itself.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import onnx

from .exporter import ExportError, NothingToQuantize, export_with_summary, load_model, save_model
from .exporter.convert import NothingToConvert, convert_file
from .exporter.quantize import DEFAULT_SCALE_DTYPE
from .ops.library import LIBRARY_NAME, library_path

CONFIG_NAME = "genai_config.json"
OPTION = "custom_ops_library"
# The compute mode of a model exported from FP32 when the caller says "auto": int8 activations,
# like the builder's own int4 (MatMulNBits accuracy_level 4, its CPU default, quantizes them too).
# Decode is one token per step, where int8 is the faster mode; on two real LLMs it moved
# perplexity by +0.4% and +0.05% (the gap to FP32 by +1.6% and +0.13%, docs/real-llm.md).
EXPORT_COMPUTE = "int8"


def default_output(source: str | os.PathLike) -> Path:
    """Where ``cim-int4 genai DIR`` writes without ``-o``: ``DIR-cim-int4`` beside DIR."""
    src = Path(source).resolve()
    return src.with_name(src.name + "-cim-int4")


def external_files(path: Path) -> set[str]:
    """Names of the external data files a model file refers to (relative to its folder)."""
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - load_model below reports an unreadable file properly
        return set()
    tensors = list(proto.graph.initializer)
    tensors += [a.t for n in proto.graph.node for a in n.attribute if a.type == onnx.AttributeProto.TENSOR]
    return {e.value for t in tensors for e in t.external_data if e.key == "location"}


def model_files(model_path: Path) -> set[Path]:
    """``model_path`` and the external data files it refers to."""
    return {model_path} | {model_path.parent / name for name in external_files(model_path)}


def copy_folder(src: Path, dst: Path, skip: set[Path]) -> None:
    """Copy the folder ``src`` into ``dst`` (which may exist), without the files in ``skip``."""
    shutil.copytree(
        src, dst, dirs_exist_ok=True, ignore=lambda folder, names: [n for n in names if Path(folder, n) in skip]
    )


def _rewrite(
    path: Path, output: Path, compute: str, group_size: int, keep_embedding: bool, scale_dtype: str,
    fuse_gated: bool = True,
) -> tuple[bool, str]:
    """Write the model at ``path`` with CimInt4MatMul nodes to ``output``; (False if nothing to do, what was done)."""
    try:
        return True, convert_file(
            path, output, compute=compute, quiet=True, external_data=True, fuse_gated=fuse_gated
        ).format()
    except NothingToConvert as e:
        if e.summary.skipped:  # MatMulNBits nodes, none convertible: not an FP32 model either
            return False, str(e)
    model = load_model(path)
    try:
        # "auto" (take the mode from each MatMulNBits' accuracy_level) has nothing to read here.
        mode = EXPORT_COMPUTE if compute == "auto" else compute
        quantized, summary = export_with_summary(
            model, group_size=group_size, keep_embedding=keep_embedding, compute=mode, scale_dtype=scale_dtype,
            fuse_gated=fuse_gated,
        )
    except NothingToQuantize as e:
        return False, str(e)
    del model  # the quantized model is all that is needed now
    # External data: ORT keeps one copy of the weights instead of two (docs/design.md "Session memory");
    # genai's ORT (>= 1.31) resolves it from the model's folder.
    save_model(quantized, output, external_data=True, consume=True)
    return True, summary.format()


def _model_sections(config: dict) -> dict[str, dict]:
    """The sections of genai_config.json's ``model`` that name an ONNX file (decoder, embedding, vision, ...)."""
    model = config.get("model")
    if not isinstance(model, dict):
        raise ExportError(f"{CONFIG_NAME} has no 'model' object")
    return {k: v for k, v in model.items() if isinstance(v, dict) and isinstance(v.get("filename"), str)}


def prepare(
    source: str | os.PathLike,
    output: str | os.PathLike | None = None,
    *,
    compute: str = "auto",
    group_size: int = 32,
    quiet: bool = False,
    keep_embedding: bool = False,
    scale_dtype: str = DEFAULT_SCALE_DTYPE,
    fuse_gated: bool = True,
) -> Path:
    """Write a copy of the genai model folder ``source`` that runs CimInt4MatMul; return the new folder.

    Each ONNX model the config names is converted (MatMulNBits, see ``from_matmulnbits``;
    ``compute`` as there) or else exported from FP32 (``export_int4``, ``group_size``,
    ``keep_embedding``, ``scale_dtype`` and ``compute``, "auto" meaning EXPORT_COMPUTE); either
    way each gated MLP becomes one node unless ``fuse_gated=False``. The
    op library is copied into the folder and named in each changed model's session options.
    ``output`` (default ``<source>-cim-int4``) must not exist; ``source`` is only read.
    """
    src = Path(source)
    config_path = src / CONFIG_NAME
    if not config_path.is_file():
        raise ExportError(f"{src}: not an onnxruntime-genai model folder (no {CONFIG_NAME})")
    out = Path(output) if output is not None else default_output(src)
    if out.exists():
        raise ExportError(f"{out}: already exists; choose a new output folder")
    if not out.parent.is_dir():
        raise ExportError(f"{out}: folder {out.parent} does not exist")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"{config_path}: not readable JSON ({e})") from e
    sections = _model_sections(config)
    library = library_path()

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        replaced: set[Path] = set()  # files of src that the new folder holds in converted form
        reports = []
        for name, section in sections.items():
            filename = section["filename"]
            model_path = src / filename
            if not model_path.is_file():
                raise ExportError(f"{model_path}: named by {CONFIG_NAME} model.{name}.filename but missing")
            (tmp / filename).parent.mkdir(parents=True, exist_ok=True)
            rewritten, report = _rewrite(
                model_path, tmp / filename, compute, group_size, keep_embedding, scale_dtype, fuse_gated
            )
            reports.append(f"{filename} (model.{name}):\n{report}")
            if not rewritten:
                continue
            replaced |= model_files(model_path)
            options = section.setdefault("session_options", {})
            if options.get(OPTION) not in (None, LIBRARY_NAME):
                raise ExportError(f"{config_path}: model.{name} already uses {OPTION} {options[OPTION]!r}")
            # Relative to the model folder: genai accepts a library inside it and nothing outside.
            options[OPTION] = LIBRARY_NAME
        if not replaced:
            raise ExportError(f"{src}: no model in the folder to convert\n" + "\n".join(reports))
        copy_folder(src, tmp, replaced | {config_path})
        shutil.copyfile(library, tmp / LIBRARY_NAME)  # a real file: genai refuses symlinks out of the folder
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=4) + "\n")
        tmp.chmod(0o755)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not quiet:
        print("\n".join(reports))
        print(f"cim-int4: wrote {out} (library {LIBRARY_NAME}, {OPTION} set in {CONFIG_NAME})")
    return out
