r"""OpenAI-compatible HTTP server over the continuous-batching engine.

    python -m research.serving.server --port=8000 --kv_codec=bf16 --n_blocks=512
    servax-serve --port=8000                     # the same, as a console script

Endpoints (research/serving/routers.py; request/response models in protocol.py):
  POST /v1/completions       prompt: a string, token ids, or a batch of either (one
                             choice per prompt x n, with its `index`); SSE streaming;
                             `echo` + `logprobs` (0-20) scores the prompt (with max_tokens
                             0: one prefill, no decode); `usage` incl. cached_tokens
  POST /v1/chat/completions  chat template; n; logprobs / top_logprobs
  both: temperature, top_p, top_k, seed, stop, stop_token_ids, presence_penalty,
        frequency_penalty, repetition_penalty, logit_bias (per request in the batch)
  POST /tokenize, POST /detokenize, GET /tokenizer_info   vLLM's shapes
  GET /v1/models (with max_model_len), GET /health, GET /metrics (Prometheus text format,
  one CollectorRegistry per app)
lm-evaluation-harness runs against it as `lm_eval --model local-completions --batch_size 4
--model_args base_url=http://HOST:PORT/v1/completions,model=NAME,tokenizer_backend=remote,
max_length=MAX_LEN` (MAX_LEN = --max_len; the full command: tests/serving/test_lm_eval.py).

Modules: server.py (this: the app, metrics, uvicorn, flags), routers.py (endpoints),
protocol.py (pydantic models), state.py (ServerConfig / ServerState the routers share),
engine_loop.py (the engine thread), chat_template.py (chat messages -> token ids).

Threading: one engine thread owns the engine (the api.py contract: every engine method is
called from one thread; research/serving/engine_loop.py). HTTP handlers never touch the
engine; they post commands (add / abort) to the engine thread and receive `TokenEvent`s
through per-request asyncio queues (`loop.call_soon_threadsafe`).

Errors: malformed JSON, unknown or bad fields, prompt too long -> 400 with an OpenAI-style
error body whose `param` names the field (fields OpenAI defines that are not implemented,
e.g. tools, suffix, echo with stream, are refused, never ignored); a body
nested deeper than 64 levels -> 400, larger than --max_body_bytes -> 413; missing or
wrong API key (--api_key) -> 401; unknown model -> 404; a POST body that is not
Content-Type application/json (or application/*+json) -> 415; engine queue full
(QueueFullError) -> 429; a request the engine fails alone (an exception while taking it
or building its rows: engine.py's RequestFailed) -> 500 for that request, the engine
serves on; engine dead (any other exception on the engine thread) -> 503. A client that
disconnects (streaming or not) has its request aborted, which frees its KV blocks.
"""
from __future__ import annotations

import dataclasses
import hmac
import socket
import threading
import time

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse

from research.serving import kv_codecs
from research.serving.engine_loop import EngineLoop
from research.serving.protocol import MAX_BODY_BYTES, ApiError
from research.serving.routers import admin_router, openai_router, tokenizer_router
from research.serving.state import ServerConfig, ServerMetrics, ServerState

# latency buckets (seconds) wide enough for a CPU-hosted model under load
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


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
    return ServerMetrics(registry, ttft, tpot, finished, rejected)


# --------------------------------------------------------------------------- the app


OPEN_PATHS = ("/health", "/metrics")


def create_app(engine_loop: EngineLoop, tokenizer, config: ServerConfig = ServerConfig()):
    """The FastAPI app: the routers of research/serving/routers.py over one state.
    `engine_loop` must be started by the caller."""
    from fastapi.exceptions import RequestValidationError

    from research.decode.generate import default_stop_tokens

    app = FastAPI(title="servax", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = _make_metrics(engine_loop)
    registry, rejected_c = metrics.registry, metrics.rejected
    max_queue = getattr(engine_loop.engine, "max_queue", None)
    if max_queue is not None and config.max_choices > max_queue:
        config = dataclasses.replace(config, max_choices=max_queue)
    app.state.engine_loop, app.state.registry = engine_loop, registry
    state = ServerState(engine_loop, tokenizer, config, metrics, default_stop_tokens(tokenizer),
                        int(time.time()))

    def error(e: ApiError) -> JSONResponse:
        rejected_c.labels(str(e.status)).inc()
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return error(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, e):  # not reached by the routers (they parse bodies)
        return error(ApiError(400, str(e)[:300], None))

    @app.exception_handler(404)
    async def _not_found(http, _):
        return error(ApiError(404, f"no route {http.method} {http.url.path}", None,
                              "not_found_error"))

    @app.exception_handler(405)
    async def _bad_method(http, _):
        return error(ApiError(405, f"{http.method} is not allowed on {http.url.path}", None))

    if config.api_key:
        expected = f"Bearer {config.api_key}".encode()

        @app.middleware("http")
        async def _auth(http: HttpRequest, call_next):
            if http.url.path not in OPEN_PATHS:
                got = http.headers.get("authorization", "").encode()
                if not hmac.compare_digest(got, expected):
                    return error(ApiError(401, "missing or wrong API key: send "
                                               "'Authorization: Bearer <key>'", None,
                                          "invalid_request_error", "invalid_api_key"))
            return await call_next(http)

    for router in (openai_router(state), tokenizer_router(state), admin_router(state)):
        app.include_router(router)
    return app


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


def kv_codec_model(model, tokenizer, kv_codec: str, *, seed: int = 0,
                   calibration_seqs: int = 16, calibration_len: int = 256):
    """`model` with its KV cache stored by the registered codec `kv_codec`
    (research/serving/kv_codecs.py: f32, bf16, int8, tasq-1bit, ...); a servable one
    (pages=True). Calibrated codecs (TaSQ: TaSQConfig's default pre-RoPE keys) calibrate on
    the calibration split of the embedded corpus (research/data.py), never on text they are
    evaluated on."""
    if kv_codec not in kv_codecs.names(pages=True):
        raise ValueError(f"kv_codec must be one of {kv_codecs.names(pages=True)} (the "
                         f"registered codecs the engine can serve), got {kv_codec!r}")
    return kv_codecs.served_model(model, tokenizer, kv_codec, seed=seed,
                                  calibration_seqs=calibration_seqs,
                                  calibration_len=calibration_len)


def build_engine(model, tokenizer, *, kv_codec: str = "bf16", n_blocks: int = 512,
                 block_size: int = 16, max_batch: int = 8, max_len: int = 1024,
                 max_queue: int = 64, speculative: int = 0, prefix_cache: bool = True,
                 token_budget: int = 256, prefill_chunk: int = 64, seed: int = 0,
                 warmup_scoring: bool = False):
    """A warmed-up ServingEngine over `model` with KV pages stored by `kv_codec`
    (`warmup_scoring`: also compile the scoring / logprobs / penalty programs up front)."""
    from research.serving.engine import ServingEngine
    served = kv_codec_model(model, tokenizer, kv_codec, seed=seed)
    return ServingEngine(served, tokenizer, n_blocks=n_blocks, block_size=block_size,
                         max_batch=max_batch, max_len=max_len, token_budget=token_budget,
                         prefill_chunk=prefill_chunk, max_queue=max_queue,
                         prefix_cache=prefix_cache, speculative=speculative,
                         warmup_scoring=warmup_scoring)


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
        prefill_chunk=f.prefill_chunk, seed=f.seed, warmup_scoring=f.warmup_scoring)
    engine_loop = EngineLoop(engine).start()
    cfg = ServerConfig(model_name=f.model_name, max_context=f.max_len,
                       default_max_tokens=f.default_max_tokens, api_key=f.api_key or None,
                       max_body_bytes=f.max_body_bytes)
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
    flags.DEFINE_enum("kv_codec", "bf16", list(kv_codecs.names(pages=True)),
                      "KV-cache page codec (research/serving/kv_codecs.py): " + "; ".join(
                          f"{n}: {kv_codecs.get(n).summary}"
                          for n in kv_codecs.names(pages=True)))
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
    flags.DEFINE_string("api_key", "", "if set, require 'Authorization: Bearer <api_key>' "
                        "(every endpoint but /health and /metrics)")
    flags.DEFINE_integer("max_body_bytes", MAX_BODY_BYTES, "request bodies above this "
                         "size get 413")
    flags.DEFINE_bool("warmup_scoring", True, "compile the scoring / logprobs / penalty "
                      "programs at start-up (else on their first request)")


def run() -> None:
    """Console-script entry point (`servax-serve`)."""
    from absl import app
    define_flags()
    app.run(main)


if __name__ == "__main__":
    run()
