"""Step verifiers: a likelihood scorer that costs a model call, and an exact process check.

`ProcessVerifier` (end of the module) checks each arithmetic line programmatically and
costs no model call; the search uses it beside the likelihood verifier below.


The score of a step (one solution line) is the model's mean per-token log-likelihood of
that line under a *verification prompt*: a longer k-shot context of worked solutions
(`task.shared_prompt(verifier=True)`), the problem, and the path's earlier lines. It is
a separate forward pass from generation (different context, batched over candidates),
and it is counted: `calls` = step judgements, `tokens` = tokens the verifier computed.

Why this scorer: on SmolLM2-135M-Instruct, asking for a Yes/No judgement of a step was
barely better than chance (step-level AUROC ~0.60 on 192 labelled sampled steps), while
the likelihood of the step under the k-shot verifier prompt separated correct from wrong
steps with AUROC ~0.87 (measured while building this module; `step_auroc` recomputes it,
see experiments/specscale).

Prefix sharing: the verifier prompt is prefilled once (`root`); each problem forks it,
and each candidate path forks its parent's verifier sequence, so a judgement computes
only the new line(s). A path's verifier sequence always ends at its last verified line;
`truncate_lines` rolls it back when a speculative line is rejected.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import numpy as np
from scipy import stats

from research.specscale.engine import PagedEngine
from research.specscale.tasks import parse_problem


@dataclasses.dataclass
class VerifierStats:
    calls: int = 0  # step judgements (lines scored)
    forward_calls: int = 0  # batched model calls spent on judging
    tokens: int = 0  # tokens computed by the verifier (judgements + problem prompts)


class LikelihoodVerifier:
    """Scores lines of candidate paths through `engine` (shared pool, shared prompt)."""

    def __init__(self, engine: PagedEngine, tokenizer, task):
        self.engine, self.tokenizer, self.task = engine, tokenizer, task
        self.stats = VerifierStats()
        self.root = engine.new_sequence(tokenizer.encode(task.shared_prompt(verifier=True)))
        engine.prefill([self.root], tag="verifier_prompt")
        self.root_tokens = len(engine.tokens(self.root))

    def start_problems(self, problems: Sequence) -> list[int]:
        """One verifier sequence per problem (root + problem text), prefilled in a batch."""
        seqs = []
        for p in problems:
            seq = self.engine.fork(self.root)
            self.engine.extend(seq, self.tokenizer.encode(self.task.problem_prompt(p)))
            seqs.append(seq)
        before = sum(self.engine.stats.tokens_computed.values())
        self.engine.prefill(seqs, tag="verify_prefill")
        self.stats.tokens += sum(self.engine.stats.tokens_computed.values()) - before
        return seqs

    def fork(self, seq: int) -> int:
        return self.engine.fork(seq)

    def free(self, seq: int) -> None:
        self.engine.free(seq)

    def score_lines(self, seqs: Sequence[int], new_lines: Sequence[Sequence[Sequence[int]]]
                    ) -> list[list[float]]:
        """Append each sequence's new lines and judge them all in one batched call.

        seqs[i] ends at path i's last judged line; new_lines[i] are its unjudged lines
        (token ids, each ending with its newline token). Returns per-line scores (mean
        log-likelihood per token; higher = more plausible).
        """
        if len(seqs) != len(new_lines):
            raise ValueError(f"{len(seqs)} sequences but {len(new_lines)} line lists")
        rows = [(s, lines) for s, lines in zip(seqs, new_lines) if lines]
        if not rows:
            return [[] for _ in seqs]
        for s, lines in rows:
            if any(len(line) == 0 for line in lines):
                raise ValueError("an empty line cannot be scored")
            for line in lines:
                self.engine.extend(s, line)
        logps = self.engine.score([s for s, _ in rows], tag="verify")
        self.stats.forward_calls += 1
        self.stats.calls += sum(len(lines) for _, lines in rows)
        self.stats.tokens += sum(len(x) for x in logps)
        by_seq = {s: _split_means(lp, lines) for (s, lines), lp in zip(rows, logps)}
        return [by_seq.get(s, []) if lines else [] for s, lines in zip(seqs, new_lines)]

    def truncate_lines(self, seq: int, lines: Sequence[Sequence[int]], keep: int) -> None:
        """Drop the last len(lines) - keep judged lines from the verifier sequence."""
        drop = sum(len(line) for line in lines[keep:])
        if drop:
            self.engine.truncate(seq, len(self.engine.tokens(seq)) - drop)


def _split_means(logp: np.ndarray, lines: Sequence[Sequence[int]]) -> list[float]:
    out, pos = [], 0
    for line in lines:
        out.append(float(np.mean(logp[pos:pos + len(line)])))
        pos += len(line)
    return out


def step_auroc(scores: Sequence[float], correct: Sequence[bool]) -> float:
    """Probability a correct step outscores a wrong one (ties count half); nan if one class."""
    s, c = np.asarray(scores, float), np.asarray(correct, bool)
    pos, neg = s[c], s[~c]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    # Mann-Whitney U / (n_pos n_neg) is the AUROC (ties count half)
    return float(stats.mannwhitneyu(pos, neg).statistic / (pos.size * neg.size))


_LINE_RE = re.compile(r"\s*(-?\d+)\s*([+-])\s*(\d+)\s*=\s*(-?\d+)\s*")
_FINAL_RE = re.compile(r"\s*Answer:\s*(-?\d+)\s*")


class ProcessVerifier:
    """An exact, programmatic process verifier: checks every line of a solution path.

    It reads the problem from its text (`Problem: Start with 7. Add 5. Subtract 3.`) and
    accepts line i when it is `a op b = c` with `a` the previous line's result (the start
    value for the first line), `op b` the problem's i-th operation and `c = a op b`
    exactly; the line after the last operation must be `Answer: v` with v the last result.
    A line is judged in the context of the path's earlier lines (a wrong earlier line
    makes every later line fail). It costs no model call: `stats.calls` counts lines
    checked, `stats.forward_calls` and `stats.tokens` stay 0.
    """

    def __init__(self, task):
        self.task = task
        self.stats = VerifierStats()
        self._parsed: dict[str, tuple] = {}

    def check(self, problem, lines: Sequence[str], first: int = 0) -> list[bool]:
        """Whether each of lines[first:] is a correct step given the lines before it."""
        if not 0 <= first <= len(lines):
            raise ValueError(f"first must be in [0, {len(lines)}], got {first}")
        text = self.task.problem_prompt(problem)
        if text not in self._parsed:
            self._parsed[text] = parse_problem(text)
        start, ops = self._parsed[text]
        value, ok, out = start, True, []
        for i, line in enumerate(lines):
            if i < len(ops):
                m = _LINE_RE.fullmatch(line)
                good = False
                if m and ok:
                    a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
                    good = (a == value and (op, b) == ops[i]
                            and c == (a + b if op == "+" else a - b))
                    value = c
            else:
                m = _FINAL_RE.fullmatch(line)
                good = bool(m and ok and i == len(ops) and int(m[1]) == value)
            ok = ok and good
            if i >= first:
                out.append(ok)
        self.stats.calls += len(out)
        return out
