"""Ray Serve deployments of cim-int4 models: ``/v1/infer`` for any exported ONNX model, ``/v1/generate`` for genai.

Each replica claims ``threads`` CPUs (``cpus.claim_cpus``), pins its process to them and
owns one ORT session (or one onnxruntime-genai model) with that many intra-op threads;
Ray reserves the same number (``ray_actor_options.num_cpus``). Runs happen one at a time
on one worker thread, so the replica's event loop stays free to answer ``/healthz`` and
to gather a batch. Needs the serve extra: ``pip install 'cim-int4[serve]'``.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the handlers' annotations
# (``request: Request``) at run time, and Serve's ingress does not resolve string ones.
import asyncio
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve import Application

from ..genai import CONFIG_NAME
from ..ops import make_session
from .cpus import CpuClaim, claim_cpus, pin_process
from .tensors import (
    DEFAULT_MAX_BODY,
    RequestError,
    batch_key,
    check_size,
    concat,
    encode_outputs,
    input_specs,
    load_json,
    parse_request,
    rows,
    split,
)

logger = logging.getLogger("ray.serve")

APP_NAME = "cim-int4"
DEFAULT_MAX_BATCH = 16
DEFAULT_BATCH_WAIT_MS = 5.0


@dataclass(frozen=True)
class ServeConfig:
    """How a model is served: replicas, threads per replica, batching, body limit."""

    replicas: int = 1
    threads: int = 1
    max_batch: int = DEFAULT_MAX_BATCH  # 1 turns batching off
    batch_wait_ms: float = DEFAULT_BATCH_WAIT_MS
    max_body: int = DEFAULT_MAX_BODY
    compute: str | None = None  # "fp32"/"int8": every CimInt4MatMul's compute mode (default: each node's own)

    def __post_init__(self) -> None:
        for name in ("replicas", "threads", "max_batch", "max_body"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms must be >= 0, got {self.batch_wait_ms}")

    def deployment_options(self) -> dict:
        """Options of ``serve.deployment``: one replica per ``replicas``, ``threads`` CPUs reserved for each."""
        return {
            "num_replicas": self.replicas,
            "ray_actor_options": {"num_cpus": self.threads},
            # Enough requests queued at a replica to fill a batch twice over.
            "max_ongoing_requests": max(2 * self.max_batch, 8),
        }


def is_genai_folder(model: str | os.PathLike) -> bool:
    """Whether ``model`` is an onnxruntime-genai folder (served on /v1/generate) rather than an ONNX file."""
    return (Path(model) / CONFIG_NAME).is_file()


def _error(e: RequestError) -> JSONResponse:
    return JSONResponse({"error": " ".join(str(e).split())}, status_code=e.status)


class Replica:
    """What both deployments share: CPUs claimed and pinned, one worker thread for the runs, /healthz."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.claim: CpuClaim | None = claim_cpus(threads)
        if self.claim is None:
            logger.warning(f"cim-int4: not enough free CPUs to pin {threads} thread(s); this replica runs unpinned")
        else:
            pin_process(self.claim.cpus)
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="cim-int4-run")

    @property
    def pin(self) -> str:
        return "pool" if self.claim is not None else "none"

    async def on_worker(self, fn, *args):  # noqa: ANN001, ANN201
        return await asyncio.get_running_loop().run_in_executor(self.worker, fn, *args)

    def health(self) -> dict:
        cpus = None if self.claim is None else list(self.claim.cpus)
        return {"status": "ok", "pid": os.getpid(), "threads": self.threads, "cpus": cpus}

    async def read_body(self, request: Request, limit: int) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit():
            check_size(int(declared), limit)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            check_size(len(body), limit)
        return bytes(body)


def onnx_deployment(model: str | os.PathLike, config: ServeConfig) -> Application:
    """The Serve application of an ONNX model exported by cim-int4: POST /v1/infer, GET /healthz."""
    api = FastAPI(title="cim-int4")
    path = os.fspath(Path(model).resolve())

    @serve.deployment(**config.deployment_options())
    @serve.ingress(api)
    class OnnxModel(Replica):
        def __init__(self) -> None:
            super().__init__(config.threads)
            self.session = make_session(
                path, threads=config.threads, pin=self.pin, compute=config.compute, oversubscribe=True
            )
            self.specs = input_specs(self.session)
            self.outputs = [o.name for o in self.session.get_outputs()]
            self.batching = config.max_batch > 1 and all(s.batchable for s in self.specs.values())
            self.largest_batch = 0  # requests in the largest batch so far (/healthz)
            self.infer_batch.set_max_batch_size(config.max_batch)
            self.infer_batch.set_batch_wait_timeout_s(config.batch_wait_ms / 1000)

        def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
            return self.session.run(self.outputs, feeds)

        def run_batch(self, requests: list[dict[str, np.ndarray]]) -> list[list[np.ndarray] | Exception]:
            """Run requests that differ only in rows as one call per group; a group that fails runs one by one."""
            groups: dict[tuple, list[int]] = {}
            for i, feeds in enumerate(requests):
                groups.setdefault(batch_key(feeds), []).append(i)
            results: list = [None] * len(requests)
            for members in groups.values():
                parts = None
                if len(members) > 1:
                    try:
                        outputs = self.run(concat([requests[i] for i in members]))
                        parts = split(outputs, [rows(requests[i]) for i in members])
                    except Exception:  # noqa: BLE001 - each request then meets its own error below
                        parts = None
                for slot, i in enumerate(members):
                    try:
                        results[i] = parts[slot] if parts is not None else self.run(requests[i])
                    except Exception as e:  # noqa: BLE001 - returned to that request's caller
                        results[i] = e
            return results

        @serve.batch(max_batch_size=DEFAULT_MAX_BATCH, batch_wait_timeout_s=DEFAULT_BATCH_WAIT_MS / 1000)
        async def infer_batch(self, requests: list[dict[str, np.ndarray]]) -> list:
            self.largest_batch = max(self.largest_batch, len(requests))
            return await self.on_worker(self.run_batch, requests)

        @api.get("/healthz")
        def healthz(self) -> dict:
            return {**self.health(), "batching": self.batching, "largest_batch": self.largest_batch}

        @api.post("/v1/infer")
        async def infer(self, request: Request) -> Response:
            try:
                body = await self.read_body(request, config.max_body)
                feeds, npz = parse_request(body, request.headers.get("content-type", ""), self.specs)
                if self.batching:
                    result = await self.infer_batch(feeds)
                else:
                    (result,) = await self.on_worker(self.run_batch, [feeds])
                if isinstance(result, Exception):
                    if not type(result).__module__.startswith("onnxruntime"):
                        raise result
                    # The checks above passed but ORT refused the values (e.g. an index out of range).
                    raise RequestError(f"onnxruntime refused the inputs: {result}")
            except RequestError as e:
                return _error(e)
            content, media_type = encode_outputs(self.outputs, result, npz)
            return Response(content, media_type=media_type)

    return OnnxModel.bind()


# ----------------------------------------------------------------------------- genai


@dataclass(frozen=True)
class GenerateRequest:
    """A checked /v1/generate body."""

    tokens: list[int] | None
    prompt: str | None
    max_tokens: int
    min_tokens: int
    stream: bool
    search: dict


_SEARCH_FIELDS = {"do_sample": bool, "temperature": float, "top_k": int, "top_p": float, "random_seed": int}
_GENERATE_FIELDS = {"prompt", "tokens", "max_tokens", "min_tokens", "stream", *_SEARCH_FIELDS}


def parse_generate(body: bytes) -> GenerateRequest:
    """Check a /v1/generate JSON body: prompt or tokens, max_tokens, min_tokens, stream and search options."""
    doc = load_json(body)
    if not isinstance(doc, dict):
        raise RequestError('body must be a JSON object like {"prompt": "...", "max_tokens": 32}')
    extra = sorted(set(doc) - _GENERATE_FIELDS)
    if extra:
        raise RequestError(f"field {extra[0]!r}: unknown (fields: {', '.join(sorted(_GENERATE_FIELDS))})")
    if ("prompt" in doc) == ("tokens" in doc):
        raise RequestError("give exactly one of 'prompt' (text) or 'tokens' (a list of token ids)")
    prompt, tokens = doc.get("prompt"), doc.get("tokens")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise RequestError("field 'prompt': expected a non-empty string")
    valid = isinstance(tokens, list) and tokens and all(type(t) is int and t >= 0 for t in tokens)
    if tokens is not None and not valid:
        raise RequestError("field 'tokens': expected a non-empty list of token ids (ints >= 0)")

    def number(name: str, kind: type, default: object, low: float | None = None) -> object:
        value = doc.get(name, default)
        ok = type(value) is kind or (kind is float and type(value) is int)
        if not ok or (low is not None and value < low):
            bound = "" if low is None else f" >= {low}"
            raise RequestError(f"field {name!r}: expected {kind.__name__}{bound}, got {json.dumps(value)}")
        return value

    search = {k: number(k, t, None) for k, t in _SEARCH_FIELDS.items() if k in doc}
    return GenerateRequest(
        tokens=tokens,
        prompt=prompt,
        max_tokens=number("max_tokens", int, 32, 1),
        min_tokens=number("min_tokens", int, 0, 0),
        stream=number("stream", bool, False),
        search=search,
    )


def genai_deployment(folder: str | os.PathLike, config: ServeConfig) -> Application:
    """The Serve application of an onnxruntime-genai folder (``cim-int4 genai``): POST /v1/generate, GET /healthz."""
    api = FastAPI(title="cim-int4 genai")
    path = os.fspath(Path(folder).resolve())

    @serve.deployment(**config.deployment_options())
    @serve.ingress(api)
    class GenaiModel(Replica):
        def __init__(self) -> None:
            super().__init__(config.threads)
            import onnxruntime_genai as og

            from ..genai_bench import load

            self.og = og
            self.model = load(path, threads=config.threads)
            self.tokenizer = og.Tokenizer(self.model)
            self.context = json.loads((Path(path) / CONFIG_NAME).read_text())["model"].get("context_length")

        def start(self, req: GenerateRequest):  # noqa: ANN201 - an onnxruntime_genai.Generator
            tokens = req.tokens if req.tokens is not None else list(self.tokenizer.encode(req.prompt))
            length = len(tokens) + req.max_tokens
            if self.context is not None and length > self.context:
                raise RequestError(
                    f"prompt ({len(tokens)} tokens) + max_tokens is {length}; the model's context "
                    f"length is {self.context}"
                )
            params = self.og.GeneratorParams(self.model)
            params.set_search_options(max_length=length, min_length=len(tokens) + req.min_tokens, **req.search)
            generator = self.og.Generator(self.model, params)
            generator.append_tokens(np.asarray(tokens, dtype=np.int32))
            return generator

        def step(self, generator) -> int | None:  # noqa: ANN001
            if generator.is_done():
                return None
            generator.generate_next_token()
            return int(generator.get_next_tokens()[0])

        async def tokens(self, generator):  # noqa: ANN001, ANN201 - an async iterator of (token, text)
            stream = self.tokenizer.create_stream()
            while (token := await self.on_worker(self.step, generator)) is not None:
                yield token, stream.decode(token)

        @api.get("/healthz")
        def healthz(self) -> dict:
            return self.health()

        @api.post("/v1/generate")
        async def generate(self, request: Request) -> Response:
            try:
                req = parse_generate(await self.read_body(request, config.max_body))
                generator = await self.on_worker(self.start, req)
            except RequestError as e:
                return _error(e)
            except Exception as e:  # noqa: BLE001 - genai's errors for a bad prompt are plain exceptions
                return _error(RequestError(f"onnxruntime-genai refused the request: {e}"))
            if req.stream:

                async def lines():  # noqa: ANN202
                    async for token, text in self.tokens(generator):
                        yield json.dumps({"token": token, "text": text}) + "\n"
                    yield json.dumps({"done": True}) + "\n"

                return StreamingResponse(lines(), media_type="application/x-ndjson")
            out = [(token, text) async for token, text in self.tokens(generator)]
            return JSONResponse({"tokens": [t for t, _ in out], "text": "".join(s for _, s in out)})

    return GenaiModel.bind()


def deploy(app: Application, access_log: bool = False) -> None:
    """Deploy (or redeploy) ``app`` at / on the running Serve instance and wait until its replicas are up.

    ``access_log``: Serve's log line per request, off by default: on a small machine it
    costs the replicas and the driver CPU time per request.
    """
    serve.run(app, name=APP_NAME, route_prefix="/", logging_config={"enable_access_log": access_log})


def build_app(model: str | os.PathLike, config: ServeConfig) -> Application:
    """The Serve application for ``model``: a genai folder or an ONNX file."""
    if is_genai_folder(model):
        return genai_deployment(model, config)
    if not Path(model).is_file():
        raise ValueError(f"{model}: neither an ONNX file nor an onnxruntime-genai folder (with {CONFIG_NAME})")
    return onnx_deployment(model, config)
