"""Scale tuning as a step of an export (``tune_epochs``): the FP32 model is the teacher, calibration batches the data.

``Teacher`` is made from the FP32 model before the export (which may rewrite it in place) and holds
it in an ONNX Runtime session; ``Teacher.tune`` then trains the exported model's scales in place
(``tune.scales``) against the softmax of the model's first output over its last axis: a language
model's next-token logits. The batches are the windows (one ``.npz`` batch of B rows: B windows);
of two or more, one in ``HELD_OUT_SHARE`` (at least one, the last ones) is held out, and its KL per
position before and after is what the export summary reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from ...ops.ort_model import proto_session
from ...ops.session import session_options
from .graph import Graph, check_ops
from .scales import Feeds, TuneOptions, tune_scales

HELD_OUT_SHARE = 16


def held_out(batches: int) -> int:
    """How many of ``batches`` tuning batches are held out (the last): one in HELD_OUT_SHARE, at least one of 2+."""
    return 0 if batches < 2 else max(1, batches // HELD_OUT_SHARE)


@dataclass(frozen=True)
class TuneSummary:
    """What scale tuning did in an export, for its summary."""

    epochs: int
    lr: float
    batches: int
    held_out: int
    params: int
    kl_before: float
    kl_after: float
    seconds: float

    def format(self) -> str:
        on = f"{self.held_out} held-out window(s)" if self.held_out else "the training window (none held out)"
        return (
            f"  scales tuned: {self.params:,} scales, {self.epochs} epoch(s) over {self.batches - self.held_out} "
            f"window(s), lr {self.lr:g}; KL per position to FP32 on {on} {self.kl_before:.4f} -> "
            f"{self.kl_after:.4f} ({self.seconds:.0f} s; figures above this line are the untuned scales')"
        )


def windows(batches: Sequence[Feeds]) -> list[Feeds]:
    """The batches as windows: one batch (an ``.npz``) of B > 1 rows along every input's first axis is B windows."""
    if len(batches) == 1:
        rows = {v.shape[0] if np.ndim(v) else 0 for v in batches[0].values()}
        if len(rows) == 1 and (b := rows.pop()) > 1:
            return [{k: v[i : i + 1] for k, v in batches[0].items()} for i in range(b)]
    return list(batches)


class Teacher:
    """The FP32 model in an ONNX Runtime session, and the windows the exported model's scales are tuned on."""

    def __init__(self, model: onnx.ModelProto, batches: Sequence[Feeds]) -> None:
        # Before the export: a graph tuning cannot run fails in seconds, not after an hour of GPTQ.
        check_ops(model.graph.node)
        self.batches = windows(batches)
        for i, w in enumerate(self.batches):
            mask = w.get("attention_mask")
            if mask is not None and not np.all(np.asarray(mask) == 1):
                raise ValueError(f"window {i}: attention_mask has zeros (padding); scale tuning takes full windows")
        Graph(model).forward(self.batches[0])  # attributes too (erf Gelu, partial rotary), on the first window
        self.output = model.graph.output[0].name
        self.session = proto_session(model, session_options(pin=False))

    def logits(self, feeds: Feeds) -> np.ndarray:
        return self.session.run([self.output], dict(feeds))[0]

    def tune(self, exported: onnx.ModelProto, epochs: int, lr: float) -> TuneSummary:
        """Train ``exported``'s scales in place on the batches; the session is released after."""
        held = held_out(len(self.batches))
        options = TuneOptions(epochs=epochs, lr=lr, held_out=held, logits=self.output)
        result = tune_scales(exported, self.batches, self.logits, options)
        del self.session
        return TuneSummary(
            epochs, lr, len(self.batches), held, result.params, result.kl_before, result.kl_after, result.seconds
        )
