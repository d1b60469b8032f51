"""Token-level speculative decoding with exactly the target's output distribution.

    from research.specdecode import speculative_generate, prompt_lookup, DraftLengthPolicy
    gen = speculative_generate(model, prompts, drafter=prompt_lookup(), max_new_tokens=64)

Drafters (`drafters.py`): prompt lookup (n-gram copy from the context), self-speculative
(early exit / layer skipping with the shared head and caches), a separate draft model.
Verification (`verify.py`): k drafted tokens in one target forward, exact rejection
sampling. Rollback (`rollback.py`): rejected K/V are discarded by not advancing lengths.
Adaptive draft length (`policy.py`) from the running acceptance rate and measured costs
(`costs.py`).
"""
from research.specdecode.costs import measure_step_costs
from research.specdecode.distribution import chisquare_pvalue, exact_sequence_law
from research.specdecode.drafters import (Draft, DraftContext, Drafter, early_exit,
                                          model_drafter, prompt_lookup, self_speculative)
from research.specdecode.generate import SpecGeneration, SpecStats, speculative_generate
from research.specdecode.layers import layer_subset_model
from research.specdecode.policy import DraftLengthPolicy
from research.specdecode.rollback import check_rollback, with_rollback_slack
from research.specdecode.verify import Verdict, residual_distribution, verify_drafts

__all__ = ["measure_step_costs", "Draft", "DraftContext", "Drafter", "early_exit",
           "model_drafter", "prompt_lookup", "self_speculative", "SpecGeneration",
           "SpecStats", "speculative_generate", "layer_subset_model", "DraftLengthPolicy",
           "check_rollback", "with_rollback_slack", "Verdict", "residual_distribution",
           "verify_drafts", "chisquare_pvalue", "exact_sequence_law"]
