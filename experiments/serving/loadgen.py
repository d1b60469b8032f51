"""Load generator for OpenAI-compatible servers (and the servax engine in-process).

Workloads are seeded lists of `RequestSpec`: prompt text cut from the embedded prose corpus
(research/data.py: the English prose of `pydoc_data.topics`), prompt and output lengths
drawn from ShareGPT-like log-normal spreads, arrival times from a gamma process
(shape 1 = Poisson; shape < 1 = burstier). `shared_prefix` builds groups of requests that
share a long system prompt; `repetitive` builds prompts whose continuation repeats text
already in the prompt (the easy case for speculative decoding).

Drivers:
  run_http(url, model, specs)    streaming /v1/completions over HTTP; TTFT, inter-token
                                 latencies and TPOT measured at the client from SSE chunks
  run_engine(engine, specs, ...) the same workload submitted in-process to a ServingEngine
                                 (policy "continuous" or "static" batching)
  summarize(results, ...)        p50/p90/p99 TTFT/TPOT/ITL, throughput, goodput under SLOs
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    prompt: str
    max_tokens: int
    arrival_s: float  # seconds after the start of the run
    group: int = -1  # shared-prefix group (-1: none)
    prefix_chars: int = 0  # length of the shared prefix inside `prompt`


@dataclasses.dataclass
class RequestResult:
    ok: bool
    status: int = 200
    error: str = ""
    t_sent: float = 0.0  # seconds after the start of the run
    ttft_s: float = math.nan
    token_times: list = dataclasses.field(default_factory=list)  # seconds after t_sent
    n_output: int = 0
    n_prompt: int = 0
    n_cached: int = 0
    group: int = -1
    finish_reason: str | None = None

    @property
    def itls(self) -> list[float]:
        return list(np.diff(self.token_times)) if len(self.token_times) > 1 else []

    @property
    def tpot_s(self) -> float:
        if self.n_output < 2 or len(self.token_times) < 2:
            return math.nan
        return (self.token_times[-1] - self.token_times[0]) / (self.n_output - 1)

    @property
    def latency_s(self) -> float:
        return self.token_times[-1] if self.token_times else math.nan


# --------------------------------------------------------------------------- workloads


def _sentences(split: str) -> list[str]:
    from research import data
    text = data.corpus_text(split)
    return [p for p in text.split("\n\n") if p.strip()]


def _lognormal_int(rng, median: float, sigma: float, lo: int, hi: int, n: int) -> np.ndarray:
    x = rng.lognormal(math.log(median), sigma, n)
    return np.clip(np.round(x), lo, hi).astype(int)


def arrivals(n: int, rate: float, seed: int, burstiness: float = 1.0) -> np.ndarray:
    """Arrival offsets (s) of `n` requests at `rate` req/s; gamma inter-arrivals with shape
    `burstiness` (1.0 = Poisson) and mean 1/rate. rate=inf: all at t=0."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 (req/s; inf = all at once), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return np.zeros(n)
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def _text_of_tokens(tokenizer, paragraphs: Sequence[str], start: int, n_tokens: int) -> str:
    """Prose starting at paragraph `start`, cut to about `n_tokens` tokens."""
    out, i = [], start
    while True:
        out.append(paragraphs[i % len(paragraphs)])
        ids = tokenizer.encode("\n\n".join(out))
        if len(ids) >= n_tokens:
            return tokenizer.decode(ids[:n_tokens], skip_special=True)
        i += 1


def sharegpt_like(tokenizer, n: int, rate: float, seed: int, *, split: str = "heldout",
                  prompt_median: int = 96, prompt_sigma: float = 0.8,
                  output_median: int = 48, output_sigma: float = 0.6, max_prompt: int = 512,
                  max_output: int = 128, burstiness: float = 1.0) -> list[RequestSpec]:
    """Free-form prose prompts, log-normal prompt/output lengths (ShareGPT has a long right
    tail on both; medians here are scaled down for a CPU-hosted 135M model)."""
    rng = np.random.default_rng(seed)
    paras = _sentences(split)
    p_len = _lognormal_int(rng, prompt_median, prompt_sigma, 8, max_prompt, n)
    o_len = _lognormal_int(rng, output_median, output_sigma, 4, max_output, n)
    starts = rng.integers(0, len(paras), n)
    t = arrivals(n, rate, seed + 1, burstiness)
    return [RequestSpec(_text_of_tokens(tokenizer, paras, int(s), int(p)), int(o), float(a))
            for s, p, o, a in zip(starts, p_len, o_len, t)]


def shared_prefix(tokenizer, n_groups: int, group_size: int, rate: float, seed: int, *,
                  prefix_tokens: int = 192, suffix_tokens: int = 32, max_tokens: int = 16,
                  split: str = "heldout", burstiness: float = 1.0,
                  interleave: bool = False) -> list[RequestSpec]:
    """`n_groups` groups of `group_size` requests; every request of a group starts with the
    same `prefix_tokens`-token system prompt and ends with its own `suffix_tokens` question.
    Groups are sent one after another (interleave=False) so each group's first request
    warms the cache for the other group_size - 1."""
    rng = np.random.default_rng(seed)
    paras = _sentences(split)
    specs_by_group = []
    for g in range(n_groups):
        prefix = _text_of_tokens(tokenizer, paras, int(rng.integers(0, len(paras))),
                                 prefix_tokens) + "\n\n"
        group = []
        for _ in range(group_size):
            suffix = _text_of_tokens(tokenizer, paras, int(rng.integers(0, len(paras))),
                                     suffix_tokens)
            group.append((prefix + suffix, g, len(prefix)))
        specs_by_group.append(group)
    order = ([x for grp in zip(*specs_by_group) for x in grp] if interleave
             else [x for grp in specs_by_group for x in grp])
    t = arrivals(len(order), rate, seed + 1, burstiness)
    return [RequestSpec(p, max_tokens, float(a), g, pc) for (p, g, pc), a in zip(order, t)]


def repetitive(tokenizer, n: int, rate: float, seed: int, *, passage_tokens: int = 64,
               max_tokens: int = 64, split: str = "heldout") -> list[RequestSpec]:
    """Prompts that show a passage twice and start it a third time: the greedy
    continuation copies text already in the context (n-gram / prompt-lookup drafts hit)."""
    rng = np.random.default_rng(seed)
    paras = _sentences(split)
    t = arrivals(n, rate, seed + 1)
    out = []
    for i in range(n):
        passage = _text_of_tokens(tokenizer, paras, int(rng.integers(0, len(paras))),
                                  passage_tokens)
        head = passage[: len(passage) // 4]
        out.append(RequestSpec(f"{passage}\n\n{passage}\n\n{head}", max_tokens, float(t[i])))
    return out


# --------------------------------------------------------------------------- HTTP driver


async def _one_http(client, url: str, model: str, spec: RequestSpec, t0: float,
                    temperature: float, timeout_s: float, usage: bool) -> RequestResult:
    delay = spec.arrival_s - (time.perf_counter() - t0)
    if delay > 0:
        await asyncio.sleep(delay)
    body = {"model": model, "prompt": spec.prompt, "max_tokens": spec.max_tokens,
            "temperature": temperature, "stream": True}
    if usage:
        body["stream_options"] = {"include_usage": True}
    t_sent = time.perf_counter()
    res = RequestResult(ok=False, t_sent=t_sent - t0, group=spec.group)
    try:
        async with client.stream("POST", url + "/v1/completions", json=body,
                                 timeout=timeout_s) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.error = (await r.aread()).decode(errors="replace")[:300]
                return res
            n_chunks = 0
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    res.error = str(msg["error"])[:300]
                    return res
                now = time.perf_counter() - t_sent
                u = msg.get("usage")
                if u:
                    res.n_prompt = u.get("prompt_tokens", 0)
                    res.n_output = u.get("completion_tokens", 0)
                    details = u.get("prompt_tokens_details") or {}
                    res.n_cached = details.get("cached_tokens") or 0
                for ch in msg.get("choices") or ():
                    if ch.get("text"):
                        n_chunks += 1
                        res.token_times.append(now)
                    if ch.get("finish_reason"):
                        res.finish_reason = ch["finish_reason"]
            if not res.n_output:
                res.n_output = n_chunks
            res.ttft_s = res.token_times[0] if res.token_times else math.nan
            res.ok = bool(res.token_times)
            if not res.ok:
                res.error = "no tokens"
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        res.error = f"{type(e).__name__}: {e}"[:300]
    return res


async def run_http_async(url: str, model: str, specs: Sequence[RequestSpec], *,
                         temperature: float = 0.0, timeout_s: float = 600.0,
                         usage: bool = True, max_connections: int = 512):
    import httpx
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per request
    limits = httpx.Limits(max_connections=max_connections,
                          max_keepalive_connections=max_connections)
    async with httpx.AsyncClient(limits=limits, timeout=timeout_s) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*[
            _one_http(client, url, model, s, t0, temperature, timeout_s, usage)
            for s in specs])
        return list(results), time.perf_counter() - t0


def run_http(url: str, model: str, specs: Sequence[RequestSpec], **kw):
    """(results, wall_s): every spec sent at its arrival time, streamed, timed at the client."""
    return asyncio.run(run_http_async(url, model, specs, **kw))


# --------------------------------------------------------------------------- in-process


def run_engine(engine, tokenizer, specs: Sequence[RequestSpec], *, policy: str = "continuous",
               static_batch: int = 8, temperature: float = 0.0, stop_token_ids=(),
               on_step=None):
    """(results, wall_s, samples): the workload submitted to `engine` in-process (engine
    calls from this thread only). policy="continuous": every request is added when it
    arrives and the engine schedules it. policy="static": arrived requests wait here until
    the engine is idle, then up to `static_batch` of them are added at once and run to
    completion together (classic static batching on the same engine and kernels).
    `samples` holds (t, running, kv_blocks_used) after each step."""
    from research.serving.api import QueueFullError, Request, RequestError, SamplingParams
    if policy not in ("continuous", "static"):
        raise ValueError(f"policy must be 'continuous' or 'static', got {policy!r}")
    order = sorted(range(len(specs)), key=lambda i: specs[i].arrival_s)
    ids = [tokenizer.encode(s.prompt) for s in specs]
    results = [RequestResult(ok=False, group=s.group) for s in specs]
    sent_at = {}
    waiting: list[int] = []
    nxt, done, samples = 0, 0, []
    t0 = time.perf_counter()
    while done < len(specs):
        now = time.perf_counter() - t0
        while nxt < len(order) and specs[order[nxt]].arrival_s <= now:
            waiting.append(order[nxt])
            nxt += 1
        admit = []
        if policy == "continuous":
            admit, waiting = waiting, []
        elif not engine.has_work():
            admit, waiting = waiting[:static_batch], waiting[static_batch:]
        for i in admit:
            s = specs[i]
            req = Request(str(i), tuple(ids[i]), SamplingParams(
                temperature=temperature, max_new_tokens=s.max_tokens, seed=i,
                stop_token_ids=tuple(stop_token_ids)), arrival_time=t0 + s.arrival_s)
            results[i].t_sent = s.arrival_s  # latency counts from arrival, incl. waiting here
            try:
                engine.add_request(req)
                sent_at[str(i)] = i
            except (QueueFullError, RequestError) as e:
                results[i].error = f"{type(e).__name__}: {e}"
                results[i].status = 429 if isinstance(e, QueueFullError) else 400
                done += 1
        if not engine.has_work():
            if nxt < len(order):
                time.sleep(max(0.0, min(0.01, specs[order[nxt]].arrival_s - now)))
            continue
        events = engine.step()
        now = time.perf_counter() - t0
        if on_step is not None:
            on_step(engine)
        m = engine.metrics()
        samples.append((now, m.running, m.kv_blocks_used))
        for ev in events:
            i = sent_at.get(ev.request_id)
            if i is None:
                continue
            r = results[i]
            if ev.token_id is not None:
                r.token_times.append(now - specs[i].arrival_s)
                r.n_output += 1
            r.n_prompt = ev.n_prompt_tokens or r.n_prompt
            r.n_cached = ev.n_cached_prompt_tokens or r.n_cached
            if ev.finish_reason is not None:
                r.finish_reason = ev.finish_reason
                r.ok = bool(r.token_times)
                r.ttft_s = r.token_times[0] if r.token_times else math.nan
                del sent_at[ev.request_id]
                done += 1
    return results, time.perf_counter() - t0, samples


# --------------------------------------------------------------------------- summary


def _pct(xs, q):
    xs = [x for x in xs if x == x]
    return float(np.percentile(xs, q)) if xs else math.nan


def summarize(results: Sequence[RequestResult], wall_s: float, *, ttft_slo_s: float,
              tpot_slo_s: float) -> dict:
    """Latency percentiles (ms), throughput and goodput (requests/s finishing within both
    SLOs: TTFT <= ttft_slo_s and TPOT <= tpot_slo_s)."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok]
    tpot = [r.tpot_s for r in ok]
    itl = [x for r in ok for x in r.itls]
    good = [r for r in ok if r.ttft_s <= ttft_slo_s and not (r.tpot_s > tpot_slo_s)]
    out_tokens = sum(r.n_output for r in ok)
    row = {"requests": len(results), "ok": len(ok),
           "rejected": sum(1 for r in results if r.status in (429, 503)),
           "failed": sum(1 for r in results if not r.ok and r.status not in (429, 503)),
           "wall_s": wall_s, "out_tok_s": out_tokens / wall_s if wall_s > 0 else math.nan,
           "req_s": len(ok) / wall_s if wall_s > 0 else math.nan,
           "goodput_req_s": len(good) / wall_s if wall_s > 0 else math.nan,
           "mean_out_tokens": out_tokens / len(ok) if ok else math.nan}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        for q in (50, 90, 99):
            row[f"{name}_p{q}_ms"] = 1e3 * _pct(xs, q)
    return row
