"""Arithmetic chains: "Start with 7. Add 5. Subtract 3." solved one step per line.

A solution is explicit steps, one line each, then the answer:

    7 + 5 = 12
    12 - 3 = 9
    Answer: 9

so a search can branch and be verified line by line. Problems are drawn from a seeded
generator (the same `seed` gives the same problems); the few-shot examples in the prompts
come from a separate fixed stream and are dev problems by construction (`examples` keeps
only problems whose content hashes into the dev split), so no test problem is ever shown
as a worked example. Checking is
programmatic (`check`): the number after the first "Answer:" must equal the true result.

Difficulty knobs: `n_steps`, the start range and the operand range (the experiment's
configs choose them on the dev split so that one sample is mostly wrong).

Dev and test problems are disjoint by construction (docs/protocol.md): with
`split="dev"|"test"`, `problems` keeps only problems whose content (start, operations)
hashes into that split (`research.core.splits`, salt `SPLIT_SALT`), so a dev seed and a
test seed can never score the same problem.
"""
from __future__ import annotations

import dataclasses
import itertools
import random
import re

from research.core import splits

ANSWER_PREFIX = "Answer:"
_ANSWER_RE = re.compile(r"Answer:\s*(-?\d+)")
_STEP_RE = re.compile(r"\s*(-?\d+) ([+-]) (\d+) = (-?\d+)\s*")
_OP_WORDS = {"+": "Add", "-": "Subtract"}
INSTRUCTION = "Solve the arithmetic chain one step per line, then give the answer.\n\n"
EXAMPLE_SEED = 10_007  # the few-shot stream; evaluated problems use the caller's seed
SPLIT_SALT = "arith"


@dataclasses.dataclass(frozen=True)
class Problem:
    uid: int
    start: int
    ops: tuple[tuple[str, int], ...]  # ("+", 5), ("-", 3), ...

    @property
    def answer(self) -> int:
        value = self.start
        for op, b in self.ops:
            value = value + b if op == "+" else value - b
        return value

    @property
    def text(self) -> str:
        ops = " ".join(f"{_OP_WORDS[op]} {b}." for op, b in self.ops)
        return f"Problem: Start with {self.start}. {ops}\n"

    def solution(self) -> str:
        """The reference solution text, in the step format the prompts teach."""
        lines, value = [], self.start
        for op, b in self.ops:
            new = value + b if op == "+" else value - b
            lines.append(f"{value} {op} {b} = {new}")
            value = new
        return "\n".join(lines) + f"\n{ANSWER_PREFIX} {value}\n"


def problem_key(p: Problem) -> str:
    """A problem's identity for splitting: its numbers, not its uid or seed."""
    return repr((p.start, p.ops))


def parse_problem(text: str) -> tuple[int, tuple[tuple[str, int], ...]]:
    """(start, operations) read back from a problem's text ("Start with 7. Add 5. ...")."""
    m = re.match(r"\s*Problem: Start with (\d+)\.((?: (?:Add|Subtract) \d+\.)*)\s*$", text)
    if not m:
        raise ValueError(f"not an arithmetic-chain problem text: {text!r}")
    words = {w: op for op, w in _OP_WORDS.items()}
    ops = tuple((words[w], int(b)) for w, b in re.findall(r"(Add|Subtract) (\d+)\.", m[2]))
    return int(m[1]), ops


@dataclasses.dataclass(frozen=True)
class ArithmeticChains:
    """The task family. All numbers are non-negative at every step.

    n_steps: operations per problem; start_range / operand_range: inclusive bounds.
    n_shots: worked examples in the generator prompt; verifier_shots: in the verifier's.
    """

    n_steps: int = 2
    start_range: tuple[int, int] = (2, 9)
    operand_range: tuple[int, int] = (1, 9)
    n_shots: int = 2
    verifier_shots: int = 8

    def __post_init__(self):
        if self.n_steps < 1:
            raise ValueError(f"n_steps must be >= 1, got {self.n_steps}")
        for name in ("start_range", "operand_range"):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi:
                raise ValueError(f"{name} must be (lo, hi) with 0 <= lo <= hi, got {(lo, hi)}")
        if self.n_shots < 0 or self.verifier_shots < 0:
            raise ValueError(f"n_shots and verifier_shots must be >= 0, got "
                             f"{self.n_shots}, {self.verifier_shots}")

    # -- problems ---------------------------------------------------------------------
    def problems(self, n: int, seed: int, split: str | None = None) -> list[Problem]:
        """n problems from the seeded stream; with `split` ("dev" / "test"), the first n
        distinct problems of the stream that belong to that split (disjoint by content)."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        rng = random.Random(seed)
        if split is None:
            return [self._draw(rng, uid=i) for i in range(n)]
        stream = (self._draw(rng, uid=0) for _ in itertools.count())
        chosen = splits.take(stream, split, n, salt=SPLIT_SALT, key=problem_key)
        return [dataclasses.replace(p, uid=i) for i, p in enumerate(chosen)]

    def _draw(self, rng: random.Random, uid: int) -> Problem:
        start = value = rng.randint(*self.start_range)
        lo, hi = self.operand_range
        ops = []
        for _ in range(self.n_steps):
            if rng.random() < 0.5 or value < max(lo, 1):
                b = rng.randint(lo, hi)
                value += b
                ops.append(("+", b))
            else:
                b = rng.randint(max(lo, 1), min(hi, value))
                value -= b
                ops.append(("-", b))
        return Problem(uid, start, tuple(ops))

    def examples(self, k: int) -> list[Problem]:
        """The first k distinct **dev** problems of the fixed example stream (EXAMPLE_SEED):
        few-shot examples are drawn from dev by construction, never from test (k=2 is a
        prefix of k=8, so the generator's shots are among the verifier's)."""
        if k < 1:
            return []
        rng = random.Random(EXAMPLE_SEED)
        stream = (self._draw(rng, uid=0) for _ in itertools.count())
        chosen = splits.take(stream, "dev", k, salt=SPLIT_SALT, key=problem_key)
        return [dataclasses.replace(p, uid=-1 - i) for i, p in enumerate(chosen)]

    # -- prompts ----------------------------------------------------------------------
    def shared_prompt(self, verifier: bool = False) -> str:
        """Instruction + worked examples: identical for every problem (a shared prefix)."""
        shots = self.examples(self.verifier_shots if verifier else self.n_shots)
        return INSTRUCTION + "".join(p.text + p.solution() + "\n" for p in shots)

    def problem_prompt(self, problem: Problem) -> str:
        """What follows the shared prompt for one problem; the solution comes next."""
        return problem.text

    # -- checking ---------------------------------------------------------------------
    @staticmethod
    def parse_answer(text: str) -> int | None:
        m = _ANSWER_RE.search(text)
        return int(m.group(1)) if m else None

    def check(self, problem: Problem, text: str) -> bool:
        return self.parse_answer(text) == problem.answer

    @staticmethod
    def is_final_line(line: str) -> bool:
        return line.strip().startswith(ANSWER_PREFIX)

    def step_is_correct(self, problem: Problem, lines: list[str], k: int) -> bool:
        """Ground truth for step k given the previous lines (for analysing verifiers only)."""
        value = problem.start
        for i, line in enumerate(lines[:k + 1]):
            if i == len(problem.ops):
                return self.parse_answer(line) == value and self.is_final_line(line)
            m = _STEP_RE.fullmatch(line)
            if not m or i > len(problem.ops):
                return False
            a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
            if (a, op, b) != (value, *problem.ops[i]) or c != (a + b if op == "+" else a - b):
                return False
            value = c
        return True

