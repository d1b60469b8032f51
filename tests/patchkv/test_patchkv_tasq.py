"""chain(tasq, patchkv): a PatchKV patch fitted on top of the 1-bit TaSQ cache lowers the
attention-output error on held-out queries, and the TaSQ cache stays in place. TaSQ is
calibrated once on other text (as in serving: codebooks per model, patches per context);
calibrated on the context itself, 256 centroids would encode its few tokens exactly."""
import jax
import jax.numpy as jnp
import numpy as np

from research.tasq.vq import VQCodec
from research.model import init_params, make_model, tiny_config
from research.patchkv import patch, session
from research.patchkv.probes import ProbeConfig
from research.tasq import TaSQConfig, tasq
from research.transforms import CalibrationData, calibrate_and_apply, chain, frozen

N_CTX = 96


def test_patch_on_top_of_tasq_reduces_attention_error():
    config = tiny_config(vocab_size=97, dim=64, n_heads=4, n_kv_heads=2, head_dim=16,
                         ffn_dim=96)
    model = make_model(config, init_params(config, jax.random.key(0)))
    context = np.asarray(jax.random.randint(jax.random.key(3), (N_CTX,), 0, 97), np.int32)
    queries = np.asarray(jax.random.randint(jax.random.key(9), (4, 12), 0, 97), np.int32)
    data = CalibrationData(jnp.asarray(context[None]), jnp.asarray([N_CTX]))
    other = CalibrationData.from_ids(np.random.default_rng(0).integers(0, 97, 4 * 64), 64, 4)
    quantizer = tasq(TaSQConfig(kmeans_iters=3, max_points=256, key_space="post_rope"))
    quantizer = frozen(quantizer, quantizer.calibrate(model, other))
    probes = ProbeConfig(n_generated=4, n_repeat=4, length=16, seed=0)
    patched, (tasq_state, patch_state) = calibrate_and_apply(
        chain(quantizer, patch.patchkv(probes=probes)), model, data)
    compressed = quantizer.apply(model, tasq_state)
    assert all(isinstance(c.codec, VQCodec) for c in patched.caches)
    assert patch.summarize(patch_state)["layers_patched"] >= 1
    ref = patch.reference_model(model)
    max_len = N_CTX + queries.shape[1]
    full = session.score_continuations(ref, session.prefill_context(ref, context, max_len),
                                       queries, attention=True).attn_contrib
    ctx = session.prefill_context(compressed, context, max_len)
    errors = [session.attention_error(session.score_continuations(
        m, ctx, queries, attention=True).attn_contrib, full) for m in (compressed, patched)]
    assert errors[1] < errors[0], errors
