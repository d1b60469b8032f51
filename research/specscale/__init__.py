"""SpecScale: speculative search control for test-time scaling on a prefix-shared paged KV cache.

    engine = PagedEngine(model, n_blocks=2048, max_len=512, temperature=0.8)
    ctx = SearchContext(engine, tokenizer, ArithmeticChains())
    result = run_search(ctx, problems, specscale(beam_width=2, expand=4))
"""
from research.specscale.engine import EngineStats, PagedEngine
from research.specscale.metrics import paired_bootstrap_diff, wilson_interval
from research.specscale.search import (SearchConfig, SearchContext, SearchResult, beam_search,
                                       best_of_n, merge_results, run_search, single_sample,
                                       specscale)
from research.specscale.tasks import ArithmeticChains, Problem
from research.specscale.verifier import LikelihoodVerifier, step_auroc

__all__ = ["EngineStats", "PagedEngine", "SearchConfig", "SearchContext", "SearchResult",
           "beam_search", "best_of_n", "run_search", "single_sample", "specscale",
           "LikelihoodVerifier", "step_auroc", "merge_results", "ArithmeticChains", "Problem",
           "paired_bootstrap_diff", "wilson_interval"]
