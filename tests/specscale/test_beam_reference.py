"""Beam search and SpecScale against an independent beam-search implementation.

The reference below shares no search or cache code with research/specscale: each step
recomputes every path from its full token list with the cache-free model forward, judges
lines with its own cache-free likelihood computation and the task's ground-truth step
checker, and keeps its own beams. It follows the documented sampling law of the engine
(research/specscale/engine.py): a path's lineage key is a hash of its parent's and its
fork salt, and the token at position p is drawn by inverse-CDF sampling with the key
(lineage, p), so the same seeds must give the same paths.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.model import forward
from research.decode.generate import default_stop_tokens
from research.specscale import search as S
from research.specscale.engine import PagedEngine
from research.specscale.tasks import ArithmeticChains

TASK = ArithmeticChains(n_shots=1, verifier_shots=2)
LIMITS = dict(max_lines=3, max_line_tokens=5)
SEED, TEMPERATURE, PENALTY = 5, 1.0, 100.0


# -- the documented sampling law, re-derived ---------------------------------------------
def _hash(words) -> np.ndarray:
    return np.random.SeedSequence([int(x) for x in words]).generate_state(2, np.uint32)


def _child(key, salt):
    return _hash(list(key) + [salt])


def _draw(logits: np.ndarray, key, position: int) -> int:
    words = _hash([int(key[0]), int(key[1]), position])
    p = jax.nn.softmax(jnp.asarray(logits, jnp.float32) / TEMPERATURE)
    cdf = jnp.cumsum(p)
    u = jax.random.uniform(jax.random.wrap_key_data(jnp.asarray(words))) * cdf[-1]
    return int(min(int(jnp.searchsorted(cdf, u, side="right")), len(cdf) - 1))


@jax.jit
def _logits(model, tokens):
    return forward(model, tokens).logits


def _full_logits(model, seqs: list[list[int]]) -> list[np.ndarray]:
    """Cache-free logits [len, V] of each token list (right-padded to a shared bucket)."""
    width = -(-max(map(len, seqs)) // 64) * 64
    rows = -(-len(seqs) // 8) * 8
    toks = np.zeros((rows, width), np.int32)
    for i, s in enumerate(seqs):
        toks[i, :len(s)] = s
    out = np.asarray(_logits(model, jnp.asarray(toks)))
    return [out[i, :len(s)] for i, s in enumerate(seqs)]


class Reference:
    """Plain beam search, W beams x E expansions, one line per round."""

    def __init__(self, model, tok, process: bool):
        self.model, self.tok, self.process = model, tok, process
        self.stops = set(default_stop_tokens(tok))
        self.gen_prefix = tok.encode(TASK.shared_prompt())
        self.ver_prefix = tok.encode(TASK.shared_prompt(verifier=True))

    def _line_end(self, t: int, n: int) -> bool:
        return "\n" in self.tok.decode([t]) or t in self.stops or n >= LIMITS["max_line_tokens"]

    def _write_lines(self, paths):
        """Every path writes one line, token by token (all paths of a step batched)."""
        active = list(paths)
        for p in paths:
            p["cur"] = []
        while active:
            logits = _full_logits(self.model, [p["tokens"] for p in active])
            nxt = []
            for p, lg in zip(active, logits):
                t = _draw(lg[-1], p["key"], len(p["tokens"]))
                p["tokens"].append(t)
                p["cur"].append(t)
                if self._line_end(t, len(p["cur"])):
                    p["lines"].append(p["cur"])
                    text = self.tok.decode(p["cur"], skip_special=True)
                    p["finished"] = (TASK.is_final_line(text) or t in self.stops
                                     or len(p["lines"]) >= LIMITS["max_lines"])
                else:
                    nxt.append(p)
            active = nxt

    def _judge(self, paths, problem):
        seqs, spans = [], []
        for p in paths:
            toks = self.ver_prefix + self.tok.encode(TASK.problem_prompt(problem))
            for line in p["lines"][:-1]:
                toks = toks + line
            spans.append((len(toks), len(p["lines"][-1])))
            seqs.append(toks + p["lines"][-1])
        for p, lg, seq, (start, n) in zip(paths, _full_logits(self.model, seqs), seqs, spans):
            logp = np.asarray(jax.nn.log_softmax(jnp.asarray(lg), axis=-1))
            p["ver"].append(float(np.mean([logp[start - 1 + i, seq[start + i]]
                                           for i in range(n)])))
            texts = [self.tok.decode(x, skip_special=True) for x in p["lines"]]
            p["ok"].append(TASK.step_is_correct(problem, texts, len(texts) - 1))

    def score(self, p) -> float:
        fails = p["ok"].count(False) if self.process else 0
        return float(np.mean(p["ver"])) - PENALTY * fails

    def solve(self, problem, width: int, expand: int) -> str:
        root_key = _child(_hash([0]), SEED * 1_000_003 + problem.uid)
        tokens = self.gen_prefix + self.tok.encode(TASK.problem_prompt(problem))
        root = {"tokens": tokens, "key": root_key, "lines": [], "ver": [], "ok": []}
        beams, done, rank = [root], [], 0
        for r in range(LIMITS["max_lines"]):
            if not beams:
                break
            kids = []
            for b in beams:
                for e in range(width * expand if r == 0 else expand):
                    kids.append({"tokens": list(b["tokens"]), "key": _child(b["key"], e),
                                 "lines": [list(x) for x in b["lines"]],
                                 "ver": list(b["ver"]), "ok": list(b["ok"]), "rank": rank})
                    rank += 1
            self._write_lines(kids)
            self._judge(kids, problem)
            done += [k for k in kids if k["finished"]]
            live = sorted((k for k in kids if not k["finished"]),
                          key=lambda k: (-self.score(k), k["rank"]))
            beams = [] if len(done) >= width else live[:width]
        pool = done or beams
        best = max(pool, key=self.score)
        return self.tok.decode([t for line in best["lines"] for t in line], skip_special=True)


@pytest.fixture(scope="module")
def problems():
    return TASK.problems(2, seed=1000, split="dev")  # inputs only; never a test problem


@pytest.mark.parametrize("process", [False, True])
def test_beam_and_specscale_match_an_independent_beam_search(char_model, char_tokenizer,
                                                             problems, process):
    want = [Reference(char_model, char_tokenizer, process).solve(p, 2, 2) for p in problems]
    engine = PagedEngine(char_model, n_blocks=800, block_size=8, max_len=512,
                         temperature=TEMPERATURE)
    ctx = S.SearchContext(engine, char_tokenizer, TASK)
    beam = S.run_search(ctx, problems, S.beam_search(2, 2, process=process, **LIMITS),
                        seed=SEED, group_size=2)
    # SpecScale's dedup changes the cost, never the decisions (pruning switched off)
    spec = S.run_search(ctx, problems, S.specscale(
        2, 2, prune_margin=None, prune_token_logp=None, dedup=True, process=process,
        process_prune=False, **LIMITS), seed=SEED, group_size=2)
    assert [p.text for p in beam.problems] == want
    assert [p.text for p in spec.problems] == want
    assert all(w for w in want)  # the reference wrote something for every problem
    ctx.close()
