"""The server's routers, one per endpoint family, over one shared `ServerState`:

  openai_router     POST /v1/completions, POST /v1/chat/completions
  tokenizer_router  POST /tokenize, POST /detokenize, GET /tokenizer_info (vLLM's shapes,
                    what lm-evaluation-harness's `tokenizer_backend=remote` calls)
  admin_router      GET /v1/models, GET /health, GET /metrics

Requests are parsed by research/serving/protocol.py's pydantic models; one completion
request becomes one engine `Request` per prompt x choice (`n`), all submitted at once
(batched prompts share the engine's batch and prefix cache), their events gathered from
one queue. Scoring: `echo` + `logprobs` returns the prompt tokens' logprobs, computed by
the engine in the prompt's prefill (`SamplingParams.prompt_logprobs`); with max_tokens 0
nothing is decoded.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import time
import uuid
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from research.decode.sampling import sampling_bound
from research.serving import protocol as P
from research.serving.api import (QueueFullError, Request, RequestError, SamplingParams,
                                  TokenEvent)
from research.serving.chat_template import chat_messages, encode_chat
from research.serving.engine_loop import EngineDead
from research.serving.protocol import ApiError
from research.serving.state import ServerState


async def read_body(http: HttpRequest, limit: int) -> bytes:
    """The JSON request body: 415 unless its Content-Type is JSON, 413 once it exceeds
    `limit` bytes (header or stream)."""
    P.check_json_content_type(http.headers.get("content-type"))
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {declared} bytes exceeds the limit of {limit}",
                       "body")
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes", "body")
        chunks.append(chunk)
    return b"".join(chunks)


async def parse(http: HttpRequest, state: ServerState, model_cls: type[BaseModel]):
    body = P.parse_json_object(await read_body(http, state.config.max_body_bytes))
    try:
        req = model_cls.model_validate(body)
    except ValidationError as e:
        raise P.validation_error(e) from None
    check_model(state, getattr(req, "model", None), required="model" in model_cls.model_fields
                and model_cls.model_fields["model"].is_required())
    return req


def check_model(state: ServerState, model: str | None, required: bool) -> None:
    if model is None and not required:
        return
    if model != state.config.model_name:
        raise ApiError(404, f"model {model!r} does not exist; this server serves "
                            f"{state.config.model_name!r}", "model", "not_found_error")


# --------------------------------------------------------------------------- requests


@dataclasses.dataclass
class Job:
    """One engine request of an HTTP request: its choice index and its prompt."""

    rid: str
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    echo: bool = False
    prompt_text: str | None = None  # the prompt as sent, when it was text (echo)
    # gathered
    tokens: list[int] = dataclasses.field(default_factory=list)
    text: list[str] = dataclasses.field(default_factory=list)
    lps: list = dataclasses.field(default_factory=list)  # (token, logprob, top) per token
    prompt_lps: Any = None  # api.TopLogprobs
    finish: str | None = None
    n_prompt: int = 0
    n_cached: int = 0


def _prompts(state: ServerState, req: P.CompletionRequest
             ) -> list[tuple[list[int], str | None]]:
    tok, vocab = state.tokenizer, state.tokenizer.vocab_size
    p = req.prompt
    if isinstance(p, str) or (p and isinstance(p[0], int)):
        p = [p]
    if not p:
        raise ApiError(400, "prompt must not be empty", "prompt")
    out = []
    for i, one in enumerate(p):
        where = "prompt" if len(p) == 1 else f"prompt[{i}]"
        if isinstance(one, str):
            if not one:
                raise ApiError(400, f"{where} must not be empty", "prompt")
            try:
                ids = tok.encode(one)
            except ValueError as e:
                raise ApiError(400, f"{where}: {e}", "prompt") from None
        else:
            ids = list(one)
            if not ids:
                raise ApiError(400, f"{where} must not be empty", "prompt")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ApiError(400, f"{where}: token ids {bad[:5]} are outside [0, {vocab})",
                               "prompt")
        out.append((ids, one if isinstance(one, str) else None))
    return out


def _params(state: ServerState, req: P._Sampling, n_prompt: int, max_new: int | None,
            max_field: str, default_max: int | None, seed: int, *, logprobs=None,
            prompt_logprobs=None, prompt_field: str = "prompt") -> SamplingParams:
    cfg = state.config
    room = cfg.max_context - n_prompt
    if room < 1:
        raise ApiError(400, f"prompt is too long: {n_prompt} tokens, the server's context is "
                            f"{cfg.max_context} tokens (prompt + max_tokens)", prompt_field)
    if max_new is None:
        max_new = default_max if default_max is not None else min(cfg.default_max_tokens, room)
    if max_new == 0 and prompt_logprobs is None:
        raise ApiError(400, f"{max_field}=0 is only allowed with echo and logprobs (scoring)",
                       max_field)
    if max_new > room:
        raise ApiError(400, f"{max_field}={max_new} does not fit: the prompt has {n_prompt} "
                            f"tokens and the context is {cfg.max_context} (at most {room} new "
                            f"tokens)", max_field)
    vocab = state.tokenizer.vocab_size
    top_k = max(0, req.top_k or 0)  # -1 (vLLM's off) is 0
    bound = sampling_bound("top_k", top_k, vocab_size=vocab)
    if bound is not None:
        raise ApiError(400, f"top_k {bound}, got {req.top_k}", "top_k")
    extra = list(req.stop_token_ids or [])
    if not all(0 <= t < vocab for t in extra):
        raise ApiError(400, f"stop_token_ids must be token ids in [0, {vocab})",
                       "stop_token_ids")
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_k=top_k, top_p=1.0 if req.top_p is None else req.top_p,
            seed=seed, max_new_tokens=max_new, stop=req.stop_list(),
            stop_token_ids=tuple(sorted(set(state.stop_ids) | set(extra))),
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty, logit_bias=req.bias_pairs(vocab))
    except RequestError as e:
        raise ApiError(400, str(e), e.field) from None


def _seeds(req: P._Sampling, count: int) -> list[int]:
    """One seed per choice: `seed`, seed + 1, ... (distinct samples for n > 1)."""
    if req.seed is None:
        return [random.getrandbits(31) for _ in range(count)]
    return [req.seed + j for j in range(count)]


def _stream_flags(req: P._Sampling) -> bool:
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed with stream=true", "stream_options")
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)


def completion_jobs(state: ServerState, req: P.CompletionRequest) -> list[Job]:
    req.refuse_noops()
    if req.best_of not in (None, req.n):
        raise P.unsupported("best_of", req.best_of, " (only best_of == n)")
    if req.stream and req.echo:
        raise ApiError(400, "echo is not supported with stream=true", "echo")
    prompts = _prompts(state, req)
    if len(prompts) * req.n > state.config.max_choices:
        raise ApiError(400, f"{len(prompts)} prompts x n={req.n} exceeds the server's "
                            f"{state.config.max_choices} choices per request", "prompt")
    scoring = req.echo and req.logprobs is not None
    if req.max_tokens == 0 and not scoring:
        raise ApiError(400, "max_tokens=0 is only allowed with echo and logprobs (scoring)",
                       "max_tokens")
    jobs = []
    seeds = _seeds(req, req.n)
    prefix = f"cmpl-{uuid.uuid4().hex}"
    for i, (ids, text) in enumerate(prompts):
        for j in range(req.n):
            params = _params(state, req, len(ids), req.max_tokens, "max_tokens", 16, seeds[j],
                             logprobs=req.logprobs,
                             prompt_logprobs=req.logprobs if scoring else None)
            jobs.append(Job(f"{prefix}-{i}-{j}", i * req.n + j, ids, params, echo=req.echo,
                            prompt_text=text))
    return jobs


def chat_jobs(state: ServerState, req: P.ChatCompletionRequest) -> list[Job]:
    req.refuse_noops()
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs=true", "top_logprobs")
    if req.n > state.config.max_choices:
        raise ApiError(400, f"n={req.n} exceeds the server's {state.config.max_choices} "
                            f"choices per request", "n")
    try:
        ids = encode_chat(state.tokenizer, chat_messages(req.messages))
    except ValueError as e:
        raise ApiError(400, f"messages: {e}", "messages") from None
    if req.max_completion_tokens is not None:
        max_new, field = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_new, field = req.max_tokens, "max_tokens"
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    prefix = f"chatcmpl-{uuid.uuid4().hex}"
    return [Job(f"{prefix}-{j}", j, ids,
                _params(state, req, len(ids), max_new, field, None, seed, logprobs=logprobs,
                        prompt_field="messages"))
            for j, seed in enumerate(_seeds(req, req.n))]


# --------------------------------------------------------------------------- running


class Run:
    """The engine requests of one HTTP request: submitted together, events on one queue."""

    def __init__(self, state: ServerState, jobs: list[Job], n_per_prompt: int = 1):
        self.state, self.jobs, self.n_per_prompt = state, jobs, n_per_prompt
        self.by_rid = {j.rid: j for j in jobs}
        self.events: asyncio.Queue = asyncio.Queue()
        self.t0 = time.perf_counter()
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.open = set(self.by_rid)

    async def submit(self) -> None:
        """Submit every job at once (one engine step takes them all); if any is refused,
        all are aborted and the first refusal is the answer."""
        loop = asyncio.get_running_loop()
        engine_loop = self.state.engine_loop
        futures = []
        try:
            for job in self.jobs:
                req = Request(job.rid, tuple(job.prompt_ids), job.params, arrival_time=self.t0)
                futures.append(asyncio.wrap_future(engine_loop.submit(req, self.events, loop)))
            results = await asyncio.gather(*futures, return_exceptions=True)
        except BaseException:
            self.abort()
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if not errors:
            return
        self.abort()
        e = errors[0]
        if isinstance(e, QueueFullError):
            raise ApiError(429, f"server busy: {e}", None, "rate_limit_error") from None
        if isinstance(e, RequestError):
            raise ApiError(400, str(e), e.field) from None
        if isinstance(e, EngineDead):
            raise ApiError(503, f"engine unavailable: {e}", None, "server_error") from None
        raise ApiError(500, f"the engine could not take the request: {e!r}"[:500], None,
                       "server_error") from None

    def abort(self) -> None:
        for rid in self.open:
            self.state.engine_loop.abort(rid)
        self.open.clear()

    async def next_event(self, timeout: float | None = None) -> TokenEvent | None:
        try:
            ev = await asyncio.wait_for(self.events.get(), timeout)
        except asyncio.TimeoutError:
            return None
        if isinstance(ev, BaseException):
            raise ApiError(503, f"engine failed: {ev}", None, "server_error")
        if ev.finish_reason == "error":  # this request failed inside the engine's step
            self.open.discard(ev.request_id)
            self.state.metrics.finished.labels("error").inc()
            raise ApiError(500, f"the engine failed this request: {ev.error}"[:500], None,
                           "server_error")
        self.see(ev)
        return ev

    def see(self, ev: TokenEvent) -> None:
        job = self.by_rid[ev.request_id]
        _, ttft_h, tpot_h, finished_c, _ = self.state.metrics
        now = time.perf_counter()
        job.n_prompt = ev.n_prompt_tokens or job.n_prompt
        job.n_cached = ev.n_cached_prompt_tokens or job.n_cached
        if ev.prompt_logprobs is not None:
            job.prompt_lps = ev.prompt_logprobs
        if ev.token_id is not None:
            job.tokens.append(ev.token_id)
            if ev.request_id not in self.first:
                self.first[ev.request_id] = now
                ttft_h.observe(now - self.t0)
            self.last[ev.request_id] = now
        tok = ev.token_id if ev.token_id is not None else ev.stop_token_id
        if tok is not None and ev.logprob is not None:
            job.lps.append((tok, ev.logprob, ev.top_logprobs))
        job.text.append(ev.text)
        if ev.finish_reason is not None:
            job.finish = ev.finish_reason
            self.open.discard(ev.request_id)
            finished_c.labels(ev.finish_reason).inc()
            n = len(job.tokens)
            if n >= 2:
                tpot_h.observe((self.last[ev.request_id] - self.first[ev.request_id]) / (n - 1))

    def usage(self) -> P.Usage:
        seen, prompt, cached = set(), 0, 0
        for job in self.jobs:  # a prompt counts once, whatever its n
            key = job.index // self.n_per_prompt
            if key not in seen:
                seen.add(key)
                prompt += job.n_prompt or len(job.prompt_ids)
                cached += job.n_cached
        completion = sum(len(j.tokens) for j in self.jobs)
        return P.Usage(prompt_tokens=prompt, completion_tokens=completion,
                       total_tokens=prompt + completion,
                       prompt_tokens_details=P.PromptTokensDetails(cached_tokens=cached))

    async def gather(self, http: HttpRequest) -> bool:
        """Wait for every job's last event; False if the client went away (aborted)."""
        poll = self.state.config.disconnect_poll_s
        checked = time.perf_counter()
        try:
            while self.open:
                await self.next_event(poll)
                if time.perf_counter() - checked >= poll:
                    checked = time.perf_counter()
                    if await http.is_disconnected():
                        self.state.metrics.finished.labels("client_gone").inc()
                        self.abort()
                        return False
        except BaseException:
            self.abort()
            raise
        return True


def _top_dict(state: ServerState, top, k: int, own: tuple[int, float] | None) -> dict:
    d = {}
    for tid, lp in list(top)[:k]:
        d.setdefault(state.token_str(int(tid)), float(lp))
    if own is not None:  # the chosen token is always listed (as vLLM does)
        d.setdefault(state.token_str(own[0]), own[1])
    return d


def completion_logprobs(state: ServerState, job: Job, k: int) -> P.CompletionLogprobs:
    tokens, token_lps, tops = [], [], []
    if job.echo:
        pl = job.prompt_lps
        for pos, tid in enumerate(job.prompt_ids):
            tokens.append(tid)
            if pos == 0 or pl is None or math.isnan(float(pl.token_logprobs[pos])):
                token_lps.append(None)
                tops.append(None)
                continue
            lp = float(pl.token_logprobs[pos])
            token_lps.append(lp)
            tops.append(_top_dict(state, zip(pl.top_ids[pos], pl.top_logprobs[pos]), k,
                                  (tid, lp)))
    for tid, lp, top in job.lps:
        tokens.append(tid)
        token_lps.append(float(lp))
        tops.append(_top_dict(state, top or (), k, (tid, float(lp))))
    strs = [state.token_str(t) for t in tokens]
    offsets, at = [], 0
    for s in strs:
        offsets.append(at)
        at += len(s)
    return P.CompletionLogprobs(tokens=strs, token_logprobs=token_lps, top_logprobs=tops,
                                text_offset=offsets)


def chat_token_logprob(state: ServerState, tid: int, lp: float, top, k: int
                       ) -> P.TokenLogprob:
    def entry(t, v):
        s = state.token_str(int(t))
        return {"token": s, "logprob": float(v), "bytes": list(s.encode("utf-8"))}

    return P.TokenLogprob(**entry(tid, lp), top_logprobs=[P.TopLogprob(**entry(t, v))
                                                          for t, v in list(top or ())[:k]])


def chat_logprobs(state: ServerState, job: Job, k: int) -> P.ChatLogprobs:
    return P.ChatLogprobs(content=[chat_token_logprob(state, tid, lp, top, k)
                                   for tid, lp, top in job.lps])


def _response(model: BaseModel) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json"))


# --------------------------------------------------------------------------- routers


def openai_router(state: ServerState) -> APIRouter:
    router = APIRouter()
    cfg = state.config

    async def run_jobs(http: HttpRequest, jobs: list[Job], kind: str, include_usage: bool,
                       stream: bool, n_per_prompt: int, finish, k: int | None = None):
        run = Run(state, jobs, n_per_prompt)
        await run.submit()
        if stream:
            return StreamingResponse(_stream(run, kind, include_usage, k),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"})
        if not await run.gather(http):
            return PlainTextResponse("", status_code=499)
        return _response(finish(run))

    async def _stream(run: Run, kind: str, include_usage: bool, k: int | None):
        """SSE chunks; with logprobs (k alternatives), each generated token's (also on a
        chunk whose text is held back, e.g. a possible stop string's prefix)."""
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        rid = run.jobs[0].rid.rsplit("-", 1 if kind == "chat" else 2)[0]
        created = int(time.time())

        def chunk(choices, usage=None):
            d = {"id": rid, "object": obj, "created": created, "model": cfg.model_name,
                 "choices": choices}
            if include_usage:
                d["usage"] = usage
            return f"data: {json.dumps(d)}\n\n"

        offsets = {job.rid: 0 for job in run.jobs}

        def logprobs(ev: TokenEvent):
            tok = ev.token_id if ev.token_id is not None else ev.stop_token_id
            if k is None or tok is None or ev.logprob is None:
                return None
            if kind == "chat":
                return {"content": [chat_token_logprob(state, tok, ev.logprob,
                                                       ev.top_logprobs, k).model_dump()]}
            s, at = state.token_str(tok), offsets[ev.request_id]
            offsets[ev.request_id] += len(s)
            return {"tokens": [s], "token_logprobs": [float(ev.logprob)],
                    "top_logprobs": [_top_dict(state, ev.top_logprobs or (), k,
                                               (tok, float(ev.logprob)))],
                    "text_offset": [at]}

        done = False
        try:
            if kind == "chat":
                for job in run.jobs:
                    yield chunk([{"index": job.index,
                                  "delta": {"role": "assistant", "content": ""},
                                  "finish_reason": None, "logprobs": None}])
            while run.open:
                try:
                    ev = await run.next_event()
                except ApiError as e:
                    run.abort()  # the run's other choices, if any
                    yield f"data: {json.dumps(e.body())}\n\n"
                    done = True
                    return
                lp = logprobs(ev)
                if not ev.text and ev.finish_reason is None and lp is None:
                    continue
                index = run.by_rid[ev.request_id].index
                if kind == "chat":
                    choice = {"index": index,
                              "delta": {"content": ev.text} if ev.text else {},
                              "finish_reason": ev.finish_reason, "logprobs": lp}
                else:
                    choice = {"index": index, "text": ev.text,
                              "finish_reason": ev.finish_reason, "logprobs": lp}
                yield chunk([choice])
            if include_usage:
                yield chunk([], run.usage().model_dump())
            yield "data: [DONE]\n\n"
            done = True
        finally:
            if not done:  # the client went away (or the server is shutting down)
                run.abort()
                state.metrics.finished.labels("client_gone").inc()

    @router.post("/v1/completions")
    async def completions(http: HttpRequest):
        req = await parse(http, state, P.CompletionRequest)
        jobs = completion_jobs(state, req)

        def finish(run: Run) -> P.CompletionResponse:
            choices = []
            for job in run.jobs:
                text = "".join(job.text)
                if job.echo:
                    prompt = job.prompt_text
                    text = (state.tokenizer.decode(job.prompt_ids) if prompt is None
                            else prompt) + text
                choices.append(P.CompletionChoice(
                    index=job.index, text=text, finish_reason=job.finish,
                    logprobs=(completion_logprobs(state, job, req.logprobs)
                              if req.logprobs is not None else None)))
            return P.CompletionResponse(id=run.jobs[0].rid.rsplit("-", 2)[0],
                                        created=int(time.time()), model=cfg.model_name,
                                        choices=choices, usage=run.usage())

        return await run_jobs(http, jobs, "completion", _stream_flags(req), req.stream,
                              req.n, finish, req.logprobs)

    @router.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        req = await parse(http, state, P.ChatCompletionRequest)
        jobs = chat_jobs(state, req)

        def finish(run: Run) -> P.ChatCompletionResponse:
            choices = [P.ChatChoice(
                index=job.index, finish_reason=job.finish,
                message=P.AssistantMessage(content="".join(job.text)),
                logprobs=(chat_logprobs(state, job, req.top_logprobs or 0)
                          if req.logprobs else None)) for job in run.jobs]
            return P.ChatCompletionResponse(id=run.jobs[0].rid.rsplit("-", 1)[0],
                                            created=int(time.time()), model=cfg.model_name,
                                            choices=choices, usage=run.usage())

        return await run_jobs(http, jobs, "chat", _stream_flags(req), req.stream, req.n,
                              finish, (req.top_logprobs or 0) if req.logprobs else None)

    return router


def tokenizer_router(state: ServerState) -> APIRouter:
    router = APIRouter()
    tok, cfg = state.tokenizer, state.config

    def strip_bos(ids: list[int], add_special: bool) -> list[int]:
        bos = getattr(tok, "bos_id", None)
        if not add_special and getattr(tok, "add_bos", False) and ids[:1] == [bos]:
            return ids[1:]
        return ids

    @router.post("/tokenize")
    async def tokenize(http: HttpRequest):
        body = P.parse_json_object(await read_body(http, cfg.max_body_bytes))
        cls = P.TokenizeChatRequest if "messages" in body else P.TokenizeCompletionRequest
        try:
            req = cls.model_validate(body)
        except ValidationError as e:
            raise P.validation_error(e) from None
        check_model(state, req.model, required=False)
        if isinstance(req, P.TokenizeChatRequest):
            if not req.add_generation_prompt:
                raise P.unsupported("add_generation_prompt", False,
                                    " (chat prompts end with the assistant's turn)")
            try:
                ids = encode_chat(tok, chat_messages(req.messages))
            except ValueError as e:
                raise ApiError(400, f"messages: {e}", "messages") from None
        else:
            try:  # special-token text (e.g. "<|endoftext|>") is parsed, as HF tokenizers do
                ids = strip_bos(tok.encode(req.prompt), req.add_special_tokens)
            except ValueError as e:
                raise ApiError(400, f"prompt: {e}", "prompt") from None
        strs = [state.token_str(i) for i in ids] if req.return_token_strs else None
        return _response(P.TokenizeResponse(count=len(ids), max_model_len=cfg.max_context,
                                            tokens=ids, token_strs=strs))

    @router.post("/detokenize")
    async def detokenize(http: HttpRequest):
        req = await parse(http, state, P.DetokenizeRequest)
        bad = [t for t in req.tokens if not 0 <= t < tok.vocab_size]
        if bad:
            raise ApiError(400, f"tokens {bad[:5]} are outside [0, {tok.vocab_size})", "tokens")
        return _response(P.DetokenizeResponse(prompt=tok.decode(req.tokens)))

    @router.get("/tokenizer_info")
    async def tokenizer_info():
        def token(i):
            return None if i is None else tok.decode([i])

        bos, eos = getattr(tok, "bos_id", None), getattr(tok, "eos_id", None)
        return _response(P.TokenizerInfo(
            tokenizer_class=f"servax.{type(tok).__name__}", bos_token=token(bos),
            eos_token=token(eos), pad_token=token(eos), unk_token=None,
            chat_template=getattr(tok, "chat_template", None),
            model_max_length=cfg.max_context, add_bos_token=bool(getattr(tok, "add_bos", False)),
            vocab_size=tok.vocab_size))

    return router


def admin_router(state: ServerState) -> APIRouter:
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    router = APIRouter()
    cfg = state.config

    @router.get("/v1/models")
    async def models():
        return _response(P.ModelList(data=[P.ModelCard(
            id=cfg.model_name, created=state.created, root=cfg.model_name,
            max_model_len=cfg.max_context)]))

    @router.get("/health")
    async def health():
        if not state.engine_loop.alive:
            return JSONResponse({"status": "error", "error": repr(state.engine_loop.error)},
                                status_code=503)
        return {"status": "ok"}

    @router.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(state.metrics.registry),
                                 headers={"Content-Type": CONTENT_TYPE_LATEST})

    return router
