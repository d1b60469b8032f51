"""Verifier-guided search over solution paths: best-of-N, beam search and SpecScale.

All methods run on one `PagedEngine` (prefix-shared paged KV cache) and one
`LikelihoodVerifier`, over a group of problems at a time (every candidate of every
problem in the group shares each forward pass). A path is a list of lines; a line ends
at the first token containing a newline (or a stop token, or `max_line_tokens`).

- best-of-N: N full samples per problem, one batched verification of all their lines
  at the end, the best mean line score wins.
- beam search: W beams x E expansions; every round each candidate writes ONE line, all
  candidates are verified, the top W per problem survive.
- SpecScale (same W x E, each ingredient switchable for ablation):
  * `defer=k` deferred verification: candidates write k lines speculatively with no
    barrier between lines, then all unjudged lines are judged in one batched call;
  * `reject_below`: a judged line scoring below it is rejected and the path is rolled
    back to the line before it (KV truncated), the rest of its speculation discarded;
  * early pruning, from the generator's own log-likelihoods (free: computed while
    sampling), before a candidate costs verification or more generation:
    `prune_token_logp` drops a candidate the moment it samples a token less likely than
    that; `prune_margin` drops it when its finished line is less likely (mean per token)
    than the best sibling line at that depth by more than the margin;
  * `process_prune`: the exact process verifier (`ProcessVerifier`, no model call)
    checks each line the moment it is written; a candidate whose line fails is dropped
    before it costs likelihood verification or more generation;
  * `dedup`: a candidate whose whole token path equals a live sibling's is merged into
    it (its KV freed, its paths added to the twin's), so identical paths are generated,
    stored and judged once. Merging removes computation, not search: a bundle stands for
    w identical beams and carries each one's sampling lineage and beam rank; it takes w
    of the W beam slots, its expansion draws each of the w * E children's tokens with
    that child's own lineage key on one shared model row, and it splits only where those
    draws differ. Dedup alone therefore makes beam search's decisions on the same seeds
    (tested), at the cost of the distinct paths only.
  Shared prefixes are never recomputed in any method: children fork the parent's
  blocks (the `PagedEngine`), and verifier sequences fork the parent's judged prefix.
  Every method keeps at least one candidate per problem alive.

With `process=True` (any verifier-guided method) a line's judgement also includes the
exact process check: every failed line lowers the path's score by `PROCESS_PENALTY`, far
more than any likelihood difference, so paths with correct steps always rank first and
the likelihood verifier orders paths among equals.

Beam search is `SearchConfig(method="beam")`; tests/specscale compare beam search and
SpecScale with an independent beam-search implementation written in the test.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import time
from typing import Sequence

import jax
import numpy as np

from research.decode.generate import default_stop_tokens
from research.specscale.engine import PagedEngine, child_key
from research.specscale.verifier import LikelihoodVerifier, ProcessVerifier

METHODS = ("single", "best_of_n", "beam", "specscale")
PROCESS_PENALTY = 100.0  # score cost of one failed process check (likelihoods are ~-0..-10)


@dataclasses.dataclass(frozen=True)
class SearchConfig:
    """One search method; see the module docstring for the switches."""

    method: str = "specscale"
    n: int = 8  # best-of-N samples
    beam_width: int = 2
    expand: int = 4  # children per beam per round (first round: beam_width * expand)
    defer: int = 1
    reject_below: float | None = None
    prune_margin: float | None = None
    prune_token_logp: float | None = None
    dedup: bool = False
    process: bool = False  # judge lines with the exact process verifier too
    process_prune: bool = False  # drop a candidate the moment a line fails that check
    max_lines: int = 4
    max_line_tokens: int = 16
    temperature: float | None = None  # None = the engine's; 0 = greedy
    name: str = ""

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        for f in ("n", "beam_width", "expand", "defer", "max_lines", "max_line_tokens"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be >= 1, got {getattr(self, f)}")
        if self.prune_margin is not None and not self.prune_margin >= 0:
            raise ValueError(f"prune_margin must be >= 0 or None, got {self.prune_margin}")
        if self.prune_token_logp is not None and not self.prune_token_logp < 0:
            raise ValueError(f"prune_token_logp must be < 0 or None, got "
                             f"{self.prune_token_logp}")
        if self.reject_below is not None and not math.isfinite(self.reject_below):
            raise ValueError(f"reject_below must be finite or None, got {self.reject_below}")
        if self.temperature is not None and not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 or None, got {self.temperature}")
        if self.method == "beam" and (self.defer != 1 or self.dedup or self.prune_margin
                                      is not None or self.prune_token_logp is not None
                                      or self.reject_below is not None or
                                      self.process_prune):
            raise ValueError("method='beam' is plain beam search: use method='specscale' for "
                             "defer/dedup/prune_margin/prune_token_logp/reject_below/"
                             "process_prune")
        if self.process_prune and not self.process:
            raise ValueError("process_prune needs process=True (pruned paths and judged "
                             "paths must be scored by the same checks)")
        if self.process and self.method == "single":
            raise ValueError("method='single' uses no verifier: process must be False")

    @property
    def label(self) -> str:
        return self.name or self.method


def single_sample(greedy: bool = False, **kw) -> SearchConfig:
    return SearchConfig(method="single", n=1, temperature=0.0 if greedy else None,
                        name="greedy" if greedy else "single sample", **kw)


def best_of_n(n: int, **kw) -> SearchConfig:
    return SearchConfig(method="best_of_n", n=n, name=f"best-of-{n}", **kw)


def beam_search(beam_width: int, expand: int, **kw) -> SearchConfig:
    return SearchConfig(method="beam", beam_width=beam_width, expand=expand,
                        name=f"beam {beam_width}x{expand}", **kw)


def specscale(beam_width: int, expand: int, *, defer: int = 1,
              reject_below: float | None = None, prune_margin: float | None = 2.0,
              prune_token_logp: float | None = -6.0, dedup: bool = True,
              process: bool = True, process_prune: bool = True, **kw) -> SearchConfig:
    """SpecScale with the defaults chosen on a dev split (seed 1000) of the arithmetic task
    on CPU: dedup on (it alone makes beam search's decisions at ~1/3 of the tokens),
    early pruning on; deferral (defer > 1) cut verifier calls there but not time, and
    rejection (reject_below) changed paths without changing accuracy or cost, so both are
    off by default; the ablations in experiments/specscale measure each switch."""
    return SearchConfig(method="specscale", beam_width=beam_width, expand=expand,
                        defer=defer, reject_below=reject_below, prune_margin=prune_margin,
                        prune_token_logp=prune_token_logp, dedup=dedup, process=process,
                        process_prune=process_prune,
                        name=kw.pop("name", f"specscale {beam_width}x{expand}"), **kw)


# -- shared context ----------------------------------------------------------------------
class SearchContext:
    """Engine + verifier + the generator's shared prompt (prefilled once, forked per problem)."""

    def __init__(self, engine: PagedEngine, tokenizer, task):
        self.engine, self.tokenizer, self.task = engine, tokenizer, task
        self.verifier = LikelihoodVerifier(engine, tokenizer, task)
        self.root = engine.new_sequence(tokenizer.encode(task.shared_prompt()))
        engine.prefill([self.root], tag="generator_prompt")
        self.process = ProcessVerifier(task)
        self.stop_ids = frozenset(default_stop_tokens(tokenizer))
        self.line_end = _line_end_table(tokenizer, engine.model.config.vocab_size)

    def close(self) -> None:
        """Release the shared prompts (the engine should then hold no blocks)."""
        self.engine.free(self.root)
        self.engine.free(self.verifier.root)


def _line_end_table(tokenizer, vocab_size: int) -> np.ndarray:
    ends = np.zeros(vocab_size, bool)
    for i in range(vocab_size):
        ends[i] = "\n" in tokenizer.decode([i])
    return ends


# -- candidates --------------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class Candidate:
    slot: int  # problem index within the group
    gen: int  # generator sequence
    ver: int  # verifier sequence, covering the judged lines
    lines: list[list[int]] = dataclasses.field(default_factory=list)
    line_ends: list[int] = dataclasses.field(default_factory=list)  # gen length after each
    gen_scores: list[float] = dataclasses.field(default_factory=list)
    ver_scores: list[float] = dataclasses.field(default_factory=list)
    checks: list[bool] = dataclasses.field(default_factory=list)  # process check per line
    cur: list[int] = dataclasses.field(default_factory=list)
    cur_logp: list[float] = dataclasses.field(default_factory=list)
    finished: bool = False
    alive: bool = True
    # the identical paths this candidate stands for (several only with dedup), each as
    # (beam rank, sampling lineage key): what beam search would hold as separate beams
    paths: list[tuple[int, np.ndarray]] = dataclasses.field(default_factory=list)

    @property
    def weight(self) -> int:
        return len(self.paths)

    @property
    def rank(self) -> int:
        """Beam search's order of this path among its siblings (ties broken by it)."""
        return self.paths[0][0]

    @property
    def n_judged(self) -> int:
        return len(self.ver_scores)

    @property
    def score(self) -> float:
        """Mean likelihood score of the judged lines, minus PROCESS_PENALTY per line that
        failed the process check (when the search uses it)."""
        if not self.ver_scores:
            return -math.inf
        return float(np.mean(self.ver_scores)) - PROCESS_PENALTY * self.checks.count(False)


@dataclasses.dataclass
class ProblemResult:
    uid: int
    answer: int
    predicted: int | None
    correct: bool
    text: str
    score: float


@dataclasses.dataclass
class SearchResult:
    config: SearchConfig
    problems: list[ProblemResult]
    stats: dict
    judged: list = dataclasses.field(default_factory=list)  # (uid, lines so far, score)

    @property
    def accuracy(self) -> float:
        return float(np.mean([p.correct for p in self.problems]))


# -- the searcher ------------------------------------------------------------------------
class _Searcher:
    def __init__(self, ctx: SearchContext, cfg: SearchConfig, seed: int, problems):
        self.ctx, self.cfg, self.seed, self.problems = ctx, cfg, seed, problems
        self.engine, self.verifier = ctx.engine, ctx.verifier
        self.judged: list[tuple[int, list[str], float]] = []  # (uid, lines so far, score)
        self.generated = 0  # tokens appended to candidate paths (a bundle's count once)
        self._ranks = itertools.count()  # beam search's creation order of children

    # lifecycle helpers
    def _drop(self, c: Candidate) -> None:
        if c.alive:
            self.engine.free(c.gen)
            self.verifier.free(c.ver)
            c.alive = False

    def _copy(self, parent: Candidate, salt: int, paths: list) -> Candidate:
        """A new candidate on the same path (KV shared copy-on-write, nothing recomputed)."""
        return dataclasses.replace(
            parent, gen=self.engine.fork(parent.gen, salt=salt), paths=paths,
            ver=self.verifier.fork(parent.ver), lines=[list(x) for x in parent.lines],
            line_ends=list(parent.line_ends), gen_scores=list(parent.gen_scores),
            ver_scores=list(parent.ver_scores), checks=list(parent.checks), cur=list(parent.cur),
            cur_logp=list(parent.cur_logp))

    def _children(self, parent: Candidate, k: int) -> list[Candidate]:
        """k samples continue from each of the identical paths `parent` stands for: k
        forks, or (dedup) one bundle of all the children, each child keeping the lineage
        key its own fork would get, so it samples exactly what that fork would."""
        kids = [(next(self._ranks), child_key(key, e)) for _, key in parent.paths
                for e in range(k)]
        if self.cfg.dedup:
            parent.paths = kids
            return [parent]
        forks = [self._copy(parent, salt=e, paths=[kid]) for e, kid in enumerate(kids)]
        self._drop(parent)
        return forks

    def _roots(self, problems) -> list[Candidate]:
        ver = self.verifier.start_problems(problems)
        roots = []
        for slot, (p, v) in enumerate(zip(problems, ver)):
            gen = self.engine.fork(self.ctx.root, salt=self.seed * 1_000_003 + p.uid)
            self.engine.extend(gen, self.ctx.tokenizer.encode(self.ctx.task.problem_prompt(p)))
            roots.append(Candidate(slot=slot, gen=gen, ver=v,
                                   paths=[(next(self._ranks), self.engine.key(gen))]))
        self.engine.prefill([c.gen for c in roots], tag="problem_prefill")
        return roots

    # generation
    def _generate(self, cands: list[Candidate], k: int) -> None:
        """Each live candidate writes up to k more lines (no barrier between lines).

        With `dedup`, a candidate stands for several identical paths: one model row draws
        each path's next token with the path's own lineage key, and the bundle splits
        (forks sharing its KV) only where the draws differ, so identical prefixes are
        computed once and every path samples what it would alone. Branches are appended
        to `cands`.
        """
        self._live = cands
        goal = {id(c): len(c.lines) + k for c in cands}
        marks = ({}, {}, {})  # best line score / closed candidates per depth, dedup index
        active = [c for c in cands if c.alive and not c.finished]
        while active:
            if self.cfg.dedup:
                steps = self._draw_bundles(active, cands, goal)
            else:
                toks, logps = self.engine.sample([c.gen for c in active], tag="generate",
                                                 temperature=self.cfg.temperature)
                steps = list(zip(active, toks.tolist(), logps.tolist()))
            for c, t, lp in steps:
                self._advance(c, t, lp, marks)
            active = [c for c in cands
                      if c.alive and not c.finished and len(c.lines) < goal[id(c)]]

    def _draw_bundles(self, active, cands, goal) -> list[tuple[Candidate, int, float]]:
        draws, logps = self.engine.draw([c.gen for c in active],
                                        [[key for _, key in c.paths] for c in active],
                                        tag="generate", temperature=self.cfg.temperature)
        steps = []
        for c, row, lps in zip(active, draws.tolist(), logps.tolist()):
            split: dict[int, list] = {}  # token -> (log-prob, paths that drew it, in order)
            for path, t, lp in zip(c.paths, row, lps):
                split.setdefault(t, [lp, []])[1].append(path)
            (t0, (lp0, paths0)), *rest = split.items()
            steps.append((c, t0, lp0))
            for t, (lp, paths) in rest:  # fork before `c` extends: branches share its KV
                kid = self._copy(c, salt=t, paths=paths)
                cands.append(kid)
                goal[id(kid)] = goal[id(c)]
                steps.append((kid, t, lp))
            c.paths = paths0
        for c, t, _ in steps:
            self.engine.extend(c.gen, [t])
        return steps

    def _advance(self, c: Candidate, t: int, lp: float, marks) -> None:
        """Record a sampled token; prune, or close the line (then prune / dedup)."""
        self.generated += 1
        c.cur.append(t)
        c.cur_logp.append(lp)
        if self._unlikely_token(c, lp):
            self._drop(c)
        elif self.ctx.line_end[t] or t in self.ctx.stop_ids or \
                len(c.cur) >= self.cfg.max_line_tokens:
            self._close_line(c, t)
            self._after_line(c, *marks)

    def _unlikely_token(self, c: Candidate, logp: float) -> bool:
        """Token-level early pruning (never the problem's last live candidate)."""
        limit = self.cfg.prune_token_logp
        if limit is None or logp >= limit:
            return False
        return any(o is not c and o.alive and o.slot == c.slot for o in self._live)

    def _close_line(self, c: Candidate, last_token: int) -> None:
        c.lines.append(c.cur)
        c.line_ends.append(len(self.engine.tokens(c.gen)))
        c.gen_scores.append(float(np.mean(c.cur_logp)))
        text = self.ctx.tokenizer.decode(c.cur, skip_special=True)
        c.finished = (self.ctx.task.is_final_line(text) or last_token in self.ctx.stop_ids
                      or len(c.lines) >= self.cfg.max_lines)
        c.cur, c.cur_logp = [], []

    def _after_line(self, c, best_at, closed_at, seen) -> None:
        """Early pruning and dedup, applied the moment a candidate finishes a line."""
        cfg = self.cfg
        if cfg.dedup:
            key = (c.slot, tuple(t for line in c.lines for t in line))
            twin = seen.get(key)
            if twin is not None and twin.alive and twin is not c:
                twin.paths = sorted(twin.paths + c.paths, key=lambda p: p[0])
                self._drop(c)
                return
            seen[key] = c
        if cfg.process_prune:
            self._process_check(c)
            if not c.checks[-1] and any(o is not c and o.alive and o.slot == c.slot
                                        for o in self._live):
                self._drop(c)
                return
        if cfg.prune_margin is not None:
            depth = (c.slot, len(c.lines))
            best = max(best_at.get(depth, -math.inf), c.gen_scores[-1])
            best_at[depth] = best
            closed_at.setdefault(depth, []).append(c)
            for other in closed_at[depth]:
                if other.alive and other.gen_scores[len(c.lines) - 1] < best - cfg.prune_margin:
                    self._drop(other)

    # verification and rollback
    def _process_check(self, c: Candidate) -> None:
        """Extend c.checks over every line not checked yet (exact, no model call)."""
        if len(c.checks) < len(c.lines):
            texts = [self.ctx.tokenizer.decode(x, skip_special=True) for x in c.lines]
            c.checks += self.ctx.process.check(self.problems[c.slot], texts,
                                               first=len(c.checks))

    def _judge(self, cands: list[Candidate]) -> None:
        todo = [c for c in cands if c.alive and len(c.lines) > c.n_judged]
        if not todo:
            return
        firsts = [c.n_judged for c in todo]
        scores = self.verifier.score_lines([c.ver for c in todo],
                                           [c.lines[c.n_judged:] for c in todo])
        for c, s, first in zip(todo, scores, firsts):
            c.ver_scores.extend(s)
            if self.cfg.process:
                self._process_check(c)
            texts = [self.ctx.tokenizer.decode(x, skip_special=True) for x in c.lines]
            for i in range(first, len(c.lines)):
                self.judged.append((self.problems[c.slot].uid, texts[:i + 1], c.ver_scores[i]))
        if self.cfg.reject_below is not None:
            self._rollback(todo, firsts)

    def _rollback(self, judged: list[Candidate], firsts: list[int]) -> None:
        """Cut each path at its first rejected new line; keep >= 1 path per problem."""
        by_slot: dict[int, list[tuple[Candidate, int]]] = {}
        for c, first in zip(judged, firsts):
            by_slot.setdefault(c.slot, []).append((c, first))
        for group in by_slot.values():
            plans = []
            for c, first in group:
                bad = [i for i in range(first, len(c.lines))
                       if c.ver_scores[i] < self.cfg.reject_below]
                plans.append((c, first, bad[0] if bad else None))
            if all(cut == first for _, first, cut in plans):  # never reject everything
                keep = max(plans, key=lambda p: p[0].ver_scores[p[1]])
                plans = [(c, f, None if c is keep[0] else cut) for c, f, cut in plans]
            for c, first, cut in plans:
                if cut is None:
                    continue
                if cut == first:
                    self._drop(c)
                else:
                    self._truncate(c, cut)

    def _truncate(self, c: Candidate, n_lines: int) -> None:
        """Roll the path back to its first n_lines lines (generator and verifier KV)."""
        self.verifier.truncate_lines(c.ver, c.lines, n_lines)
        self.engine.truncate(c.gen, c.line_ends[n_lines - 1])
        del c.lines[n_lines:], c.line_ends[n_lines:], c.gen_scores[n_lines:]
        del c.ver_scores[n_lines:], c.checks[n_lines:]
        text = self.ctx.tokenizer.decode(c.lines[-1], skip_special=True)
        c.finished = (self.ctx.task.is_final_line(text) or c.lines[-1][-1] in self.ctx.stop_ids
                      or len(c.lines) >= self.cfg.max_lines)

    # methods
    def beam(self) -> list[Candidate | None]:
        cfg, problems = self.cfg, self.problems
        live = {c.slot: [c] for c in self._roots(problems)}
        first = {slot: cfg.beam_width * cfg.expand for slot in live}
        done: dict[int, list[Candidate]] = {slot: [] for slot in live}
        for _ in range(cfg.max_lines):
            if not any(live.values()):
                break
            kids = []
            for slot, beams in live.items():
                k = first.pop(slot, cfg.expand)
                for b in beams:
                    kids += self._children(b, k)
            self._generate(kids, cfg.defer)
            self._judge(kids)
            live = self._select(kids, done)
        return self._finish(live, done, len(problems))

    def _select(self, kids, done) -> dict[int, list[Candidate]]:
        live: dict[int, list[Candidate]] = {}
        for c in sorted((c for c in kids if c.alive), key=lambda c: c.rank):
            (done[c.slot] if c.finished else live.setdefault(c.slot, [])).append(c)
        for slot in list(live):
            # best score first, ties in beam search's order of the children
            ranked = sorted(live[slot], key=lambda c: (-c.score, c.rank))
            # beam slots count paths: a dedup bundle of w paths fills w of them, keeping
            # the paths beam search would keep (without dedup this is plain top-W)
            finished = sum(c.weight for c in done[slot])
            room = 0 if finished >= self.cfg.beam_width else self.cfg.beam_width
            keep = []
            for c in ranked:
                if room <= 0:
                    self._drop(c)
                    continue
                c.paths = c.paths[:room]
                room -= c.weight
                keep.append(c)
            live[slot] = keep
        return live

    def _finish(self, live, done, n) -> list[Candidate | None]:
        best = []
        for slot in range(n):
            pool = done.get(slot, []) or live.get(slot, [])
            best.append(max(pool, key=lambda c: c.score) if pool else None)
        return best

    def sample_n(self, judge: bool) -> list[Candidate | None]:
        problems, kids = self.problems, []
        for root in self._roots(problems):
            kids += self._children(root, self.cfg.n)
        self._generate(kids, self.cfg.max_lines)
        if judge:
            self._judge(kids)
        best = []
        for slot in range(len(problems)):
            pool = [c for c in kids if c.slot == slot and c.alive]
            best.append(max(pool, key=lambda c: c.score) if judge else pool[0])
        return best


def run_search(ctx: SearchContext, problems: Sequence, cfg: SearchConfig, *, seed: int = 0,
               group_size: int = 8, progress: bool = False) -> SearchResult:
    """Solve `problems` in groups of `group_size`; returns per-problem results and costs."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if not problems:
        raise ValueError("problems is empty")
    engine, ver = ctx.engine, ctx.verifier
    calls0, tok0 = dict(engine.stats.forward_calls), dict(engine.stats.tokens_computed)
    copies0, vstats0 = engine.stats.block_copies, dataclasses.replace(ver.stats)
    checks0 = ctx.process.stats.calls
    base_blocks = engine.blocks_in_use
    results: list[ProblemResult] = []
    groups = [problems[i:i + group_size] for i in range(0, len(problems), group_size)]
    if progress:
        from tqdm.auto import tqdm
        groups = tqdm(groups, desc=cfg.label, leave=False)
    timer = CompileTimer()
    t0 = time.perf_counter()
    group_peaks, judged, generated = [], [], 0
    for group in groups:
        engine.reset_peak()
        searcher = _Searcher(ctx, cfg, seed, group)
        if cfg.method == "beam" or cfg.method == "specscale":
            best = searcher.beam()
        else:
            best = searcher.sample_n(judge=cfg.method == "best_of_n")
        results += _collect(ctx, group, best)
        judged += searcher.judged
        group_peaks.append(engine.peak_blocks - base_blocks)
        generated += searcher.generated
        _release_group(ctx, base_blocks)
    wall = time.perf_counter() - t0
    compile_s = timer.stop()
    calls = {k: v - calls0.get(k, 0) for k, v in engine.stats.forward_calls.items()}
    toks = {k: v - tok0.get(k, 0) for k, v in engine.stats.tokens_computed.items()}
    stats = {
        "wall_s": wall, "compile_s": compile_s,
        "problems_per_s": len(problems) / max(wall - compile_s, 1e-9),
        "forward_calls": sum(calls.values()), "generate_calls": calls.get("generate", 0),
        "verify_calls": calls.get("verify", 0),
        "generated_tokens": generated,
        "tokens_computed": sum(toks.values()),
        "verifier_judgements": ver.stats.calls - vstats0.calls,
        "verifier_tokens": ver.stats.tokens - vstats0.tokens,
        "process_checks": ctx.process.stats.calls - checks0,
        "peak_kv_blocks": max(group_peaks),
        "peak_kv_bytes": max(group_peaks) * engine.block_bytes,
        "group_peak_kv_blocks": group_peaks,
        "block_copies": engine.stats.block_copies - copies0,
    }
    return SearchResult(cfg, results, stats, judged)


def _collect(ctx: SearchContext, problems, best) -> list[ProblemResult]:
    out = []
    for p, c in zip(problems, best):
        text = "" if c is None else ctx.tokenizer.decode(
            [t for line in c.lines for t in line], skip_special=True)
        pred = ctx.task.parse_answer(text)
        out.append(ProblemResult(p.uid, p.answer, pred, pred == p.answer, text,
                                 -math.inf if c is None else c.score))
    return out


def _release_group(ctx: SearchContext, base_blocks: int) -> None:
    """Free every sequence of the finished group (all but the two shared prompts)."""
    keep = {ctx.root, ctx.verifier.root}
    for seq in ctx.engine.manager.live_sequences():
        if seq not in keep:
            ctx.engine.free(seq)
    if ctx.engine.blocks_in_use != base_blocks:
        raise RuntimeError(f"KV blocks leaked: {ctx.engine.blocks_in_use} in use after a "
                           f"group, expected {base_blocks}")


class CompileTimer:
    """Seconds JAX spent tracing/lowering/compiling while active (excluded from throughput)."""

    EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
              "/jax/core/compile/jaxpr_to_mlir_module_duration",
              "/jax/core/compile/backend_compile_duration")

    def __init__(self):
        self.seconds, self._on = 0.0, True
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event: str, duration: float, **_) -> None:
        if self._on and event in self.EVENTS:
            self.seconds += duration

    def stop(self) -> float:
        self._on = False
        jax.monitoring.unregister_event_duration_listener(self._listen)
        return self.seconds


def merge_results(parts: Sequence[SearchResult]) -> SearchResult:
    """One result from runs of the same config on consecutive problem groups."""
    if not parts:
        raise ValueError("parts is empty")
    cfg = parts[0].config
    if any(p.config != cfg for p in parts):
        raise ValueError("merge_results needs results of one SearchConfig")
    stats: dict = {}
    for key in parts[0].stats:
        values = [p.stats[key] for p in parts]
        if key == "peak_kv_blocks" or key == "peak_kv_bytes":
            stats[key] = max(values)
        elif key == "group_peak_kv_blocks":
            stats[key] = [x for v in values for x in v]
        elif key != "problems_per_s":
            stats[key] = sum(values)
    problems = [q for p in parts for q in p.problems]
    stats["problems_per_s"] = len(problems) / max(stats["wall_s"] - stats["compile_s"], 1e-9)
    return SearchResult(cfg, problems, stats, [j for p in parts for j in p.judged])
