"""PatchKV on the real SmolLM2-135M-Instruct: the patch lowers continuation NLL and
attention error on held-out continuations of a held-out context."""
import math

import jax.numpy as jnp
import numpy as np
import pytest

from research import data
from research.eviction.press import evict
from research.patchkv import patch, session, tasks
from research.patchkv.probes import ProbeConfig
from research.transforms import CalibrationData, calibrate_and_apply, chain


@pytest.mark.slow  # real model: probes, a 30-layer fit and three evaluations (~2-4 min CPU)
@pytest.mark.parametrize("policy", ["streaming_llm", "snapkv"])
def test_patch_recovers_part_of_the_eviction_loss(smollm2, policy):
    model, tok = smollm2
    ids = tok.encode(data.corpus_text("dev"))  # never the test half
    task = tasks.continuation_tasks(ids, n_contexts=1, context_len=256, n_continuations=4,
                                    continuation_len=32)[0]
    calib = CalibrationData(jnp.asarray(task.context[None]), jnp.asarray([256]))
    probes = ProbeConfig(n_generated=8, n_repeat=8, length=32)
    patched, (_, state) = calibrate_and_apply(chain(evict(policy, 0.1),
                                                    patch.patchkv(probes=probes)),
                                              model, calib)
    compressed = evict(policy, 0.1).apply(model, ())
    ref = patch.reference_model(model)
    full = session.score_continuations(ref, session.prefill_context(ref, task.context, 320),
                                       task.continuations, attention=True)
    ctx = session.prefill_context(compressed, task.context, 320)
    none = session.score_continuations(compressed, ctx, task.continuations, attention=True)
    fixed = session.score_continuations(patched, ctx, task.continuations, attention=True)
    assert full.nll < none.nll  # eviction to 10% costs something
    assert fixed.nll < none.nll, (math.exp(full.nll), math.exp(none.nll),
                                  math.exp(fixed.nll))
    assert (session.attention_error(fixed.attn_contrib, full.attn_contrib)
            < session.attention_error(none.attn_contrib, full.attn_contrib))
    assert all(np.all(np.isfinite(np.asarray(d))) for d in state.deltas)
