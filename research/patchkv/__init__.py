"""PatchKV: a closed-form ridge patch of each layer's W_o (and W_down), fit once per context,
that makes attention over a compressed KV cache act like attention over the full one.

    from research.patchkv import DEV_STRENGTHS, ProbeConfig, patchkv, probe_context
    from research.transforms import CalibrationData, calibrate_and_apply, chain
    probed = probe_context(model, CalibrationData.from_context(context), ProbeConfig())
    patched, _ = calibrate_and_apply(chain(evict("snapkv", 0.1),
                                           patchkv(strengths=DEV_STRENGTHS, ffn=True)),
                                     model, probed)

Per-context transforms (research/transforms.py): `patchkv`, and the cache-side baselines
`grkv` / `am` (value refits). Serving one context, many queries: `prefill_context`,
`score_continuations`, `answer_queries`. Tasks: continuation and retrieval contexts.
"""
from research.patchkv.baselines import (METHODS as REFIT_METHODS, RefitKVCache, am, grkv,
                                        refit_values, value_refit)
from research.patchkv.patch import (DEV_QUERY_SCALES, DEV_STRENGTHS, TARGETS, LayerFit,
                                    LowRank, PatchState, apply_patch, cast_patch,
                                    cast_state, dense, fit_patches, patch_nbytes,
                                    patched_params, patchkv, scale_patch, select_query_scale,
                                    select_strength, stored_nbytes, summarize)
from research.patchkv.budget import (break_even_tokens, cache_nbytes, cast_states,
                                     per_token_bytes)
from research.patchkv.probes import (ProbeConfig, ProbedContext, ProbeSet, as_probed,
                                     probe_context, reference_model)
from research.patchkv.ridge import RidgeConfig, RidgeFit, fit_ridge
from research.patchkv.session import (ContextCache, ContinuationScore, answer_queries,
                                      attention_error, decode_flops, pad_rows, param_shapes,
                                      prefill_batch, prefill_context, query_forward,
                                      score_continuations, tile_states)
from research.patchkv.tasks import (SPLITS, ContinuationTask, RetrievalTask,
                                    check_windows_in_split, continuation_tasks, exact_match,
                                    reply_prefix, retrieval_task, split_range)

__all__ = [
    "patchkv", "fit_patches", "apply_patch", "patched_params", "patch_nbytes", "summarize",
    "select_strength", "select_query_scale", "PatchState", "LayerFit", "TARGETS",
    "DEV_STRENGTHS", "DEV_QUERY_SCALES", "LowRank", "dense", "scale_patch", "cast_patch",
    "cast_state", "stored_nbytes",
    "cache_nbytes", "cast_states", "per_token_bytes", "break_even_tokens",
    "ProbeConfig", "ProbedContext", "ProbeSet", "probe_context", "as_probed",
    "reference_model",
    "RidgeConfig", "RidgeFit", "fit_ridge",
    "grkv", "am", "value_refit", "refit_values", "RefitKVCache", "REFIT_METHODS",
    "ContextCache", "ContinuationScore", "prefill_batch", "prefill_context", "tile_states",
    "pad_rows", "query_forward", "score_continuations", "answer_queries", "attention_error",
    "decode_flops", "param_shapes",
    "ContinuationTask", "RetrievalTask", "continuation_tasks", "retrieval_task",
    "SPLITS", "split_range", "check_windows_in_split",
    "reply_prefix", "exact_match",
]
