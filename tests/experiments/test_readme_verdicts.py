"""The front page's verdicts in step with the results (issue 45 item 5): every **met** /
**missed** in README.md's "target met?" column is what the claims of the runs its row cites
compute, and no claim of a cited run is left out of the column.

A row cites the runs named `results/<run>/` in its "config → run" and "headline number"
cells. VERDICTS below maps each verdict of a row, a phrase of its cell holding exactly one
bold verdict word, to the claims behind it: (run, claim substring) selectors, run ANY for
any run the row cites. The checks:

1. the phrase's word is what its claims compute: all met -> **met**, all missed ->
   **missed**; claims that disagree (e.g. met on the test text, missed on the fresh text)
   must be split into two phrases, each qualified by its text / run;
2. every claim with a target in every cited results.json is behind exactly one phrase (a
   claim whose "met" is "n/a" reports a number without a target and needs none);
3. every selector matches at least one claim, and every bold word of the column is one
   listed phrase's.

A new citation or verdict is one line here. Only the README and results.json files are read.
"""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RUN = re.compile(r"results/([A-Za-z0-9_.\-]+)/")
BOLD = re.compile(r"\*\*([^*]+)\*\*")
WORDS = ("met", "missed")
ANY = "*"  # a selector's run: any run the row cites

VERDICTS: dict[str, list[tuple[str, list[tuple[str, str]]]]] = {
    "baseline": [
        ("bf16 within 1% of f32: **met**", [(ANY, "bf16 perplexity within 1% of f32")]),
    ],
    "TaSQ": [
        ("the default beats every 1-bit baseline: **met**",
         [(ANY, "pre-RoPE keys) (the default) ppl gap <")]),
        ("post-RoPE keys beat plain VQ and sign-bit: **met**",
         [(ANY, "post-RoPE keys) (not the default) ppl gap < plain VQ"),
          (ANY, "post-RoPE keys) (not the default) ppl gap < sign-bit")]),
        ("CQ-style: **missed**", [(ANY, "post-RoPE keys) (not the default) ppl gap < CQ-style")]),
        ("max batch >= 14x bf16's: **met**", [(ANY, "max batch vs bf16 at 1 bit")]),
        ("attention read >= 2x faster than bf16: **missed**",
         [(ANY, "decode attention vs bf16")]),
    ],
    "PatchKV": [
        ("**missed** on TaSQ", [(ANY, "tasq-1bit@3%: PatchKV closes")]),
        ("test text: **met**",
         [("patchkv_small_test", "snapkv@10%: PatchKV closes"),
          ("patchkv_small_test", "snapkv@25%: PatchKV closes"),
          ("patchkv_small_test", "streaming_llm@10%: PatchKV closes"),
          ("patchkv_small_test", "streaming_llm@25%: PatchKV closes"),
          ("patchkv_4k_test", "snapkv@10%: PatchKV closes")]),
        ("fresh text: **met** at SnapKV 10% / 25% and StreamingLLM 10%",
         [("patchkv_small_fresh", "snapkv@10%: PatchKV closes"),
          ("patchkv_small_fresh", "snapkv@25%: PatchKV closes"),
          ("patchkv_small_fresh", "streaming_llm@10%: PatchKV closes")]),
        ("**missed** at StreamingLLM 25% and at 4k",
         [("patchkv_small_fresh", "streaming_llm@25%: PatchKV closes"),
          ("patchkv_4k_fresh", "snapkv@10%: PatchKV closes")]),
        ("fewer bytes **missed** at 512 tokens",
         [("patchkv_small_test", "fewer total bytes"),
          ("patchkv_small_fresh", "fewer total bytes")]),
        ("**met** at 4k;", [("patchkv_4k_test", "fewer total bytes"),
                           ("patchkv_4k_fresh", "fewer total bytes")]),
        ("lower ppl **met** at 512 tokens",
         [("patchkv_small_test", "lower continuation ppl"),
          ("patchkv_small_fresh", "lower continuation ppl than snapkv@25%")]),
        ("StreamingLLM on fresh text (**missed**)",
         [("patchkv_small_fresh", "lower continuation ppl than streaming_llm@25%")]),
        ("**missed** at 4k (both texts)",
         [("patchkv_4k_test", "lower continuation ppl"),
          ("patchkv_4k_fresh", "lower continuation ppl")]),
        ("no per-query overhead: **met**", [(ANY, "zero per-query overhead")]),
    ],
    "MegaFlux": [
        ("gamma <= 1.10, >= 1.45x / 1.28x: **met**",
         [(ANY, "gamma, "), (ANY, "modeled fwd speedup"), (ANY, "modeled bwd speedup")]),
        ("beats EPLB under drift, equals the dense reference, dropless: **met**",
         [(ANY, "beats EPLB under drift"), (ANY, "== dense reference"),
          (ANY, "== dense model"), (ANY, "dropless")]),
    ],
    "SpecScale": [
        ("SpecScale at beam's accuracy and >= 2x its speed: **met** (200 problems)",
         [("specscale_full", "the best search beats greedy"),
          ("specscale_full", "SpecScale reaches"),
          ("specscale_full", "SpecScale throughput")]),
        ("speed **met**", [("specscale_small_fresh", "SpecScale throughput")]),
        ("accuracy **missed**", [("specscale_small_fresh", "the best search beats greedy"),
                                 ("specscale_small_fresh", "SpecScale reaches")]),
        ("peak KV <= 0.5x no-sharing: **met**",
         [(ANY, "one sample is mostly wrong"), (ANY, "peak KV blocks")]),
    ],
    "speculative decoding": [
        ("**met** on the original test prompts", [("specdecode_small", "wall speedup")]),
        ("**missed** on the fresh ones", [("specdecode_small_fresh", "wall speedup")]),
        ("sampling law = target law: **met**",
         [(ANY, "greedy output identical"), (ANY, "sampling law")]),
    ],
    "DynaCore": [
        ("**missed** on test text", [("dynacore_small", "W8A8 sq0.5 ppl within 1%")]),
        ("**met** on fresh text", [("dynacore_small_fresh", "W8A8 sq0.5 ppl within 1%")]),
        ("W4A16 within 5%: **missed**", [(ANY, "W4A16 g64 fzero gptq ppl within 5%")]),
        ("no worse than W4A16 alone: **met**", [(ANY, "DynaCore no worse than W4A16 alone")]),
        ("llama.cpp Q4_1: **missed**",
         [(ANY, "TTFT up to"), (ANY, "TPOT up to"), (ANY, "decode b1 >= llama.cpp")]),
        ("KV ~10 GB: **met**", [(ANY, "32k-token Llama-3.1-70B KV")]),
    ],
    "scale-out": [
        ("sharded logits == one device's (float caches): **met**",
         [(ANY, "sharded logits == single device")]),
        ("greedy identical on every row: **missed**", [(ANY, "greedy generation identical")]),
        ("no parameter / KV all-gather in decode: **met**",
         [(ANY, "no parameter / KV all-gather")]),
    ],
    "serving engine": [
        ("**met** for f32, bf16 and TaSQ at batch 8",
         [(ANY, f"engine / generate decode tok/s, {c}") for c in
          ("f32 batch 8", "f32 batch 32", "bf16 batch 8", "bf16 batch 32",
           "tasq-1bit batch 8")]),
        ("**missed** for TaSQ 1-bit at batch 32",
         [(ANY, "engine / generate decode tok/s, tasq-1bit batch 32")]),
        ("decode step at 2x max_len < 1.1x the step at max_len: **met**",
         [(ANY, "decode step at 2x max_len / at max_len")]),
        (">= 1.5x llama-server at saturation: **missed**",
         [("serving_peer_llamacpp_saturation", "servax / llama-server (batching peer)")]),
    ],
}


def _table() -> dict[str, dict[str, str]]:
    """README.md's results table: technique -> {column header: cell}."""
    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines)
                 if line.startswith("|") and "target met?" in line)
    header = [c.strip() for c in lines[start].strip().strip("|").split("|")]
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == len(header), f"a cell holds '|': {line[:60]}"
        rows[cells[0]] = dict(zip(header, cells))
    return rows


def _column(row: dict[str, str], prefix: str) -> str:
    return next(cell for name, cell in row.items() if name.startswith(prefix))


def _cited_runs(row: dict[str, str]) -> list[str]:
    text = _column(row, "config") + " " + _column(row, "headline")
    return list(dict.fromkeys(RUN.findall(text)))


def _status(met) -> str | None:
    """A claim's "met" as a verdict word; None for a claim without a target."""
    if met is True or met == "yes":
        return "met"
    if met is False or met == "no":
        return "missed"
    if met is None or met == "n/a":
        return None
    raise ValueError(f"unknown claim status {met!r}")


def _claims(run: str) -> list[tuple[str, str | None]]:
    payload = json.loads((ROOT / "results" / run / "results.json").read_text())
    return [(c["claim"], _status(c["met"])) for c in payload["claims"]]


def _readme_word(cell: str, phrase: str) -> tuple[int, str]:
    """Where in the cell the phrase's verdict word stands, and what the README says there
    (the phrase is found with its bold word read as either verdict)."""
    inner = list(BOLD.finditer(phrase))
    assert len(inner) == 1, f"{phrase!r} holds {len(inner)} verdict words, not 1"
    m = inner[0]
    pattern = (re.escape(phrase[:m.start()]) + r"\*\*(met|missed)\*\*"
               + re.escape(phrase[m.end():]))
    found = list(re.finditer(pattern, cell))
    assert len(found) == 1, f"{phrase!r} is {len(found)} times in the cell, not once: {cell}"
    return found[0].start(1) - 2, found[0].group(1)


def _selected(row: dict[str, str], selectors) -> dict[tuple[str, str], str]:
    """(run, claim) -> verdict word of every targeted claim the selectors pick."""
    runs = _cited_runs(row)
    picked = {}
    for run, part in selectors:
        assert run == ANY or run in runs, f"{run} is not cited by the row (cites {runs})"
        hits = {(r, claim): status for r in (runs if run == ANY else [run])
                for claim, status in _claims(r) if part in claim and status is not None}
        assert hits, f"selector ({run}, {part!r}) matches no claim with a target"
        picked.update(hits)
    return picked


def test_every_row_has_its_verdicts_listed():
    assert sorted(_table()) == sorted(VERDICTS)


@pytest.mark.parametrize("technique", sorted(VERDICTS))
def test_the_column_is_the_listed_phrases(technique):
    cell = _column(_table()[technique], "target met?")
    bold = [(m.start(), m.group(1)) for m in BOLD.finditer(cell)]
    assert all(word in WORDS for _, word in bold), f"bold that is not met / missed: {bold}"
    # an unbolded met / missed would escape the checks below
    assert not re.search(r"\b(met|missed)\b", BOLD.sub("", cell)), cell
    covered = [_readme_word(cell, phrase)[0] for phrase, _ in VERDICTS[technique]]
    assert sorted(covered) == [pos for pos, _ in bold], (
        f"verdict words no phrase stands for: "
        f"{[cell[p:p + 40] for p, _ in bold if p not in covered]}")


@pytest.mark.parametrize("technique", sorted(VERDICTS))
def test_each_verdict_is_what_its_claims_compute(technique):
    row = _table()[technique]
    cell = _column(row, "target met?")
    for phrase, selectors in VERDICTS[technique]:
        word = _readme_word(cell, phrase)[1]
        picked = _selected(row, selectors)
        computed = set(picked.values())
        if len(computed) > 1:
            pytest.fail(f"{technique}: {phrase!r} stands for claims that disagree; give both, "
                        f"each qualified by its text / run: {picked}")
        assert computed == {word}, (
            f"{technique}: README says {word!r} in {phrase!r}, the claims say "
            f"{computed.pop()}: {sorted(picked)}")


@pytest.mark.parametrize("technique", sorted(VERDICTS))
def test_every_claim_of_a_cited_run_is_behind_one_verdict(technique):
    row = _table()[technique]
    runs = _cited_runs(row)
    assert runs, f"{technique} cites no results/<run>/"
    count = {}
    for _, selectors in VERDICTS[technique]:
        for key in _selected(row, selectors):
            count[key] = count.get(key, 0) + 1
    targeted = [(run, claim) for run in runs for claim, status in _claims(run)
                if status is not None]
    left_out = [key for key in targeted if key not in count]
    assert not left_out, f"{technique}: claims no verdict stands for: {left_out}"
    twice = [key for key, n in count.items() if n > 1]
    assert not twice, f"{technique}: claims behind more than one verdict: {twice}"


def test_status_reads_both_spellings():
    assert [_status(m) for m in ("yes", True, "no", False, "n/a", None)] == [
        "met", "met", "missed", "missed", None, None]
    with pytest.raises(ValueError):
        _status("maybe")
