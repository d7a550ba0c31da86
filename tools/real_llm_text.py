"""Evaluation and calibration text for the real-LLM measurements (standard library only).

Evaluation: fixed licence texts from /usr/share/common-licenses, concatenated in a fixed order.
Calibration: other English text from /usr/share/doc (copyright files, READMEs, plain .txt/.md),
excluding every file that shares a span of SHINGLE consecutive words with the evaluation text
(many copyright files embed whole licences), and every file under /usr/share/common-licenses.

    python3 tools/real_llm_text.py OUT_DIR     # writes eval.txt, calib.txt, TEXT.md
"""

from __future__ import annotations

import argparse
import hashlib
import re
from pathlib import Path

LICENSES = Path("/usr/share/common-licenses")
EVAL_FILES = ("GPL-3", "Apache-2.0", "MPL-2.0", "GFDL-1.3", "Artistic")
DOC = Path("/usr/share/doc")
SHINGLE = 8  # words: a shared run this long means the file quotes the evaluation text
CALIB_NAMES = re.compile(r"^(copyright|README(\.md|\.txt)?|.*\.txt|.*\.md)$")
MIN_BYTES = 400
MAX_CALIB_BYTES = 200_000


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def _shingles(text: str) -> set[int]:
    w = _words(text)
    return {hash(" ".join(w[i : i + SHINGLE])) for i in range(len(w) - SHINGLE + 1)}


def _english_enough(text: str) -> bool:
    letters = sum(c.isalpha() for c in text)
    return letters > 0.6 * len(text) and text.count(" ") > 0.1 * len(text)


def build(out: Path) -> dict:
    """Write eval.txt, calib.txt and TEXT.md under ``out``; return a summary."""
    out.mkdir(parents=True, exist_ok=True)
    eval_parts = [(LICENSES / name).read_text(encoding="utf-8") for name in EVAL_FILES]
    eval_text = "\n\n".join(p.strip() for p in eval_parts) + "\n"
    eval_sh = _shingles(eval_text)

    kept: list[tuple[str, int]] = []
    excluded: list[str] = []
    seen: set[str] = set()
    calib_parts: list[str] = []
    size = 0
    for path in sorted(DOC.rglob("*")):
        if not path.is_file() or path.is_symlink() or not CALIB_NAMES.match(path.name):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) < MIN_BYTES or not _english_enough(text):
            continue
        digest = hashlib.sha256(text.encode()).hexdigest()
        if digest in seen:  # the same copyright file ships with many packages
            continue
        seen.add(digest)
        if _shingles(text) & eval_sh:
            excluded.append(str(path))
            continue
        if size + len(text) > MAX_CALIB_BYTES:
            break
        calib_parts.append(text.strip())
        kept.append((str(path), len(text)))
        size += len(text)
    calib_text = "\n\n".join(calib_parts) + "\n"
    (out / "eval.txt").write_text(eval_text, encoding="utf-8")
    (out / "calib.txt").write_text(calib_text, encoding="utf-8")
    overlap = len(_shingles(calib_text) & eval_sh)

    lines = [
        "# Real-LLM text: what went in",
        "",
        f"Made by `tools/real_llm_text.py` (cim-int4 repository). Words are lower-cased `[a-z0-9]+` runs; "
        f"a shared span means {SHINGLE} consecutive words in common.",
        "",
        f"## eval.txt ({len(eval_text)} characters, sha256 {hashlib.sha256(eval_text.encode()).hexdigest()[:16]})",
        "",
        "These files of /usr/share/common-licenses, in this order, stripped, joined by a blank line:",
        "",
        *[f"- {name} ({len(p)} characters)" for name, p in zip(EVAL_FILES, eval_parts, strict=True)],
        "",
        f"## calib.txt ({len(calib_text)} characters, sha256 {hashlib.sha256(calib_text.encode()).hexdigest()[:16]})",
        "",
        f"Files of /usr/share/doc named copyright, README, *.txt or *.md, in sorted path order, UTF-8, at least "
        f"{MIN_BYTES} characters, mostly letters and spaces, duplicates (same bytes) once, up to "
        f"{MAX_CALIB_BYTES} characters in all; excluded: every file sharing a {SHINGLE}-word span with eval.txt "
        f"({len(excluded)} files). Shared {SHINGLE}-word spans between calib.txt and eval.txt after joining: "
        f"{overlap}.",
        "",
        f"Kept ({len(kept)} files):",
        "",
        *[f"- {p} ({n} characters)" for p, n in kept],
        "",
        "Excluded for sharing a span with the evaluation text:",
        "",
        *[f"- {p}" for p in excluded],
        "",
    ]
    (out / "TEXT.md").write_text("\n".join(lines), encoding="utf-8")
    return {"eval_chars": len(eval_text), "calib_chars": len(calib_text), "kept": len(kept),
            "excluded": len(excluded), "overlap": overlap}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="folder for eval.txt, calib.txt and TEXT.md")
    print(build(ap.parse_args().out))


if __name__ == "__main__":
    main()
