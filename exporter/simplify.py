"""Optional onnxsim pass before the rewrite: folds what our own folding does not (Shape chains, Mul of constants)."""

from __future__ import annotations

import onnx


def simplify_model(model: onnx.ModelProto) -> tuple[onnx.ModelProto, str | None]:
    """``model`` simplified by onnxsim, or unchanged with a one-line message saying why it was not."""
    try:
        import onnxsim
    except ImportError:
        return model, "simplify: onnxsim is not installed (pip install 'cim-int4[simplify]'); continuing unsimplified"
    try:
        simplified, ok = onnxsim.simplify(model)
    except Exception as e:  # noqa: BLE001 - onnxsim raises many kinds; any of them means "not simplified"
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return model, f"simplify: onnxsim failed ({type(e).__name__}: {first[:200]}); continuing unsimplified"
    if not ok:
        return model, "simplify: onnxsim's output check failed; continuing unsimplified"
    return simplified, None
