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
