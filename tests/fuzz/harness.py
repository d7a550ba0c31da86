"""Seeded fuzzing of CimInt4MatMul: mutated attributes and inputs, batches of cases in child processes.

Each case is made from its seed alone (``make_case``). A child process runs cases and prints
one line per case; a case that kills the child (a crash, a sanitizer abort) or hangs it is
reported with its seed, and the next child resumes after it. The outcome a case must have:

* valid attributes and a valid input (any shape, misaligned, empty, huge or tiny values): the
  session loads, runs, and the output matches ``reference.matmul`` within the FP32 error bound
  wherever the exact products stay well inside the float32 range;
* anything else: a clean ONNX Runtime error at session creation or run, or an output that the
  reference confirms in the same way.

Run ``python tests/fuzz/harness.py --cases 300`` for a report; tests/fuzz/test_fuzz.py is the CI test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

INT64_MAX = 2**63 - 1
FLT_MAX = float(np.finfo(np.float32).max)
GROUP_SIZES = (16, 32, 64, 128, 256)  # the contract's (test_fuzz checks); no package import here
BITS = (2, 3, 4, 5, 6, 8)  # the same for the code widths
U32 = 2.0**-24


@dataclass
class Case:
    """One fuzz case: the node's attributes, the input, and what must happen."""

    seed: int
    description: str
    attrs: dict
    a: np.ndarray
    declared: list | None
    kernel: str
    threads: int
    valid: bool  # must load, run and match the reference


# ---------------------------------------------------------------- case generation


def _pick(rng: np.random.Generator, options: list):
    return options[int(rng.integers(len(options)))]


def _weight(rng: np.random.Generator) -> tuple[int, int, int, int, np.ndarray, np.ndarray]:
    """K, N, group size, code width, packed codes and scales (float32, or float16 for some cases)."""
    from cim_int4.exporter import quantize_weight

    from cim_int4.contract import pack, q_range

    k = int(rng.choice([1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 100, 255, 256, 257, int(rng.integers(1, 600))]))
    n = int(rng.choice([1, 2, 3, 7, 8, 15, 16, 17, 33, int(rng.integers(1, 80))]))
    g = int(rng.choice(GROUP_SIZES))
    bits = int(rng.choice(BITS + (4, 4)))
    if bits == 4:
        qw = quantize_weight(rng.standard_normal((k, n)).astype(np.float32), g)
        packed, scales = qw.packed, qw.scales
    else:  # any codes of the width, padding q = 0
        lo, hi = q_range(bits)
        q = np.zeros((n, -(-k // g) * g), np.int16)
        q[:, :k] = rng.integers(lo, hi + 1, (n, k))
        packed = pack(q, bits)
        scales = (rng.standard_normal((n, q.shape[1] // g)) * 0.05).astype(np.float32)
    if rng.random() < 0.3:
        scales = scales.astype(np.float16)
    return k, n, g, bits, packed, scales


def _attr_mutation(rng: np.random.Generator, attrs: dict, k: int, n: int, g: int) -> str:
    """Mutate one attribute in place; returns its description."""
    from cim_int4.contract import pack_codes, unpack_codes

    packed, scales = attrs["packed"], attrs["scales"]
    bits = int(attrs.get("bits") or 4)
    choice = int(rng.integers(0, 28))
    if choice == 27:
        groups = scales.shape[1] if scales.ndim == 2 else 1
        supers = -(-groups // 8)
        options = [None, np.zeros((n, supers + 1), np.float16), np.zeros((n * supers,), np.float16),
                   np.full((n, supers), np.nan, np.float16), np.full((n, supers), np.inf, np.float16),
                   np.ones((n, supers), np.float32), np.ones((n, supers), np.float16)]
        attrs["super_scales"] = _pick(rng, options)
        value = attrs["super_scales"]
        kind = "missing" if value is None else f"{value.dtype} {list(value.shape)}"
        return f"super_scales {kind} (scales {scales.dtype})"
    if choice == 26:
        attrs["gated"] = _pick(rng, ["silu", "gelu_tanh", "relu", "", 3])
        return f"gated={attrs['gated']!r} (N={n})"
    if choice == 24:
        attrs["bits"] = _pick(rng, [0, 1, 7, 9, 16, -4, 2**40, *[b for b in BITS if b != bits]])
        return f"bits={attrs['bits']} (data for {bits})"
    if choice == 25:
        attrs["bits"] = _pick(rng, [4.0, "4", [4], np.array([bits], np.int64)])
        return f"bits of type {type(attrs['bits']).__name__}"
    huge = [INT64_MAX, INT64_MAX - 1, INT64_MAX - g + 1, 2**62, 2**32, 2**31, 2**31 - 1]
    if choice == 0:
        attrs["K"] = int(rng.choice(huge))
        return f"K={attrs['K']}"
    if choice == 1:
        attrs["N"] = int(rng.choice(huge))
        return f"N={attrs['N']}"
    if choice == 2:
        attrs["group_size"] = int(rng.choice([INT64_MAX, 2**62, 2**32 + 32]))
        return f"group_size={attrs['group_size']}"
    if choice == 3:
        name = str(rng.choice(["K", "N", "group_size"]))
        attrs[name] = int(rng.choice([0, -1, -32, -(2**63), 1 - 2**63]))
        return f"{name}={attrs[name]}"
    if choice == 4:
        name = str(rng.choice(["K", "N"]))
        attrs[name] = int(attrs[name] + rng.choice([-2, -1, 1, 2, 32, -32]))
        return f"{name} off to {attrs[name]}"
    if choice == 5:
        attrs["group_size"] = int(rng.choice([1, 2, 8, 24, 48, 512, 1024] + [x for x in GROUP_SIZES if x != g]))
        return f"group_size={attrs['group_size']} (data for {g})"
    if choice in (6, 7, 8) and scales.dtype == np.int8:  # scale values: mutated in float32 form, no super-scales
        from cim_int4.contract import scale_values

        scales = scale_values(scales, attrs.pop("super_scales"))
    if choice == 6:
        s = scales.copy()
        s.flat[int(rng.integers(s.size))] = rng.choice([np.nan, np.inf, -np.inf])
        attrs["scales"] = s
        return "non-finite scale"
    if choice == 7:
        s = scales.copy()
        value = float(rng.choice([1e38, FLT_MAX, FLT_MAX / 8, FLT_MAX / 8.5, 4e37, 1e30]))
        s.flat[int(rng.integers(s.size))] = value * float(rng.choice([1, -1]))
        attrs["scales"] = s
        return f"huge scale {value:g}"
    if choice == 8:
        s = scales.copy()
        s.flat[: int(rng.integers(1, s.size + 1))] *= np.float32(rng.choice([-1, 1e-38, 1e-45, 0]))
        attrs["scales"] = s
        return "negative, tiny, denormal or zero scales"
    if choice == 9:
        dtype = _pick(rng, [np.float64, np.float16, np.float32, np.int32, np.uint8, np.uint16])
        attrs["scales"] = scales.astype(dtype)
        return f"scales {np.dtype(dtype).name}"
    if choice == 10:
        attrs["scales"] = _pick(rng, [scales.T.copy(), scales[:, :-1].copy(), scales.reshape(-1), scales[:0]])
        return f"scales shape {list(attrs['scales'].shape)}"
    if choice == 11:
        dtype = _pick(rng, [np.int8, np.float32, np.int32, np.uint16])
        attrs["packed"] = packed.astype(dtype)
        return f"packed {np.dtype(dtype).name}"
    if choice == 12:
        options = [packed[:, :-1].copy(), packed[:-1].copy(), packed.reshape(-1), packed[:0], packed[:, :0].copy()]
        options.append(np.zeros((n, packed.shape[1] + 1), np.uint8))
        attrs["packed"] = _pick(rng, options)
        return f"packed shape {list(attrs['packed'].shape)}"
    if choice == 13:
        codes = unpack_codes(packed, bits)
        if codes.shape[1] > k:
            codes[int(rng.integers(n)), int(rng.integers(k, codes.shape[1]))] = int(rng.integers(1 << bits))
        attrs["packed"] = pack_codes(codes, bits)
        return "padding code changed"
    if choice == 14:
        attrs["packed"] = rng.integers(0, 256, packed.shape, dtype=np.uint8)
        return "random packed bytes"
    if choice == 15:
        name = str(rng.choice(["K", "N", "group_size", "packed", "scales"]))
        attrs[name] = None
        return f"{name} missing"
    if choice == 16:
        name = str(rng.choice(["K", "N", "group_size"]))
        attrs[name] = _pick(rng, [1.5, "32", [32, 32], np.array([32], np.int64)])
        return f"{name} of type {type(attrs[name]).__name__}"
    if choice == 17:
        attrs["packed"] = [int(x) for x in packed.reshape(-1)[:64]]
        return "packed as a list of ints"
    if choice == 18:
        bias = _pick(
            rng,
            [
                np.zeros(n + 1, np.float32),
                np.zeros((1, n), np.float32),
                np.zeros(n, np.float64),
                np.full(n, np.nan, np.float32),
                np.full(n, np.inf, np.float32),
                np.zeros(0, np.float32),
            ],
        )
        attrs["bias"] = bias
        return f"bias {bias.dtype} {list(bias.shape)} {bias.flat[:1]}"
    if choice == 19:
        attrs["bias"] = (rng.standard_normal(n) * 1e30).astype(np.float32)
        return "huge bias"
    if choice == 20:
        attrs["compute"] = _pick(rng, ["int8", "fp16", "", 3])
        return f"compute={attrs['compute']!r}"
    if choice == 21:
        attrs["unknown_attribute"] = 7
        return "unknown attribute"
    if choice == 22:
        attrs["K"], attrs["N"] = attrs["N"], attrs["K"]
        return "K and N swapped"
    attrs["scales"] = np.zeros_like(scales)
    return "all scales zero"


def _input(rng: np.random.Generator, k: int, case_valid: bool) -> tuple[np.ndarray, list | None, str, bool]:
    """An input A [..., K], its declared shape, a description, and whether it is a valid input."""
    lead = _pick(rng, [(), (1,), (3,), (int(rng.integers(1, 70)),), (0,), (2, 0), (2, 3), (1, 1, 2)])
    a = rng.standard_normal((*lead, k)).astype(np.float32)
    declared = None if rng.random() < 0.3 else [f"d{i}" for i in range(len(lead))] + [k]
    kind = int(rng.integers(0, 12)) if case_valid else 0
    if kind == 1:
        a *= np.float32(rng.choice([1e30, 1e36, 1e-30, 1e-40, FLT_MAX / 4]))
        return a, declared, f"A {list(a.shape)} scaled", True
    if kind == 2:
        a.flat[: max(1, a.size // 7)] = rng.choice([np.nan, np.inf, -np.inf, FLT_MAX, -FLT_MAX, 1e-45])
        return a, declared, f"A {list(a.shape)} with extreme values", True
    if kind == 3:
        raw = np.zeros(a.nbytes + 4, np.uint8)
        offset = int(rng.integers(1, 4))
        view = np.frombuffer(raw.data, dtype=np.float32, count=a.size, offset=offset).reshape(a.shape)
        view[...] = a
        return view, declared, f"A {list(a.shape)} misaligned by {offset} bytes", True
    if kind == 4:
        dtype = _pick(rng, [np.float64, np.float16, np.int32])
        return a.astype(dtype), None, f"A {np.dtype(dtype).name}", False
    if kind == 5:
        shape = (*lead, k + int(rng.choice([-1, 1, 31])))
        if shape[-1] < 0:
            shape = (*lead, k + 1)
        return rng.standard_normal(shape).astype(np.float32), None, f"A {list(shape)} wrong K", False
    if kind == 6:
        big = rng.standard_normal((*lead, k)).astype(np.float32) * np.float32(2e36)
        return big, declared, f"A {list(a.shape)} ~2e36", True
    return a, declared, f"A {list(a.shape)}", True


def make_case(seed: int, kernels: tuple[str, ...] = ("auto",)) -> Case:
    """The fuzz case of ``seed``: about a third valid, the others with one mutated attribute or a bad input."""
    rng = np.random.default_rng([20261130, seed])
    k, n, g, bits, packed, scales = _weight(rng)
    attrs: dict = {"K": k, "N": n, "group_size": g, "packed": packed, "scales": scales}
    if bits != 4 or rng.random() < 0.2:
        attrs["bits"] = bits
    if rng.random() < 0.3:
        attrs["bias"] = rng.standard_normal(n).astype(np.float32)
    if rng.random() < 0.2:  # int8 scales with float16 super-scales
        from cim_int4.contract import int8_scales

        encoded = int8_scales(scales.astype(np.float32))
        if encoded is not None:
            attrs["scales"], attrs["super_scales"] = encoded
            scales = attrs["scales"]
    kernel = str(rng.choice(kernels))
    threads = int(rng.choice([1, 2]))
    mutate = rng.random() < 0.6
    what = _attr_mutation(rng, attrs, k, n, g) if mutate else "valid attributes"
    a, declared, input_what, input_valid = _input(rng, k, not mutate)
    description = (
        f"K={k} N={n} g={g} bits={bits} scales={scales.dtype} {what}; {input_what}; kernel={kernel} threads={threads}"
    )
    return Case(seed, description, attrs, a, declared, kernel, threads, not mutate and input_valid)


# ---------------------------------------------------------------- running one case


def _node_attributes(attrs: dict) -> dict:
    from onnx import numpy_helper

    out = {}
    for name, value in attrs.items():
        if value is None:
            continue
        out[name] = numpy_helper.from_array(value, name) if isinstance(value, np.ndarray) else value
    return out


def _model(case: Case):
    from onnx import TensorProto, helper

    from cim_int4.contract import OP_DOMAIN, OP_TYPE, OP_VERSION

    node = helper.make_node(OP_TYPE, ["A"], ["Y"], name="fuzz", domain=OP_DOMAIN, **_node_attributes(case.attrs))
    elem = helper.np_dtype_to_tensor_dtype(case.a.dtype)
    graph = helper.make_graph(
        [node],
        "fuzz",
        [helper.make_tensor_value_info("A", elem, case.declared)],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(OP_DOMAIN, OP_VERSION)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def _check_output(case: Case, y: np.ndarray) -> str | None:
    """None if ``y`` is what the attributes mean, else why not."""
    from cim_int4.ops import reference

    attrs = case.attrs
    try:
        packed, scales = np.asarray(attrs["packed"]), np.asarray(attrs["scales"])
        k, n = int(attrs["K"]), int(attrs["N"])
        g = 32 if attrs.get("group_size") is None else int(attrs["group_size"])
        bits = attrs.get("bits", 4)
        bias = attrs.get("bias")
        compute = attrs.get("compute")
        gated = attrs.get("gated")
        if gated is not None and (gated not in reference.GATED_ACTIVATIONS or n % 2):
            raise ValueError(f"gated={gated!r} with N={n}")
        if not isinstance(bits, int) or bits not in BITS:
            raise ValueError(f"bits={bits!r}")
        super_scales = attrs.get("super_scales")
        if scales.dtype == np.int8 or super_scales is not None:  # int8 scales: their values, as the contract reads them
            from cim_int4.contract import scale_values, supers_of

            super_scales = np.asarray(super_scales)
            if scales.dtype != np.int8 or scales.ndim != 2 or super_scales.dtype != np.float16:
                raise ValueError(f"scales {scales.dtype} with super_scales {super_scales.dtype}")
            if super_scales.shape != (n, supers_of(scales.shape[1])) or not np.isfinite(super_scales).all():
                raise ValueError(f"super_scales {list(super_scales.shape)} for scales {list(scales.shape)}")
            scales = scale_values(scales, super_scales)
        if packed.dtype != np.uint8 or scales.dtype not in (np.float32, np.float16) or packed.shape[0] != n:
            raise ValueError(f"packed {packed.dtype} {packed.shape}, scales {scales.dtype}")
        if compute not in (None, *reference.COMPUTE_MODES):
            raise ValueError(f"compute={compute!r}")
        with np.errstate(all="ignore"):
            exact = reference.matmul(case.a, packed, scales, k, g, bias, bits)
            abs_sum = np.abs(case.a.astype(np.float64)) @ np.abs(reference.dequantize(packed, scales, k, g, bits))
            if compute == "int8" and case.a.size:  # (reference.emulate cannot reshape an empty A)
                # int8 mode quantizes A: held to the exact emulation of its arithmetic, within a few ulps.
                emulated = reference.emulate(case.a, packed, scales, k, g, bias, "int8", bits).astype(np.float64)
    except Exception as e:  # noqa: BLE001 - anything the reference refuses
        return f"the op accepted attributes the reference refuses ({type(e).__name__}: {e})"
    if gated is not None:  # both halves held to the bound above, carried through the gate
        with np.errstate(all="ignore"):
            full_bound = (k + 2) * U32 * abs_sum + (k + 2) * 2.0**-149 * (1.0 + float(np.abs(scales).max(initial=0)))
            if bias is not None:
                full_bound = full_bound + U32 * (np.abs(exact) + full_bound)
            if compute == "int8" and case.a.size:
                magnitude = abs_sum + (0.0 if bias is None else np.abs(np.asarray(bias, dtype=np.float64)))
                exact, full_bound = emulated, 4 * U32 * magnitude + 1e-37
            comparable = np.isfinite(abs_sum) & (abs_sum < FLT_MAX / 4) & np.isfinite(exact)
            h = n // 2
            comparable = comparable[..., :h] & comparable[..., h:]
            bound = reference.gated_bound(exact, full_bound, gated)
            exact = reference.gated(exact, gated)
            comparable &= np.isfinite(exact) & np.isfinite(bound) & (np.abs(exact) < FLT_MAX / 4)
        if y.shape != exact.shape or y.dtype != np.float32:
            return f"output {y.dtype} {list(y.shape)}, expected float32 {list(exact.shape)}"
        with np.errstate(all="ignore"):
            err = np.abs(y.astype(np.float64) - exact)
        bad = comparable & ~(err <= bound)
        if bad.any():
            i = np.unravel_index(int(np.argmax(bad)), bad.shape)
            off = f"y{list(i)}={y[i]!r}, exact {exact[i]!r}, bound {bound[i]:.3g}"
            return f"{int(bad.sum())} gated output(s) off: {off}"
        return None
    if y.shape != exact.shape or y.dtype != np.float32:
        return f"output {y.dtype} {list(y.shape)}, expected float32 {list(exact.shape)}"
    # Where the exact products stay far inside float32's range, any summation order is within
    # Higham's bound (plus one rounding of the bias); beyond it, only "no crash" is required.
    # Gradual underflow adds up to half a subnormal step per operation, scaled by a group's scale.
    with np.errstate(all="ignore"):
        underflow = (k + 2) * 2.0**-149 * (1.0 + float(np.abs(scales.astype(np.float64)).max(initial=0.0)))
        bound = (k + 2) * U32 * abs_sum + underflow
        if bias is not None:
            bound = bound + U32 * (np.abs(exact) + bound)
        if compute == "int8" and case.a.size:
            magnitude = abs_sum + (0.0 if bias is None else np.abs(np.asarray(bias, dtype=np.float64)))
            exact, bound = emulated, 4 * U32 * magnitude + 1e-37 + underflow
        comparable = np.isfinite(abs_sum) & (abs_sum < FLT_MAX / 4) & np.isfinite(exact)
        if bias is not None:
            comparable &= np.isfinite(np.asarray(bias, dtype=np.float64))
        err = np.abs(y.astype(np.float64) - exact)
    bad = comparable & ~(err <= bound)
    if bad.any():
        i = np.unravel_index(int(np.argmax(bad)), bad.shape)
        return f"{int(bad.sum())} output(s) off: y{list(i)}={y[i]!r}, exact {exact[i]!r}, bound {bound[i]:.3g}"
    return None


def run_case(case: Case) -> tuple[str, str]:
    """("ok" | "fail", detail) for one case, in this process."""
    from cim_int4 import make_session

    os.environ["CIM_INT4_KERNEL"] = case.kernel
    try:
        model = _model(case).SerializeToString()
    except Exception as e:  # noqa: BLE001 - a harness bug, not the op's
        return "fail", f"harness could not build the model: {type(e).__name__}: {e}"
    try:
        sess = make_session(model, threads=case.threads, oversubscribe=True)
        (y,) = sess.run(None, {"A": case.a})
    except Exception as e:  # noqa: BLE001 - ORT raises its own exception classes
        if not type(e).__module__.startswith("onnxruntime"):
            return "fail", f"not an ORT error: {type(e).__name__}: {e}"
        if case.valid:
            return "fail", f"valid case refused: {' '.join(str(e).split())[:300]}"
        return "ok", "refused"
    why = _check_output(case, y)
    return ("fail", why) if why else ("ok", "ran")


CRASH_ENV = "CIM_INT4_FUZZ_CRASH_SEED"


def child_main(start: int, count: int, kernels: tuple[str, ...]) -> None:
    """Run cases start..start+count-1, one JSON line each, preceded by a 'start' line (so a crash names its seed)."""
    crash_seed = int(os.environ.get(CRASH_ENV, "-1"))  # lets the harness's own test prove crashes are caught
    for seed in range(start, start + count):
        print(json.dumps({"start": seed}), flush=True)
        if seed == crash_seed:
            os.abort()
        case = make_case(seed, kernels)
        outcome, detail = run_case(case)
        print(json.dumps({"seed": seed, "outcome": outcome, "detail": detail}), flush=True)


# ---------------------------------------------------------------- the parent


@dataclass
class Result:
    """What happened to one case."""

    seed: int
    outcome: str  # ok | fail | crash | hang
    detail: str


def run_cases(seeds: range, kernels: tuple[str, ...], batch_timeout: float = 120.0) -> list[Result]:
    """Run ``seeds`` in child processes, restarting after a crash or hang; one Result per seed."""
    results: dict[int, Result] = {}
    next_seed = seeds.start
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    while next_seed < seeds.stop:
        cmd = [sys.executable, __file__, "--child", str(next_seed), str(seeds.stop - next_seed), ",".join(kernels)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=batch_timeout, env=env)
            out, code, err = proc.stdout, proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            code, err = None, "timeout"
        started = None
        for line in out.splitlines():
            record = json.loads(line)
            if "start" in record:
                started = record["start"]
            else:
                results[record["seed"]] = Result(record["seed"], record["outcome"], record["detail"])
                started = None
        if code == 0 and started is None:
            break
        if started is None:
            # The child died between cases (or before the first): nothing to blame, run the rest.
            started = max(results, default=next_seed - 1) + 1
            if started >= seeds.stop:
                break
        lines = err.strip().splitlines()
        sanitizer = [line for line in lines if "runtime error" in line or "Sanitizer" in line]
        tail = " | ".join(sanitizer[:2] or lines[-3:])[:400]
        kind = "hang" if code is None else "crash"
        results[started] = Result(started, kind, f"exit {code}: {tail}")
        next_seed = started + 1
    return [results[s] for s in seeds if s in results]


def available_kernels() -> tuple[str, ...]:
    """Kernel names this CPU runs (from conftest's probe), plus "auto"."""
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from conftest import available_kernels as probe

    return ("auto", *probe())


def main(argv: list[str] | None = None) -> int:
    """Command line: a report of a seeded run; exit 1 if any case failed, crashed or hung."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=300)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--child", nargs=3, metavar=("START", "COUNT", "KERNELS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child_main(int(args.child[0]), int(args.child[1]), tuple(args.child[2].split(",")))
        return 0
    t0 = time.perf_counter()
    results = run_cases(range(args.start, args.start + args.cases), available_kernels())
    bad = [r for r in results if r.outcome != "ok"]
    for r in bad:
        case = make_case(r.seed, available_kernels())
        print(f"{r.outcome.upper()} seed={r.seed} {case.description}: {r.detail}")
    print(f"{len(results)} cases, {len(bad)} not ok, {time.perf_counter() - t0:.1f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
