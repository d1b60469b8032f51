"""Evaluation tasks for the one-context, many-queries setting.

* Continuation: a long held-out document prefix is the context; several later passages of
  the same document are the queries, each placed right after the context and scored by
  teacher-forced perplexity.
* Retrieval: key-value facts ("The access code for Maria is 4821.") scattered through
  filler paragraphs form the context (inside a chat user turn; each fact is stated twice
  in its own paragraph, the format in which SmolLM2-135M-Instruct answers reliably with a
  full cache: 12/12 at 4 facts in 512 tokens, vs 0.58-0.83 for single-sentence facts);
  each question ("What is the
  access code for Maria?") is a query appended after it, answered greedily and scored by
  exact match of the number. The context does not depend on the question, so a press
  cannot look at the question when it compresses (the query-agnostic setting).
"""
from __future__ import annotations

import re
from typing import NamedTuple, Sequence

import numpy as np

NAMES = ("Maria", "Oscar", "Helen", "Victor", "Nadia", "Felix", "Irene", "Pablo", "Greta",
         "Hugo", "Lena", "Tomas", "Clara", "Omar", "Sofia", "Anton")
_USER_OPEN = "<|im_start|>user\n"
FACT_TOKENS = 30  # room reserved per fact paragraph


class ContinuationTask(NamedTuple):
    context: np.ndarray  # [n_ctx] token ids
    continuations: np.ndarray  # [Q, m] token ids, each placed right after the context
    window: tuple[int, int] = (0, 0)  # [start, end) of context + continuations in the text


class RetrievalTask(NamedTuple):
    context: np.ndarray  # [n_ctx] token ids (system turn + user turn with the document)
    questions: list[np.ndarray]  # token ids of each question suffix (ends the user turn)
    answers: list[str]  # the expected number per question
    n_facts: int


SPLITS = ("dev", "test")


def split_range(n_tokens: int, split: str) -> tuple[int, int]:
    """[start, end) of a split of an evaluation token stream: "dev" is the first half,
    "test" the second, so contexts drawn inside their split's range (`continuation_tasks`
    on `ids[start:end]`) are disjoint from the other split's by construction."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not (isinstance(n_tokens, (int, np.integer)) and n_tokens >= 2):
        raise ValueError(f"n_tokens must be an int >= 2, got {n_tokens!r}")
    half = int(n_tokens) // 2
    return (0, half) if split == "dev" else (half, int(n_tokens))


def check_windows_in_split(windows, n_tokens: int, split: str) -> None:
    """Raise unless every [start, end) token window lies inside `split`'s range (hence
    outside the other split's)."""
    lo, hi = split_range(n_tokens, split)
    bad = [tuple(map(int, w)) for w in windows if not lo <= w[0] < w[1] <= hi]
    if bad:
        raise ValueError(f"{split} windows {bad} leave the {split} range [{lo}, {hi}) of "
                         f"{n_tokens} tokens: dev and test contexts would overlap")


def continuation_tasks(ids: Sequence[int], *, n_contexts: int, context_len: int,
                       n_continuations: int, continuation_len: int,
                       offset: int = 0) -> list[ContinuationTask]:
    """Contexts spread evenly over `ids[offset:]`; continuation j = the j-th
    `continuation_len`-token passage after the context (the first is the true
    continuation). A non-zero `offset` gives contexts disjoint from the offset-0 ones
    (a dev split for tuning, when the offset exceeds the span the offset-0 run uses)."""
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    ids = np.asarray(ids, np.int32)[offset:]
    span = context_len + n_continuations * continuation_len
    if min(n_contexts, context_len, n_continuations, continuation_len) < 1:
        raise ValueError("n_contexts, context_len, n_continuations and continuation_len "
                         "must all be >= 1")
    if len(ids) < span * n_contexts:
        raise ValueError(f"text has {len(ids)} tokens; {n_contexts} contexts of {span} "
                         f"tokens need {span * n_contexts}")
    stride = len(ids) // n_contexts
    tasks = []
    for i in range(n_contexts):
        s = i * stride
        conts = ids[s + context_len:s + span].reshape(n_continuations, continuation_len)
        tasks.append(ContinuationTask(ids[s:s + context_len], conts,
                                      (offset + s, offset + s + span)))
    return tasks


def retrieval_task(tokenizer, filler_ids: Sequence[int], *, n_facts: int, context_len: int,
                   seed: int) -> RetrievalTask:
    """Facts placed at evenly spread depths of ~`context_len` tokens of filler prose."""
    if not 1 <= n_facts <= len(NAMES):
        raise ValueError(f"n_facts must be in [1, {len(NAMES)}], got {n_facts}")
    rng = np.random.default_rng(seed)
    names = rng.choice(NAMES, n_facts, replace=False)
    codes = [str(c) for c in rng.choice(np.arange(1000, 10000), n_facts, replace=False)]
    head = tokenizer.apply_chat_template([{"role": "user", "content": "X"}])
    head = head[:head.index(_USER_OPEN) + len(_USER_OPEN)]
    intro = "Read the document and remember the access codes.\n\n"
    fixed = len(tokenizer.encode(head + intro))
    n_filler = context_len - fixed - FACT_TOKENS * n_facts
    if n_filler < n_facts:
        raise ValueError(f"context_len={context_len} is too short for {n_facts} facts")
    start = int(rng.integers(0, max(1, len(filler_ids) - n_filler)))
    filler = tokenizer.decode(list(filler_ids[start:start + n_filler]))
    words = filler.split(" ")
    cuts = np.linspace(0, len(words), n_facts + 1).astype(int)
    parts = []
    for i, (name, code) in enumerate(zip(names, codes)):
        parts.append(" ".join(words[cuts[i]:cuts[i + 1]]))
        parts.append(f"The access code for {name} is {code}. Remember: {name} has access "
                     f"code {code}.")
    document = "\n\n".join(parts)
    context = tokenizer.encode(head + intro + document + "\n\n")
    # The answer is primed ("... is") so a short greedy decode yields the number.
    questions = [tokenizer.encode(f"Question: What is the access code for {name}?<|im_end|>\n"
                                  f"<|im_start|>assistant\nThe access code for {name} is")
                 for name in names]
    return RetrievalTask(np.asarray(context, np.int32),
                         [np.asarray(q, np.int32) for q in questions], codes, n_facts)


def reply_prefix(tokenizer) -> tuple[int, ...]:
    """Token ids that close a chat user turn and open the assistant's reply, as the
    tokenizer's chat template writes them (for reply probes, research.patchkv.probes)."""
    marker = "\u2063"  # a character no template adds, to find where the user content ends
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}])
    return tuple(int(t) for t in tokenizer.encode(text[text.index(marker) + 1:]))


def exact_match(generated: str, answer: str) -> bool:
    """The first number in the generated text equals the answer."""
    found = re.search(r"\d+", generated)
    return found is not None and found.group(0) == answer
