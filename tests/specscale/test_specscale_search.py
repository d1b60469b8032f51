"""Search methods on a tiny random model: invariants, no leaks, ablation consistency."""
import dataclasses

import numpy as np
import pytest

from research.specscale import search as S
from research.specscale.engine import PagedEngine, child_key
from research.specscale.tasks import ArithmeticChains

TASK = ArithmeticChains(n_shots=1, verifier_shots=2)
LIMITS = dict(max_lines=3, max_line_tokens=5)


@pytest.fixture(scope="module")
def ctx(char_model, char_tokenizer):
    engine = PagedEngine(char_model, n_blocks=400, block_size=8, max_len=512, temperature=1.0)
    return S.SearchContext(engine, char_tokenizer, TASK)


@pytest.fixture(scope="module")
def problems():
    return TASK.problems(3, seed=0)


def _run(ctx, problems, cfg):
    base = ctx.engine.blocks_in_use
    result = S.run_search(ctx, problems, cfg, seed=0, group_size=2)
    assert ctx.engine.blocks_in_use == base  # every group's sequences were freed
    assert len(result.problems) == len(problems)
    return result


def test_ingredients_only_remove_work(ctx, problems):
    beam = _run(ctx, problems, S.beam_search(2, 3, **LIMITS))
    pruned = _run(ctx, problems, S.specscale(2, 3, defer=1, reject_below=None,
                                             prune_margin=0.0, prune_token_logp=-3.0,
                                             dedup=False, **LIMITS))
    assert pruned.stats["verifier_judgements"] < beam.stats["verifier_judgements"]
    assert pruned.stats["generated_tokens"] <= beam.stats["generated_tokens"]
    deferred = _run(ctx, problems, S.specscale(2, 3, defer=3, reject_below=None,
                                               prune_margin=None, prune_token_logp=None,
                                               dedup=False, **LIMITS))
    assert deferred.stats["verify_calls"] < beam.stats["verify_calls"]


def test_rejection_rolls_back_and_keeps_one_path_per_problem(ctx, problems):
    # every line of the random model scores far below 0: all would be rejected
    res = _run(ctx, problems, S.specscale(2, 2, defer=2, reject_below=-0.001,
                                          prune_margin=None, prune_token_logp=None,
                                          dedup=True, **LIMITS))
    assert all(p.text for p in res.problems)  # a path survived for every problem


def test_best_of_n_and_single_sample(ctx, problems):
    one = _run(ctx, problems, S.single_sample(**LIMITS))
    bon = _run(ctx, problems, S.best_of_n(3, **LIMITS))
    assert one.stats["verifier_judgements"] == 0 and bon.stats["verifier_judgements"] > 0
    assert bon.stats["peak_kv_blocks"] > one.stats["peak_kv_blocks"]
    greedy = _run(ctx, problems, S.single_sample(greedy=True, **LIMITS))
    again = _run(ctx, problems, S.single_sample(greedy=True, **LIMITS))
    assert [p.text for p in greedy.problems] == [p.text for p in again.problems]


def test_dedup_merges_identical_paths(char_model, char_tokenizer, problems):
    """Greedy children are identical: dedup keeps one per beam and judges it once."""
    engine = PagedEngine(char_model, n_blocks=400, block_size=8, max_len=512, temperature=0.0)
    ctx = S.SearchContext(engine, char_tokenizer, TASK)
    plain = S.run_search(ctx, problems, S.beam_search(1, 4, **LIMITS), group_size=3)
    dedup = S.run_search(ctx, problems, S.specscale(1, 4, defer=1, reject_below=None,
                                                    prune_margin=None, prune_token_logp=None,
                                                    dedup=True, **LIMITS), group_size=3)
    assert [p.text for p in plain.problems] == [p.text for p in dedup.problems]
    assert dedup.stats["verifier_judgements"] * 4 == plain.stats["verifier_judgements"]
    assert dedup.stats["peak_kv_blocks"] < plain.stats["peak_kv_blocks"]
    ctx.close()
    assert engine.blocks_in_use == 0


def test_no_sharing_baseline_uses_more_blocks(char_model, char_tokenizer, problems):
    peaks = {}
    for share in (True, False):
        engine = PagedEngine(char_model, n_blocks=1200, block_size=8, max_len=512,
                             temperature=1.0, share_prefix=share)
        ctx = S.SearchContext(engine, char_tokenizer, TASK)
        res = S.run_search(ctx, problems, S.beam_search(2, 2, **LIMITS), group_size=3)
        peaks[share] = (res.stats["peak_kv_blocks"], [p.text for p in res.problems])
    assert peaks[True][1] == peaks[False][1]  # same search, same outputs
    assert peaks[True][0] * 2 < peaks[False][0]


def test_process_checks_rank_correct_paths_first(ctx, problems):
    """A path with a failed process check ranks below every path without one, whatever
    their likelihoods; beam search keeps the checked paths."""
    searcher = S._Searcher(ctx, S.beam_search(2, 2, process=True, **LIMITS), 0, problems)
    searcher._drop = lambda c: setattr(c, "alive", False)

    def cand(score, ok, rank):
        return S.Candidate(slot=0, gen=-1, ver=-1, ver_scores=[score], checks=[ok],
                           paths=[(rank, np.array([rank, 1], np.uint32))])

    likely_wrong, unlikely_right, right = cand(-0.1, False, 0), cand(-5.0, True, 1), \
        cand(-3.0, True, 2)
    assert likely_wrong.score == pytest.approx(-0.1 - S.PROCESS_PENALTY)
    live = searcher._select([likely_wrong, unlikely_right, right], {0: []})
    assert live[0] == [right, unlikely_right] and not likely_wrong.alive


def test_process_prune_drops_failing_lines_before_verification(ctx, problems):
    """The random model's lines all fail the exact check: process pruning drops them the
    moment they close (keeping one per problem), so far fewer lines reach the likelihood
    verifier, and every problem still ends with a path."""
    kw = dict(prune_margin=None, prune_token_logp=None, dedup=False, **LIMITS)
    plain = _run(ctx, problems, S.specscale(2, 3, process=True, process_prune=False, **kw))
    pruned = _run(ctx, problems, S.specscale(2, 3, process=True, process_prune=True, **kw))
    assert pruned.stats["verifier_judgements"] < plain.stats["verifier_judgements"]
    assert pruned.stats["process_checks"] > 0
    assert all(p.text for p in pruned.problems)


def test_config_validation():
    with pytest.raises(ValueError, match="process_prune needs process=True"):
        S.specscale(2, 2, process=False, process_prune=True)
    with pytest.raises(ValueError, match="plain beam search"):
        S.SearchConfig(method="beam", process=True, process_prune=True)
    with pytest.raises(ValueError, match="uses no verifier"):
        S.SearchConfig(method="single", process=True)
    with pytest.raises(ValueError, match="method"):
        S.SearchConfig(method="mcts")
    with pytest.raises(ValueError, match="beam_width"):
        S.beam_search(0, 2)
    with pytest.raises(ValueError, match="plain beam search"):
        S.SearchConfig(method="beam", dedup=True)
    with pytest.raises(ValueError, match="prune_margin"):
        S.specscale(2, 2, prune_margin=-1.0)
    with pytest.raises(ValueError, match="prune_token_logp"):
        S.specscale(2, 2, prune_token_logp=0.5)
    with pytest.raises(ValueError, match="group_size"):
        S.run_search(None, [1], S.beam_search(1, 1), group_size=0)


def test_dedup_bundles_fill_beam_slots_by_weight(ctx, problems):
    """A bundle of w identical paths holds w beam slots (beam search would keep w copies,
    the first w in its order) and its next expansion carries w * E child lineages; without
    dedup it is plain top-W."""
    searcher = S._Searcher(ctx, S.specscale(2, 3, **LIMITS), 0, problems)
    searcher._drop = lambda c: setattr(c, "alive", False)  # no engine sequences here
    ranks = iter(range(100))

    def cand(score, weight):
        paths = [(next(ranks), np.array([i, 7], np.uint32)) for i in range(weight)]
        return S.Candidate(slot=0, gen=-1, ver=-1, ver_scores=[score], paths=paths)

    best, second, third = cand(-1.0, 3), cand(-2.0, 1), cand(-3.0, 1)
    first_two = best.paths[:2]
    live = searcher._select([third, best, second], {0: []})
    assert live[0] == [best] and best.paths == first_two  # both slots taken by the bundle
    assert not second.alive and not third.alive
    assert searcher._children(best, 3) == [best] and best.weight == 6
    assert [k.tolist() for _, k in best.paths] == [
        child_key(key, e).tolist() for _, key in first_two for e in range(3)]
    a, b, c = cand(-1.0, 1), cand(-2.0, 1), cand(-3.0, 1)
    assert searcher._select([c, a, b], {0: []})[0] == [a, b] and not c.alive
    tie_late, tie_early = cand(-1.0, 1), cand(-9.0, 1)
    tie_early.paths[0] = (-1, tie_early.paths[0][1])  # created first by beam search
    tie_early.ver_scores = [-1.0]
    assert searcher._select([tie_late, tie_early], {0: []})[0] == [tie_early, tie_late]
    done = [cand(-0.5, 2)]  # W finished paths end the problem's search
    assert searcher._select([cand(-1.0, 1)], {0: done})[0] == []


@pytest.mark.parametrize("width,expand", [pytest.param(2, 3, marks=pytest.mark.slow),  # ~16 s
                                          (1, 4)])
def test_dedup_alone_makes_beam_search_decisions_at_less_cost(char_model, char_tokenizer,
                                                              problems, width, expand):
    """Same seeds: dedup reproduces beam search's paths and scores exactly (every child
    draws with its own lineage key) while generating and judging each distinct path once.
    A low temperature makes the random model repeat itself, so there is work to merge."""
    engine = PagedEngine(char_model, n_blocks=800, block_size=8, max_len=512, temperature=0.03)
    ctx = S.SearchContext(engine, char_tokenizer, TASK)
    beam = S.run_search(ctx, problems, S.beam_search(width, expand, **LIMITS), seed=5)
    dedup = S.run_search(ctx, problems, S.specscale(width, expand, reject_below=None,
                                                    prune_margin=None, prune_token_logp=None,
                                                    dedup=True, process=False,
                                                    process_prune=False, **LIMITS), seed=5)
    assert [p.text for p in beam.problems] == [p.text for p in dedup.problems]
    assert [p.score for p in beam.problems] == pytest.approx(
        [p.score for p in dedup.problems], abs=1e-5)
    for key in ("generated_tokens", "tokens_computed"):
        assert dedup.stats[key] < beam.stats[key], key
    for key in ("verifier_judgements", "peak_kv_blocks"):
        assert dedup.stats[key] <= beam.stats[key], key
    ctx.close()
    assert engine.blocks_in_use == 0


def test_specscale_serves_a_tasq_1bit_model_from_pages_of_codes(char_model, char_tokenizer,
                                                                problems):
    """TaSQ's 1-bit codes live in the engine's pages (shared prefixes, COW forks): the
    search runs, greedy decoding equals the dense-layout TaSQ model, and a block costs
    the codes' bytes, not f32 K/V's."""
    from research.decode.generate import generate
    from research.tasq import TaSQConfig, tasq
    from research.transforms import CalibrationData, calibrate_and_apply
    rng = np.random.default_rng(0)
    cal = CalibrationData.from_ids(rng.integers(32, 127, 256), 64, 4)
    cfg = TaSQConfig(bits=1, kmeans_iters=2, max_points=256, key_space="post_rope")
    model, _ = calibrate_and_apply(tasq(cfg), char_model, cal)
    f32 = PagedEngine(char_model, n_blocks=400, block_size=8, max_len=512)
    eng = PagedEngine(model, n_blocks=400, block_size=8, max_len=512, temperature=0.0)
    assert all(c.describe().startswith("paged8[tasq[1b/ch") for c in eng.model.caches)
    assert all(p["k_codes"].dtype == np.uint8 for p in eng.pools)
    assert eng.block_bytes * 32 == f32.block_bytes  # 1 byte per 8 channels vs 4 bytes each
    prompt = [ord(c) for c in "12+3=15\n"]
    want = generate(model, [prompt], max_new_tokens=6).tokens[0]
    seq = eng.new_sequence(prompt)
    eng.prefill([seq])
    kid = eng.fork(seq)  # shares the codes' blocks
    assert [int(eng.sample([kid])[0][0]) for _ in range(6)] == want
    eng.free(kid)
    eng.free(seq)
    eng.temperature = 1.0
    _run(S.SearchContext(eng, char_tokenizer, TASK), problems, S.specscale(2, 2, **LIMITS))
