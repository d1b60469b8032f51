"""The MoE LM (research/moe) on a (data 2, tensor 2, expert 2) mesh with MegaFlux's
expert-parallel layer, end to end (prefill + decode == one device); and the sharded
decode step lowered for TPU and CUDA on this CPU machine."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.dispatch import custom_call_targets, has_pallas_call
from research.kv.dense import DenseKVCache
from research.kv.paged import PagedKVCache
from research.megaflux import ExpertParallelFFN
from research.model import init_params, make_model, tiny_config
from research.moe import TrainConfig
from research.moe.training import init_train_params
from research.decode.generate import decode_step, prefill
from research.sharding import make_mesh, override_rules, per_device_bytes, shard_model
from research.tasq import VQCodec

MOE_TC = TrainConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, n_experts=8, top_k=2,
                     expert_ffn_dim=32, seq_len=32)
BYTE_RULES = override_rules(vocab=None)  # 257 byte tokens: no tensor degree divides them


def _check_moe(model, mesh, replica_slots, n_steps=2):
    """Prefill + n_steps greedy decode steps on `mesh` vs one device; returns the errors."""
    sharded = shard_model(model, mesh, BYTE_RULES, moe_replica_slots=replica_slots)
    assert isinstance(sharded.config.moe.ffn, ExpertParallelFFN)
    w = sharded.params["layers"][0]["w_gate"]
    assert w.addressable_shards[0].data.shape[0] == model.config.moe.n_experts // 2
    rng = np.random.default_rng(0)
    b = 4
    tokens = jnp.asarray(rng.integers(0, 256, (b, 12)), jnp.int32)
    lengths = jnp.asarray([12, 5, 8, 1], jnp.int32)
    ref, ref_states = prefill(model, tokens, lengths, model.init_cache(b, 24))
    got, states = prefill(sharded, tokens, lengths, sharded.init_cache(b, 24))
    errs = [float(jnp.max(jnp.abs(got - ref)))]
    active = jnp.ones((b,), bool)
    for _ in range(n_steps):
        nxt = jnp.argmax(ref, -1).astype(jnp.int32)
        np.testing.assert_array_equal(np.argmax(got, -1), nxt)
        ref, ref_states = decode_step(model, nxt, lengths, active, ref_states)
        got, states = decode_step(sharded, nxt, lengths, active, states)
        errs.append(float(jnp.max(jnp.abs(got - ref))))
        lengths = lengths + 1
    np.testing.assert_array_equal(np.argmax(got, -1), np.argmax(ref, -1))
    assert max(errs) < 1e-4, errs
    return errs, per_device_bytes(sharded.params)


def test_moe_lm_on_data_tensor_expert_mesh_matches_one_device():
    """The MoE LM's architecture and init (research.moe), untrained: the trained one is
    the slow test below and experiments/scaleout."""
    config = MOE_TC.model_config().replace(n_layers=1)  # one layer: EP compiles are slow
    model = make_model(config, init_train_params(config, 0))
    errs, p = _check_moe(model, make_mesh(data=2, tensor=2, expert=2), replica_slots=1,
                         n_steps=1)
    split = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}  # / 2: tensor or expert
    want = sum(x.nbytes // (2 if name in split else 1) for layer in model.params["layers"]
               for name, x in layer.items())
    want += sum(x.nbytes for k, x in model.params.items() if k != "layers")  # replicated
    assert p["max"] == p["min"] == want, (p, want)


@pytest.mark.slow
def test_trained_moe_lm_on_mesh_matches_one_device(tmp_path):
    from research.moe import train
    tc = TrainConfig(**{**MOE_TC.__dict__, "steps": 8, "warmup": 2, "ckpt_every": 8,
                        "batch_size": 4, "lr": 1e-2})
    result = train(tc, tmp_path, progress=False)
    assert result.losses[-1] < result.losses[0]
    _check_moe(result.model, make_mesh(data=2, tensor=2, expert=2), replica_slots=1)


# -- lowering for the accelerators ------------------------------------------------------
LOWER_CONFIG = tiny_config(vocab_size=128, dim=64, n_heads=8, n_kv_heads=4, head_dim=16)


def _vq():
    rng = np.random.default_rng(0)
    books = lambda: rng.normal(size=(4, 2, 256, 8)).astype(np.float32)  # noqa: E731
    perm = lambda: np.stack([rng.permutation(16) for _ in range(4)])  # noqa: E731
    return DenseKVCache(VQCodec.create(books(), books(), perm(), perm(), label="tasq"))


@pytest.mark.parametrize("cache", ["tasq", "paged"])
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_sharded_decode_step_lowers_for_accelerators_with_pallas_kernels(platform, cache):
    """dp 2 x tp 4: the decode step lowers for the platform; inside each shard the cache
    still dispatches to its Pallas decode kernel (shard_map partitions it, GSPMD could
    not), and the only collectives are all-reduces of activations."""
    c = _vq() if cache == "tasq" else PagedKVCache(block_size=16)
    model = make_model(LOWER_CONFIG, init_params(LOWER_CONFIG, jax.random.key(0)))
    sharded = shard_model(model.replace(caches=(c,) * LOWER_CONFIG.n_layers),
                          make_mesh(data=2, tensor=4))
    states = sharded.init_cache(4, 64)  # small real arrays: they carry their shardings
    assert states[0][next(iter(states[0]))].sharding.spec[0] == "data"
    b = jax.ShapeDtypeStruct((4,), jnp.int32)
    lowered = decode_step.trace(sharded, b, b, jax.ShapeDtypeStruct((4,), bool),
                                states).lower(lowering_platforms=(platform,))
    text = lowered.as_text()
    assert has_pallas_call(custom_call_targets(text), platform)
    assert "all_gather" not in text and "all-gather" not in text
