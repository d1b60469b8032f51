"""Eviction presses: which tokens a KV cache keeps (StreamingLLM, H2O, SnapKV, random, key norm).

A press is a policy over the dense layout (`EvictingKVCache`), applied as a transform with
`evict(policy, ratio)`. PatchKV compensates what a press drops.
"""
from research.eviction.policies import (POLICIES, H2O, KeyNorm, RandomPolicy, ScoreInputs, SnapKV,
                                       StreamingLLM, make_policy)
from research.eviction.press import (EvictingKVCache, evict, is_evicting, kept_tokens,
                                     pyramid_ratios, trim_states)

__all__ = ["EvictingKVCache", "evict", "is_evicting", "kept_tokens", "pyramid_ratios",
           "trim_states", "make_policy", "StreamingLLM", "H2O", "SnapKV", "RandomPolicy",
           "KeyNorm", "POLICIES", "ScoreInputs"]
