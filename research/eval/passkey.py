"""Passkey retrieval: a random 5-digit key hidden in filler text, asked for at the end.

The classic prompt (Mohtashami & Jaggi's landmark-attention test, as LongLoRA and KV-cache
papers run it):

    There is an important info hidden inside a lot of irrelevant text. Find it and memorize
    it. I will quiz you about the important information there. <filler> The pass key is
    71432. Remember it. 71432 is the pass key. <filler> What is the pass key? The pass key is

`passkey_trials` builds `n_trials` such prompts of `length` tokens (within
LENGTH_TOLERANCE below it), the key at depths spread evenly over 0-100% of the filler,
the filler read from a given text from a random word onward (cyclically, so a short dev
text fills any length). Everything random comes from `seed` (and `length`), so the trials
are a pure function of their arguments. Dev and test are disjoint by the filler: the
caller passes dev text for dev and test text for test.

`template="chat"` wraps the same text in the tokenizer's chat template (the question in
the user turn, "The pass key is" opening the assistant's), for instruct models.

`write_lm_eval_task` writes the same trials as an lm-evaluation-harness local task
(generate_until, the first number before ANSWER_STOP, exact match on the key), to be run
with `local-completions` against servax's OpenAI server.

`passkey_accuracy` decodes greedily (`research.decode.generate`: the prompt prefilled in
pieces, so 8k tokens fit) and reads the answer as the first number before the first
newline (ANSWER_STOP), the way the lm-eval task reads the server's completion, cut at
the same stop string.
"""
from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np

HEAD = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
        "memorize it. I will quiz you about the important information there.")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key?"
ANSWER_PREFIX = "The pass key is"
TEMPLATES = ("plain", "chat")
LENGTH_TOLERANCE = 16  # a trial's prompt has length - LENGTH_TOLERANCE .. length tokens
ANSWER_STOP = "\n"  # the answer is read from the generation up to here
_FIT_TRIES = 8


class PasskeyTrial(NamedTuple):
    prompt: str
    ids: tuple[int, ...]  # tokenizer.encode(prompt)
    key: str  # five digits
    depth: float  # where the needle sits in the filler: 0 (first) .. 1 (last)


class PasskeyResult(NamedTuple):
    accuracy: float
    correct: tuple[bool, ...]  # per trial
    answers: tuple[str | None, ...]  # the first number read, None if there was none
    generations: tuple[str, ...]  # the decoded greedy continuation


def passkey_trials(tokenizer, length: int, n_trials: int, seed: int, filler: str, *,
                   template: str = "plain") -> list[PasskeyTrial]:
    """`n_trials` passkey prompts of `length` - LENGTH_TOLERANCE .. `length` tokens, trial i
    with its key at depth i / (n_trials - 1) of the filler (module docstring)."""
    if n_trials < 1:
        raise ValueError(f"n_trials must be >= 1, got {n_trials}")
    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {TEMPLATES}, got {template!r}")
    filler_ids = np.asarray(tokenizer.encode(filler.strip()), np.int64) if filler else []
    if len(filler_ids) < 64:
        raise ValueError(f"filler must hold at least 64 tokens of text, got "
                         f"{len(filler_ids)}")
    empty = len(tokenizer.encode(_render(tokenizer, "", "", "00000", template)))
    if length < empty + 2 * LENGTH_TOLERANCE:
        raise ValueError(f"length must be >= {empty + 2 * LENGTH_TOLERANCE} tokens (the "
                         f"prompt without filler has {empty}), got {length}")
    vocab = np.unique(filler_ids)
    spaced = np.array([tokenizer.decode([int(t)])[:1].isspace() for t in vocab])
    word_start = spaced[np.searchsorted(vocab, filler_ids)]  # the token begins a word
    starts = np.flatnonzero(word_start)
    if not len(starts):
        raise ValueError("filler has no whitespace: it must be text of several words")
    rng = np.random.default_rng([seed, length])
    depths = np.linspace(0.0, 1.0, n_trials) if n_trials > 1 else np.zeros(1)
    out = []
    for depth in depths:
        offset = int(rng.choice(starts))
        while True:  # a key the filler happens to hold is drawn again
            key = str(int(rng.integers(10_000, 100_000)))
            trial = _fit(tokenizer, filler_ids, word_start, offset, key, float(depth),
                         length, length - empty, template)
            if trial.prompt.count(key) == 2:
                break
        out.append(trial)
    return out


def _fit(tokenizer, filler_ids, word_start, offset, key, depth, length, budget,
         template) -> PasskeyTrial:
    """The trial with as much filler as fits `length`: `budget` filler tokens, corrected by
    how far re-tokenizing the whole prompt (merges at the joins) lands from the target."""
    n = len(filler_ids)
    target = length - LENGTH_TOLERANCE // 2
    for _ in range(_FIT_TRIES):
        idx = (offset + np.arange(max(budget, 0))) % n
        cut = _word_cut(word_start[idx], round(depth * len(idx)))
        end = _word_cut(word_start[idx], len(idx))
        before = tokenizer.decode([int(t) for t in filler_ids[idx[:cut]]])
        after = tokenizer.decode([int(t) for t in filler_ids[idx[cut:end]]])
        prompt = _render(tokenizer, before, after, key, template)
        ids = tokenizer.encode(prompt)
        if length - LENGTH_TOLERANCE <= len(ids) <= length:
            return PasskeyTrial(prompt, tuple(ids), key, depth)
        budget -= len(ids) - target
    raise ValueError(f"could not fit a passkey prompt to {length} tokens (last try "
                     f"{len(ids)}): is the filler ordinary text?")


def _word_cut(word_start, i: int) -> int:
    """The largest j <= i where a word starts (a cut there splits no word), 0 if none."""
    hits = np.flatnonzero(word_start[:i + 1])
    return int(hits[-1]) if len(hits) else 0


def _render(tokenizer, before: str, after: str, key: str, template: str) -> str:
    body = " ".join(p for p in (HEAD, before.strip(), NEEDLE.format(key=key), after.strip(),
                                QUESTION) if p)
    if template == "plain":
        return f"{body} {ANSWER_PREFIX}"
    return tokenizer.apply_chat_template([{"role": "user", "content": body}]) + ANSWER_PREFIX


def first_number(generation: str) -> str | None:
    """The answer a generation gives: its first run of digits before ANSWER_STOP."""
    m = re.search(r"\d+", generation.split(ANSWER_STOP, 1)[0])
    return m.group(0) if m else None


def passkey_accuracy(model, tokenizer, trials: Sequence[PasskeyTrial], *,
                     max_new_tokens: int = 8, batch_size: int = 4,
                     prefill_chunk: int = 512, label: str = "") -> PasskeyResult:
    """Greedy-decode `max_new_tokens` after each trial's prompt (batches of `batch_size`,
    the last padded with copies so every batch compiles once) and score the first number
    read (`first_number`) against the key. Logs progress after each batch (an 8k trial
    takes minutes on a CPU), prefixed with `label`."""
    from research.decode.generate import PAD_BUCKET, default_stop_tokens, generate, round_up
    if not trials:
        raise ValueError("trials is empty: pass at least one PasskeyTrial")
    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"batch_size and max_new_tokens must be >= 1, got {batch_size}, "
                         f"{max_new_tokens}")
    longest = max(len(t.ids) for t in trials)
    max_len = round_up(longest + max_new_tokens, PAD_BUCKET)  # one cache shape for all
    if longest + max_new_tokens > model.config.max_position:
        raise ValueError(f"the longest prompt ({longest} tokens) + max_new_tokens="
                         f"{max_new_tokens} exceeds the model's max_position="
                         f"{model.config.max_position}")
    max_len = min(max_len, model.config.max_position)
    stops = default_stop_tokens(tokenizer)
    generations, answers, correct, t0 = [], [], [], time.perf_counter()
    for i in range(0, len(trials), batch_size):
        batch = [t.ids for t in trials[i:i + batch_size]]
        padded = batch + [batch[-1]] * (batch_size - len(batch))
        gen = generate(model, padded, max_new_tokens=max_new_tokens, stop_tokens=stops,
                       max_len=max_len, prefill_chunk=prefill_chunk)
        generations += [tokenizer.decode(t, skip_special=True)
                        for t in gen.tokens[:len(batch)]]
        answers += [first_number(g) for g in generations[len(answers):]]
        correct += [a == t.key for a, t in zip(answers[len(correct):], trials[len(correct):])]
        logging.getLogger("servax.passkey").info(
            "passkey %s: %d trials done, %d keys found, %.0f s per trial so far",
            label, len(answers), sum(correct), (time.perf_counter() - t0) / len(answers))
    return PasskeyResult(sum(correct) / len(trials), tuple(correct), tuple(answers),
                         tuple(generations))


LM_EVAL_TASK = """\
# servax passkey retrieval (research/eval/passkey.py): greedy generate_until, the first
# number before the first newline, exact match on the key
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{key}}}}"
generation_kwargs:
  until: {until}
  max_gen_toks: {max_new_tokens}
  do_sample: false
  temperature: 0
filter_list:
  - name: first_number
    filter:
      - function: regex
        regex_pattern: '(\\d+)'
        group_select: 0
        fallback: "[none]"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def write_lm_eval_task(trials: Sequence[PasskeyTrial], out_dir, *,
                       task: str = "servax_passkey", max_new_tokens: int = 8) -> Path:
    """`trials` as an lm-eval local task `task` in `out_dir` (<task>.jsonl + <task>.yaml,
    the data path absolute): run it with `--include_path out_dir --tasks <task>`; its
    metric is exact_match,first_number. Returns the YAML's path."""
    if not trials:
        raise ValueError("trials is empty: pass at least one PasskeyTrial")
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", task):
        raise ValueError(f"task must be an identifier (letters, digits, _), got {task!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = out / f"{task}.jsonl"
    with open(data, "w") as f:
        for t in trials:
            f.write(json.dumps({"prompt": t.prompt, "key": t.key, "depth": t.depth}) + "\n")
    yaml = out / f"{task}.yaml"
    yaml.write_text(LM_EVAL_TASK.format(task=task, data=json.dumps(str(data.resolve())),
                                        until=json.dumps([ANSWER_STOP]),
                                        max_new_tokens=max_new_tokens))
    return yaml
