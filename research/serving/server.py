r"""OpenAI-compatible HTTP server over the continuous-batching engine.

    python -m research.serving.server --port=8000 --kv_codec=bf16 --n_blocks=512
    servax-serve --port=8000                     # the same, as a console script

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with SSE streaming and
`usage` incl. `prompt_tokens_details.cached_tokens`), GET /v1/models, GET /health,
GET /metrics (Prometheus text format, one CollectorRegistry per app).

Threading: one engine thread owns the engine (the api.py contract: every engine method is
called from one thread). HTTP handlers never touch the engine; they post commands
(add / abort) to the engine thread and receive `TokenEvent`s through per-request asyncio
queues (`loop.call_soon_threadsafe`). The thread drains commands, runs `engine.step()`
while the engine has work and sleeps on an event otherwise.

Errors: malformed JSON, unknown or bad fields, prompt too long -> 400 with an OpenAI-style
error body whose `param` names the field; unknown model -> 404; engine queue full
(QueueFullError) -> 429; engine dead -> 503. A client that disconnects (streaming or not)
has its request aborted, which frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import math
import queue
import random
import socket
import threading
import time
import uuid
from typing import Any, Callable, Sequence

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from research.serving.api import (EngineMetrics, QueueFullError, Request, RequestError,
                                  SamplingParams, TokenEvent)

# latency buckets (seconds) wide enough for a CPU-hosted model under load
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
MAX_STOP_STRINGS = 4  # as OpenAI
IDLE_WAIT_S = 0.05


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body; `param` names the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": None}}


class EngineDead(RuntimeError):
    """The engine thread stopped after an exception; the server answers 503."""


# --------------------------------------------------------------------------- engine loop


class EngineLoop:
    """The one thread that calls the engine; handlers talk to it through `submit`/`abort`."""

    def __init__(self, engine, *, idle_wait_s: float = IDLE_WAIT_S):
        self.engine = engine
        self._idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._subscribers: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._metrics = EngineMetrics()
        self.error: BaseException | None = None
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name="servax-engine", daemon=True)

    # -- called from handlers (any thread)
    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def metrics(self) -> EngineMetrics:
        with self._lock:
            return dataclasses.replace(self._metrics)

    def submit(self, request: Request, events: asyncio.Queue,
               loop: asyncio.AbstractEventLoop) -> concurrent.futures.Future:
        """Queue `request` for the engine; the future resolves once the engine accepted it
        (or raises QueueFullError / RequestError / EngineDead). Its TokenEvents are put on
        `events` in `loop`."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive:
            fut.set_exception(EngineDead(f"engine stopped: {self.error!r}"))
            return fut
        with self._lock:
            if request.request_id in self._subscribers:
                raise ValueError(f"duplicate request_id {request.request_id!r}")
            self._subscribers[request.request_id] = (loop, events)
        self._commands.put(("add", request, fut))
        self._wake.set()
        if not self.alive:  # died between the check above and the put: nobody will answer
            self._fail_future(fut)
        return fut

    def _fail_future(self, fut: concurrent.futures.Future) -> None:
        try:
            fut.set_exception(EngineDead(f"engine stopped: {self.error!r}"))
        except concurrent.futures.InvalidStateError:
            pass

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._subscribers.pop(request_id, None)
        self._commands.put(("abort", request_id, None))
        self._wake.set()

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run `fn(engine)` on the engine thread (e.g. a consistent read for tests)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", fn, fut))
        self._wake.set()
        return fut

    # -- the engine thread
    def _run(self) -> None:
        try:
            self._refresh_metrics()
            while not self._stop.is_set():
                self._drain_commands()
                if self.engine.has_work():
                    events = self.engine.step()
                    self.steps += 1
                    self._dispatch(events)
                    self._refresh_metrics()
                else:
                    self._refresh_metrics()
                    self._wake.wait(self._idle_wait_s)
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - reported to every waiting handler
            self.error = e
            logging.getLogger("servax.server").exception("engine thread stopped")
            self._fail_all(e)

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, payload, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    self.engine.add_request(payload)
                except (QueueFullError, RequestError) as e:
                    with self._lock:
                        self._subscribers.pop(payload.request_id, None)
                    fut.set_exception(e)
                else:
                    fut.set_result(None)
            elif kind == "abort":
                self.engine.abort(payload)
            elif kind == "call":
                try:
                    fut.set_result(payload(self.engine))
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)

    def _dispatch(self, events: Sequence[TokenEvent]) -> None:
        with self._lock:
            for ev in events:
                sub = self._subscribers.get(ev.request_id)
                if sub is None:
                    continue  # aborted by its client; the engine has been told
                loop, q = sub
                if ev.finish_reason is not None:
                    del self._subscribers[ev.request_id]
                try:
                    loop.call_soon_threadsafe(q.put_nowait, ev)
                except RuntimeError:  # the handler's event loop is closed
                    pass

    def _refresh_metrics(self) -> None:
        m = self.engine.metrics()
        with self._lock:
            self._metrics = m

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            subs, self._subscribers = self._subscribers, {}
        while True:
            try:
                kind, _, fut = self._commands.get_nowait()
            except queue.Empty:
                break
            if fut is not None:
                self._fail_future(fut)
        for loop, q in subs.values():
            try:
                loop.call_soon_threadsafe(q.put_nowait, EngineDead(repr(error)))
            except RuntimeError:
                pass


# --------------------------------------------------------------------------- metrics


def _make_metrics(engine_loop: EngineLoop):
    from prometheus_client import CollectorRegistry, Counter, Histogram
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    registry = CollectorRegistry()

    class EngineCollector:
        def collect(self):
            m = engine_loop.metrics()
            gauges = [
                ("servax_queue_length", "requests waiting for admission", m.queue_length),
                ("servax_running_requests", "requests holding a decode slot", m.running),
                ("servax_kv_blocks_used", "KV-cache blocks in use", m.kv_blocks_used),
                ("servax_kv_blocks_total", "KV-cache blocks in the pool", m.kv_blocks_total),
                ("servax_prefix_cache_hit_rate",
                 "prompt tokens served from the prefix cache / prompt tokens looked up",
                 m.prefix_cache_hits / m.prefix_cache_queries if m.prefix_cache_queries
                 else 0.0),
                ("servax_engine_alive", "1 while the engine thread runs",
                 1.0 if engine_loop.alive else 0.0),
            ]
            for name, doc, value in gauges:
                g = GaugeMetricFamily(name, doc)
                g.add_metric([], float(value))
                yield g
            counters = [
                ("servax_prefix_cache_hit_tokens", "prompt tokens served from cache",
                 m.prefix_cache_hits),
                ("servax_prefix_cache_query_tokens", "prompt tokens looked up",
                 m.prefix_cache_queries),
                ("servax_preemptions", "requests preempted for KV blocks", m.preemptions),
                ("servax_compiles", "engine program compilations", m.compiles),
                ("servax_engine_steps", "engine.step() calls", engine_loop.steps),
                ("servax_step_seconds", "wall time inside engine.step()", m.step_seconds),
                ("servax_step_forward_seconds",
                 "of it, forward calls (device work + waiting for tokens)", m.forward_seconds),
                ("servax_step_detokenize_seconds", "of it, detokenization and stop strings",
                 m.detokenize_seconds),
            ]
            for name, doc, value in counters:
                c = CounterMetricFamily(name, doc)
                c.add_metric([], float(value))
                yield c

    registry.register(EngineCollector())
    ttft = Histogram("servax_time_to_first_token_seconds", "arrival to first token",
                     buckets=TTFT_BUCKETS, registry=registry)
    tpot = Histogram("servax_time_per_output_token_seconds",
                     "(last token - first token) / (tokens - 1), per request",
                     buckets=TPOT_BUCKETS, registry=registry)
    finished = Counter("servax_requests", "finished requests by finish reason",
                       ["finish_reason"], registry=registry)
    rejected = Counter("servax_rejected_requests", "requests refused by HTTP status",
                       ["status"], registry=registry)
    return registry, ttft, tpot, finished, rejected


# --------------------------------------------------------------------------- validation


def _field(body: dict, name: str, kinds: tuple, default, what: str):
    if name not in body or body[name] is None:
        return default
    value = body[name]
    if isinstance(value, bool) and bool not in kinds:
        raise ApiError(400, f"{name} must be {what}, got {value!r}", name)
    if not isinstance(value, kinds):
        raise ApiError(400, f"{name} must be {what}, got {type(value).__name__} {value!r}"[:300],
                       name)
    return value


def _number(body, name, default, lo, hi):
    v = _field(body, name, (int, float), default, "a number")
    if not (math.isfinite(v) and lo <= v <= hi):
        raise ApiError(400, f"{name} must be in [{lo}, {hi}], got {v!r}", name)
    return float(v)


def _stop_list(body) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise ApiError(400, "stop must be a non-empty string or a list of non-empty strings",
                       "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise ApiError(400, f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}",
                       "stop")
    return tuple(stop)


# fields accepted only at their no-op value: anything else is refused, not ignored
_NOOP_FIELDS = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "top_logprobs": None,
                "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None,
                "suffix": None, "tools": None, "tool_choice": None, "response_format": None,
                "parallel_tool_calls": None, "functions": None, "function_call": None}
_COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                  "stream", "stream_options", "user", "stop_token_ids"}
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt"} | set(_NOOP_FIELDS)
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens"} | set(_NOOP_FIELDS)


def _check_fields(body: dict, allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ApiError(400, f"unrecognized request argument(s): {', '.join(unknown)}",
                       unknown[0])
    for name, noop in _NOOP_FIELDS.items():
        value = body.get(name)
        if value is None or value == noop or (noop is None and value in ({}, [], False)):
            continue
        raise ApiError(400, f"{name}={value!r} is not supported by this server "
                            f"(only {noop!r})"[:300], name)


@dataclasses.dataclass
class Parsed:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool


# --------------------------------------------------------------------------- the app


@dataclasses.dataclass
class ServerConfig:
    model_name: str = "SmolLM2-135M-Instruct"
    max_context: int = 2048  # prompt + max_tokens must fit; the engine may refuse sooner
    default_max_tokens: int = 256  # chat requests without max_tokens
    disconnect_poll_s: float = 0.25  # non-streaming requests check for a gone client


def create_app(engine_loop: EngineLoop, tokenizer, config: ServerConfig = ServerConfig()):
    """The FastAPI app. `engine_loop` must be started by the caller (see `serve_in_thread`)."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    app = FastAPI(title="servax", docs_url=None, redoc_url=None)
    registry, ttft_h, tpot_h, finished_c, rejected_c = _make_metrics(engine_loop)
    app.state.engine_loop, app.state.registry = engine_loop, registry
    created = int(time.time())
    stop_ids = _default_stop_ids(tokenizer)

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        rejected_c.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status)

    async def json_body(http: HttpRequest) -> dict:
        raw = await http.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"request body is not valid JSON: {e}", "body") from None
        if not isinstance(body, dict):
            raise ApiError(400, f"request body must be a JSON object, got "
                                f"{type(body).__name__}", "body")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(400, "model must be a non-empty string", "model")
        if model != config.model_name:
            raise ApiError(404, f"model {model!r} does not exist; this server serves "
                                f"{config.model_name!r}", "model", "not_found_error")
        return body

    def sampling(body: dict, n_prompt: int, max_tokens_field: str, default_max: int | None,
                 ) -> tuple[SamplingParams, bool, bool]:
        temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
        top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
        if top_p == 0.0:
            raise ApiError(400, "top_p must be in (0, 1], got 0", "top_p")
        top_k = _field(body, "top_k", (int,), 0, "an integer >= 0")
        if top_k < 0:
            raise ApiError(400, f"top_k must be an integer >= 0, got {top_k}", "top_k")
        seed = _field(body, "seed", (int,), None, "an integer")
        if seed is None:
            seed = random.getrandbits(31)
        elif not -2**63 <= seed < 2**63:
            raise ApiError(400, f"seed must fit in 64 bits, got {seed}", "seed")
        extra_stop = _field(body, "stop_token_ids", (list,), [], "a list of token ids")
        if not all(isinstance(t, int) and not isinstance(t, bool)
                   and 0 <= t < tokenizer.vocab_size for t in extra_stop):
            raise ApiError(400, f"stop_token_ids must be token ids in [0, "
                                f"{tokenizer.vocab_size})", "stop_token_ids")
        room = config.max_context - n_prompt
        if room < 1:
            raise ApiError(400, f"prompt is too long: {n_prompt} tokens, the server's context "
                                f"is {config.max_context} tokens (prompt + max_tokens)",
                           "prompt" if "prompt" in body else "messages")
        max_new = _field(body, max_tokens_field, (int,), None, "an integer >= 1")
        if max_new is None and max_tokens_field == "max_completion_tokens":
            max_new = _field(body, "max_tokens", (int,), None, "an integer >= 1")
            max_tokens_field = "max_tokens"
        if max_new is None:
            if default_max is None:  # chat: up to the context, at most the server default
                max_new = min(config.default_max_tokens, room)
            else:
                max_new = default_max
        if max_new < 1:
            raise ApiError(400, f"{max_tokens_field} must be an integer >= 1, got {max_new}",
                           max_tokens_field)
        if max_new > room:
            raise ApiError(400, f"{max_tokens_field}={max_new} does not fit: the prompt has "
                                f"{n_prompt} tokens and the context is {config.max_context} "
                                f"(at most {room} new tokens)", max_tokens_field)
        stream = _field(body, "stream", (bool,), False, "a boolean")
        opts = _field(body, "stream_options", (dict,), {}, "an object")
        if set(opts) - {"include_usage"}:
            raise ApiError(400, f"stream_options: unknown keys {sorted(set(opts))}",
                           "stream_options")
        if opts and not stream:
            raise ApiError(400, "stream_options is only allowed with stream=true",
                           "stream_options")
        include_usage = _field(opts, "include_usage", (bool,), False, "a boolean")
        try:
            params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                    seed=seed, max_new_tokens=max_new, stop=_stop_list(body),
                                    stop_token_ids=tuple(sorted(set(stop_ids) |
                                                                set(extra_stop))))
        except RequestError as e:
            raise ApiError(400, str(e), e.field) from None
        return params, stream, include_usage

    def parse_completion(body: dict) -> Parsed:
        _check_fields(body, COMPLETION_FIELDS)
        if "prompt" not in body:
            raise ApiError(400, "prompt is required", "prompt")
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, "prompt must not be empty", "prompt")
            try:
                ids = tokenizer.encode(prompt)
            except ValueError as e:
                raise ApiError(400, f"prompt: {e}", "prompt") from None
        elif isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < tokenizer.vocab_size]
            if bad:
                raise ApiError(400, f"prompt token ids {bad[:5]} are outside [0, "
                                    f"{tokenizer.vocab_size})", "prompt")
            ids = list(prompt)
        elif isinstance(prompt, list) and len(prompt) > 1:
            raise ApiError(400, f"prompt: batches of {len(prompt)} prompts are not supported; "
                                f"send one request per prompt", "prompt")
        else:
            raise ApiError(400, "prompt must be a non-empty string or a non-empty list of "
                                "token ids", "prompt")
        params, stream, include_usage = sampling(body, len(ids), "max_tokens", 16)
        return Parsed(ids, params, stream, include_usage)

    def parse_chat(body: dict) -> Parsed:
        _check_fields(body, CHAT_FIELDS)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list", "messages")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise ApiError(400, f"messages[{i}] must be an object", f"messages[{i}]")
            role, content = m.get("role"), m.get("content")
            if role not in ("system", "user", "assistant"):
                raise ApiError(400, f"messages[{i}].role must be system, user or assistant, "
                                    f"got {role!r}", f"messages[{i}].role")
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                parts = []
                for j, part in enumerate(content):
                    if not (isinstance(part, dict) and part.get("type") == "text"
                            and isinstance(part.get("text"), str)):
                        raise ApiError(400, f"messages[{i}].content[{j}] must be "
                                            f"{{'type': 'text', 'text': str}} (only text)",
                                       f"messages[{i}].content")
                    parts.append(part["text"])
                content = "".join(parts)
            if not isinstance(content, str):
                raise ApiError(400, f"messages[{i}].content must be a string",
                               f"messages[{i}].content")
            extra = set(m) - {"role", "content", "name"}
            if extra:
                raise ApiError(400, f"messages[{i}] has unsupported keys {sorted(extra)}",
                               f"messages[{i}]")
            clean.append({"role": role, "content": content})
        try:
            ids = encode_chat(tokenizer, clean)
        except ValueError as e:
            raise ApiError(400, f"messages: {e}", "messages") from None
        params, stream, include_usage = sampling(body, len(ids), "max_completion_tokens",
                                                 None)
        return Parsed(ids, params, stream, include_usage)

    async def start(request_id: str, parsed: Parsed) -> asyncio.Queue:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        req = Request(request_id, tuple(parsed.prompt_ids), parsed.params,
                      arrival_time=time.perf_counter())
        try:
            await asyncio.wrap_future(engine_loop.submit(req, events, loop))
        except QueueFullError as e:
            raise ApiError(429, f"server busy: {e}", None, "rate_limit_error") from None
        except RequestError as e:
            raise ApiError(400, str(e), e.field) from None
        except EngineDead as e:
            raise ApiError(503, f"engine unavailable: {e}", None, "server_error") from None
        except asyncio.CancelledError:
            engine_loop.abort(request_id)
            raise
        return events

    class Tracker:
        """Per-request timing for the TTFT/TPOT histograms and the usage block."""

        def __init__(self, t0: float):
            self.t0, self.first, self.last, self.n = t0, None, None, 0
            self.n_prompt = self.n_cached = 0

        def see(self, ev: TokenEvent) -> None:
            now = time.perf_counter()
            self.n_prompt = ev.n_prompt_tokens or self.n_prompt
            self.n_cached = ev.n_cached_prompt_tokens or self.n_cached
            if ev.token_id is not None:
                self.n += 1
                if self.first is None:
                    self.first = now
                    ttft_h.observe(now - self.t0)
                self.last = now
            if ev.finish_reason is not None:
                finished_c.labels(ev.finish_reason).inc()
                if self.n >= 2:
                    tpot_h.observe((self.last - self.first) / (self.n - 1))

        def usage(self) -> dict:
            return {"prompt_tokens": self.n_prompt, "completion_tokens": self.n,
                    "total_tokens": self.n_prompt + self.n,
                    "prompt_tokens_details": {"cached_tokens": self.n_cached}}

    async def next_event(events: asyncio.Queue) -> TokenEvent:
        ev = await events.get()
        if isinstance(ev, BaseException):
            raise ApiError(503, f"engine failed: {ev}", None, "server_error")
        return ev

    async def run(http: HttpRequest, parsed: Parsed, kind: str):
        t0 = time.perf_counter()
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        rid = f"{prefix}-{uuid.uuid4().hex}"
        obj = "chat.completion" if kind == "chat" else "text_completion"
        events = await start(rid, parsed)
        tracker = Tracker(t0)
        if parsed.stream:
            return StreamingResponse(
                stream(rid, events, tracker, kind, obj, parsed.include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        text, finish = [], None
        checked = time.perf_counter()
        try:
            while finish is None:
                try:
                    ev = await asyncio.wait_for(next_event(events), config.disconnect_poll_s)
                except asyncio.TimeoutError:
                    ev = None
                if time.perf_counter() - checked >= config.disconnect_poll_s:
                    checked = time.perf_counter()
                    if await http.is_disconnected():
                        engine_loop.abort(rid)
                        finished_c.labels("client_gone").inc()
                        return PlainTextResponse("", status_code=499)
                if ev is None:
                    continue
                tracker.see(ev)
                text.append(ev.text)
                finish = ev.finish_reason
        except BaseException:
            engine_loop.abort(rid)
            raise
        choice = {"index": 0, "finish_reason": finish, "logprobs": None}
        if kind == "chat":
            choice["message"] = {"role": "assistant", "content": "".join(text)}
        else:
            choice["text"] = "".join(text)
        return {"id": rid, "object": obj, "created": int(time.time()),
                "model": config.model_name, "choices": [choice], "usage": tracker.usage()}

    async def stream(rid, events, tracker, kind, obj, include_usage):
        obj_chunk = "chat.completion.chunk" if kind == "chat" else "text_completion"
        created = int(time.time())

        def chunk(choices, usage=None):
            d = {"id": rid, "object": obj_chunk, "created": created,
                 "model": config.model_name, "choices": choices}
            if include_usage:
                d["usage"] = usage
            return f"data: {json.dumps(d)}\n\n"

        done = False
        try:
            if kind == "chat":
                yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                              "finish_reason": None, "logprobs": None}])
            while not done:
                try:
                    ev = await next_event(events)
                except ApiError as e:
                    yield f"data: {json.dumps(e.body())}\n\n"
                    done = True
                    return
                tracker.see(ev)
                done = ev.finish_reason is not None
                if not ev.text and not done:
                    continue
                if kind == "chat":
                    delta = {"content": ev.text} if ev.text else {}
                    choice = {"index": 0, "delta": delta, "finish_reason": ev.finish_reason,
                              "logprobs": None}
                else:
                    choice = {"index": 0, "text": ev.text, "finish_reason": ev.finish_reason,
                              "logprobs": None}
                yield chunk([choice])
            if include_usage:
                yield chunk([], tracker.usage())
            yield "data: [DONE]\n\n"
        finally:
            if not done:  # the client went away (or the server is shutting down)
                engine_loop.abort(rid)
                finished_c.labels("client_gone").inc()

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        return await run(http, parse_completion(await json_body(http)), "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        return await run(http, parse_chat(await json_body(http)), "chat")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model",
                                            "created": created, "owned_by": "servax",
                                            "max_model_len": config.max_context}]}

    @app.get("/health")
    async def health():
        if not engine_loop.alive:
            return JSONResponse({"status": "error", "error": repr(engine_loop.error)},
                                status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(registry),
                                 headers={"Content-Type": CONTENT_TYPE_LATEST})

    return app


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` rendered with the model's chat template, where the
    template's own text may hold control tokens (<|im_start|>...) but message contents
    never do: a user who writes "<|im_end|>" gets those characters, not the token.

    Contents are replaced by sentinels, the template is rendered, and the pieces between
    sentinels (template text) are encoded with special tokens parsed, the contents as
    plain text. Templates that alter the content text (so a sentinel does not come out
    intact, once) are refused rather than mis-tokenized."""
    marks = [f"\x00servax-content-{i}\x00" for i in range(len(messages))]
    if any("\x00" in m["content"] for m in messages):
        raise ValueError("message content must not contain NUL characters")
    text = tokenizer.apply_chat_template(
        [{"role": m["role"], "content": mark} for m, mark in zip(messages, marks)],
        add_generation_prompt=True)
    ids: list[int] = []
    rest = text
    for m, mark in zip(messages, marks):
        if rest.count(mark) != 1:
            raise ValueError("the chat template does not copy message contents verbatim; "
                             "cannot keep control tokens out of user text")
        head, rest = rest.split(mark)
        ids += tokenizer.encode(head) if head else []
        if m["content"]:
            ids += tokenizer.encode(m["content"], parse_special=False)[
                1 if tokenizer.add_bos and tokenizer.bos_id is not None else 0:]
    if rest:
        ids += tokenizer.encode(rest)[1 if tokenizer.add_bos and tokenizer.bos_id is not None
                                      and ids else 0:]
    return ids


def _default_stop_ids(tokenizer) -> tuple[int, ...]:
    from research.serving.generate import default_stop_tokens
    return default_stop_tokens(tokenizer)


# --------------------------------------------------------------------------- running


class ServerThread:
    """uvicorn serving `app` on a bound socket, in a background thread (tests, benchmarks).

        with ServerThread(app, "127.0.0.1", 0) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import uvicorn
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="servax-uvicorn", daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


KV_CODECS = ("f32", "bf16", "int8", "tasq-1bit")


def kv_codec_model(model, tokenizer, kv_codec: str, *, seed: int = 0,
                   calibration_seqs: int = 16, calibration_len: int = 256):
    """`model` with its KV cache stored by `kv_codec` (f32 / bf16 / int8 / tasq-1bit).

    tasq-1bit calibrates TaSQ (1 bit per channel, TaSQConfig's default pre-RoPE keys) on
    the calibration split
    of the embedded corpus (research/data.py), never on text it is evaluated on."""
    from research.transforms import CalibrationData, calibrate_and_apply
    if kv_codec not in KV_CODECS:
        raise ValueError(f"kv_codec must be one of {KV_CODECS}, got {kv_codec!r}")
    if kv_codec == "f32":
        return model
    if kv_codec == "bf16":
        from research.model.precision import kv_cache_dtype
        return calibrate_and_apply(kv_cache_dtype("bfloat16"), model, None)[0]
    if kv_codec == "int8":
        from research.tasq import int8_kv
        return calibrate_and_apply(int8_kv(), model, None)[0]
    from research import data
    from research.tasq import TaSQConfig, tasq
    ids = tokenizer.encode(data.corpus_text("calibration"))
    cal = CalibrationData.from_ids(ids, calibration_len, calibration_seqs)
    return calibrate_and_apply(tasq(TaSQConfig(bits=1, seed=seed)), model, cal)[0]


def build_engine(model, tokenizer, *, kv_codec: str = "bf16", n_blocks: int = 512,
                 block_size: int = 16, max_batch: int = 8, max_len: int = 1024,
                 max_queue: int = 64, speculative: int = 0, prefix_cache: bool = True,
                 token_budget: int = 256, prefill_chunk: int = 64, seed: int = 0):
    """A warmed-up ServingEngine over `model` with KV pages stored by `kv_codec`."""
    from research.serving.engine import ServingEngine
    served = kv_codec_model(model, tokenizer, kv_codec, seed=seed)
    return ServingEngine(served, tokenizer, n_blocks=n_blocks, block_size=block_size,
                         max_batch=max_batch, max_len=max_len, token_budget=token_budget,
                         prefill_chunk=prefill_chunk, max_queue=max_queue,
                         prefix_cache=prefix_cache, speculative=speculative)


def main(argv):
    del argv
    from absl import flags
    import uvicorn

    f = flags.FLAGS
    from research.model import load

    model, tokenizer = load(f.gguf or None)
    engine = build_engine(
        model, tokenizer, kv_codec=f.kv_codec, n_blocks=f.n_blocks, block_size=f.block_size,
        max_batch=f.max_batch, max_len=f.max_len, max_queue=f.max_queue,
        speculative=f.speculative_tokens if f.speculative else 0,
        prefix_cache=f.prefix_cache, token_budget=f.token_budget,
        prefill_chunk=f.prefill_chunk, seed=f.seed)
    engine_loop = EngineLoop(engine).start()
    cfg = ServerConfig(model_name=f.model_name, max_context=f.max_len,
                       default_max_tokens=f.default_max_tokens)
    app = create_app(engine_loop, tokenizer, cfg)
    print(f"servax: serving {f.model_name} on http://{f.host}:{f.port} "
          f"(kv_codec={f.kv_codec}, n_blocks={f.n_blocks}, max_batch={f.max_batch}, "
          f"max_queue={f.max_queue}, speculative={f.speculative})", flush=True)
    try:
        uvicorn.run(app, host=f.host, port=f.port, log_level=f.log_level)
    finally:
        engine_loop.stop()


def define_flags() -> None:
    from absl import flags
    flags.DEFINE_string("host", "127.0.0.1", "interface to bind")
    flags.DEFINE_integer("port", 8000, "TCP port")
    flags.DEFINE_string("gguf", "", "llama-architecture GGUF; default: embedded SmolLM2")
    flags.DEFINE_string("model_name", "SmolLM2-135M-Instruct", "the `model` clients send")
    flags.DEFINE_enum("kv_codec", "bf16", list(KV_CODECS), "KV-cache page codec")
    flags.DEFINE_integer("n_blocks", 512, "KV-cache blocks in the pool")
    flags.DEFINE_integer("block_size", 16, "tokens per KV block")
    flags.DEFINE_integer("max_batch", 8, "decode slots (requests running at once)")
    flags.DEFINE_integer("max_queue", 64, "waiting requests before 429")
    flags.DEFINE_integer("max_len", 1024, "prompt + max_tokens per request")
    flags.DEFINE_integer("token_budget", 256, "tokens per engine step (decode + prefill)")
    flags.DEFINE_integer("prefill_chunk", 64, "prompt tokens per prefill row per step")
    flags.DEFINE_bool("speculative", False, "speculative decoding inside the engine "
                      "(prompt-lookup drafts, greedy requests)")
    flags.DEFINE_integer("speculative_tokens", 4, "draft tokens per step with --speculative")
    flags.DEFINE_bool("prefix_cache", True, "reuse KV blocks of shared prompt prefixes")
    flags.DEFINE_integer("default_max_tokens", 256, "chat max_tokens when a request has none")
    flags.DEFINE_integer("seed", 0, "engine seed")
    flags.DEFINE_string("log_level", "info", "uvicorn log level")


def run() -> None:
    """Console-script entry point (`servax-serve`)."""
    from absl import app
    define_flags()
    app.run(main)


if __name__ == "__main__":
    run()
