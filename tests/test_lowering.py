"""The model's step lowers to the Pallas kernels on TPU and CUDA by default (one platform
dispatch per op, kernels_pallas.dispatch) and runs XLA on the CPU. Lowering only: no
accelerator needed."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from kernels_pallas.dispatch import custom_call_targets, has_pallas_call
from research.megaflux import EPConfig, ep_moe_ffn
from research.model import MoEConfig, forward, init_params, make_model, tiny_config
from research.model import layers

MOE = MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=16)


def _moe_model():
    config = tiny_config(moe=MOE)
    return make_model(config, init_params(config, jax.random.key(3)))


def _forward_targets(model, platform):
    tokens = jax.ShapeDtypeStruct((2, 7), jnp.int32)
    fn = jax.jit(lambda m, t: forward(m, t, logits="last").logits)
    return custom_call_targets(fn.trace(model, tokens).lower(
        lowering_platforms=(platform,)).as_text())


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_moe_model_forward_lowers_to_the_grouped_matmul_kernel(platform):
    assert has_pallas_call(_forward_targets(_moe_model(), platform), platform)


def test_moe_model_forward_on_cpu_is_xla_and_matches_ragged_dot():
    model = _moe_model()
    assert not has_pallas_call(_forward_targets(model, "cpu"), "cuda")
    x = jnp.asarray(np.random.default_rng(0).normal(size=(13, 32)), jnp.float32)
    rng = np.random.default_rng(1)  # one MoE FFN's parameters, fresh
    p = {"router": rng.normal(size=(32, 4)), "w_gate": rng.normal(size=(4, 32, 16)),
         "w_up": rng.normal(size=(4, 32, 16)), "w_down": rng.normal(size=(4, 16, 32))}
    p = {k: jnp.asarray(v / 4, jnp.float32) for k, v in p.items()}
    ffn = jax.jit(layers.moe_ffn, static_argnums=(2, 3, 4))
    got, _ = ffn(x, p, 2, True, layers.GROUPED_MATMUL)
    want, _ = ffn(x, p, 2, True, jax.lax.ragged_dot)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_megaflux_layer_default_lowers_to_the_grouped_matmul_kernel(platform):
    mesh = Mesh(np.array(jax.devices()[:8]), ("ep",))
    cfg = EPConfig(8, 2, replica_slots=1)  # default matmul: GroupedMatmul() = "auto"
    dm, f = 16, 32
    x = jax.ShapeDtypeStruct((64, dm), jnp.bfloat16)
    p = {"router": (dm, 8), "w_gate": (8, dm, f), "w_up": (8, dm, f), "w_down": (8, f, dm)}
    p = {k: jax.ShapeDtypeStruct(s, jnp.bfloat16) for k, s in p.items()}
    fn = jax.jit(functools.partial(lambda x, p: ep_moe_ffn(x, p, mesh, cfg)[0]))
    targets = custom_call_targets(fn.trace(x, p).lower(lowering_platforms=(platform,))
                                  .as_text())
    assert has_pallas_call(targets, platform), targets


# -- the KV caches' decode step ----------------------------------------------------------
DECODE_CONFIG = tiny_config(dim=64, n_heads=4, n_kv_heads=2, head_dim=16)


def _vq_codec_model():
    """A 1-bit VQ codec (TaSQ's, random codebooks: 8 channels per code, 256 centroids)."""
    from research.kv.dense import DenseKVCache
    from research.tasq.vq import VQCodec
    rng = np.random.default_rng(0)
    books = lambda: rng.normal(size=(2, 2, 256, 8)).astype(np.float32)  # noqa: E731
    perm = lambda: np.stack([rng.permutation(16) for _ in range(2)])  # noqa: E731
    codec = VQCodec.create(books(), books(), perm(), perm(), label="tasq")
    model = make_model(DECODE_CONFIG, init_params(DECODE_CONFIG, jax.random.key(0)))
    return model.replace(caches=(DenseKVCache(codec),) * DECODE_CONFIG.n_layers)


def _paged_model():
    from research.kv.paged import paged_kv_cache
    model = make_model(DECODE_CONFIG, init_params(DECODE_CONFIG, jax.random.key(0)))
    return paged_kv_cache(block_size=16).apply(model, None)


def _dense_f32_model():
    """The default model: dense f32 caches (what `generate` runs)."""
    return make_model(DECODE_CONFIG, init_params(DECODE_CONFIG, jax.random.key(0)))


def _dense_int8_model():
    from research.kv.dense import DenseKVCache
    from research.kv.quantized import Int8Codec
    return _dense_f32_model().replace(
        caches=(DenseKVCache(Int8Codec()),) * DECODE_CONFIG.n_layers)


def _paged_int8_model():
    from research.kv.dense import DenseKVCache
    from research.kv.paged import paged_kv_cache
    from research.kv.quantized import Int8Codec
    model = make_model(DECODE_CONFIG, init_params(DECODE_CONFIG, jax.random.key(0)))
    model = model.replace(caches=(DenseKVCache(Int8Codec()),) * DECODE_CONFIG.n_layers)
    return paged_kv_cache(block_size=16).apply(model, None)


def _paged_vq_model():
    from research.kv.paged import paged_kv_cache
    return paged_kv_cache(block_size=16).apply(_vq_codec_model(), None)


def _decode_targets(model, platform):
    """Custom calls of one jitted decode step (one new token per row, 64 cached)."""
    states = jax.eval_shape(lambda: model.init_cache(2, 64))
    tok = jax.ShapeDtypeStruct((2, 1), jnp.int32)
    pos = jax.ShapeDtypeStruct((2,), jnp.int32)
    fn = jax.jit(lambda m, t, s, p: forward(m, t, cache_states=s, start=p,
                                            logits="last").logits)
    return custom_call_targets(fn.trace(model, tok, states, pos).lower(
        lowering_platforms=(platform,)).as_text())


ALL_DECODE_MODELS = [_dense_f32_model, _dense_int8_model, _vq_codec_model, _paged_model,
                     _paged_int8_model, _paged_vq_model]
DECODE_IDS = ["dense-f32", "dense-int8", "tasq", "paged", "paged-int8", "paged-tasq"]


@pytest.mark.parametrize("make", ALL_DECODE_MODELS, ids=DECODE_IDS)
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_decode_step_lowers_to_the_pallas_kernel_by_default(make, platform):
    assert has_pallas_call(_decode_targets(make(), platform), platform)


@pytest.mark.parametrize("make", ALL_DECODE_MODELS, ids=DECODE_IDS)
def test_decode_step_on_cpu_is_xla(make):
    targets = _decode_targets(make(), "cpu")
    assert not has_pallas_call(targets, "tpu") and not has_pallas_call(targets, "cuda")


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_serving_engine_decode_step_lowers_to_the_paged_kernel(platform):
    """The engine's decode forward ([max_batch, 1] with per-row sampling) reaches the
    Pallas paged-attention kernel on TPU and CUDA by default."""
    from research.serving.engine import ServingEngine, serve_forward

    class Tok:
        eos_id = None

        def token_to_id(self, token):
            return None

    model = make_model(DECODE_CONFIG, init_params(DECODE_CONFIG, jax.random.key(0)))
    engine = ServingEngine(model, Tok(), n_blocks=16, block_size=16, max_batch=4, max_len=64,
                           token_budget=8, warmup=False)
    b, m = 4, engine.pool.max_blocks
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    lowered = serve_forward.trace(
        engine.pool.model, engine.pool.pools, i32(b, m), i32(b, 1), i32(b), i32(b), f32(b),
        i32(b), f32(b), jax.ShapeDtypeStruct((b, 2), jnp.uint32), verify=False
    ).lower(lowering_platforms=(platform,))
    assert has_pallas_call(custom_call_targets(lowered.as_text()), platform)
