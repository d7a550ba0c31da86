"""Scale tuning as a step of an export (``tune_epochs``): the FP32 model is the teacher, calibration batches the data.

``Teacher`` is made from the FP32 model before the export (which may rewrite it in place) and holds
it in an ONNX Runtime session; ``Teacher.tune`` then trains the exported model's scales in place
(``tune.scales``) against the softmax of the model's first output over its last axis: a language
model's next-token logits. Of two or more batches, one in ``HELD_OUT_SHARE`` (at least one, the last
ones) is held out, and its KL per position before and after is what the export summary reports.
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
        on = f"{self.held_out} held-out batch(es)" if self.held_out else "the training batch (none held out)"
        return (
            f"  scales tuned: {self.params:,} scales, {self.epochs} epoch(s) over {self.batches - self.held_out} "
            f"batch(es), lr {self.lr:g}; KL per position to FP32 on {on} {self.kl_before:.4f} -> "
            f"{self.kl_after:.4f} ({self.seconds:.0f} s)"
        )


class Teacher:
    """The FP32 model in an ONNX Runtime session, and the batches the exported model's scales are tuned on."""

    def __init__(self, model: onnx.ModelProto, batches: Sequence[Feeds]) -> None:
        # Before the export: a graph tuning cannot run fails in seconds, not after an hour of GPTQ.
        check_ops(model.graph.node)
        Graph(model).forward(batches[0])  # attributes and inputs too (padded windows, erf Gelu, partial rotary)
        self.output = model.graph.output[0].name
        self.batches = list(batches)
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
