"""Sharded == single device on 8 simulated CPU devices (tests/conftest.py sets
--xla_force_host_platform_device_count=8 for every test process; scripts/run_tests.py runs
this folder in its own process).

SmolLM2's real head layout (9 query / 3 KV heads, dim 576, FFN 1536, vocabulary 49,152;
2 layers of random weights to keep compiles short: the full model with its weights is the
slow test and experiments/scaleout) on data 2 x tensor 3, with the f32 cache, a TaSQ
1-bit VQ codec cache and the paged cache; an 8-head test config on tensor 8; and the
compiled steps communicate no parameter or KV array."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.kv.dense import DenseKVCache
from research.kv.memory import kv_cache_bytes
from research.kv.paged import PagedKVCache
from research.model import init_params, make_model, tiny_config
from research.decode.generate import decode_step, generate, prefill
from research.sharding import make_mesh, per_device_bytes, shard_model
from research.sharding.hlo import collectives, gathers_of
from research.sharding.shapes import SMOLLM2_135M
from research.tasq import VQCodec

CONFIG = SMOLLM2_135M.replace(n_layers=2)
B, T, MAX_LEN = 4, 16, 32


@pytest.fixture(scope="module")
def params():
    return init_params(CONFIG, jax.random.key(0))


def _tasq_codec(n_kv_heads, head_dim, seed=0, group=16):
    """TaSQ's codec (research.tasq.VQCodec): per-KV-head codebooks (`group` channels per
    uint8 code, 256 centroids) over permuted channels; random codebooks, fresh each seed.
    16-channel groups (0.5 bit/channel) halve the unrolled encoder of 8-channel ones."""
    rng = np.random.default_rng(seed)
    books = lambda: rng.normal(size=(n_kv_heads, head_dim // group, 256, group)).astype(  # noqa: E731
        np.float32)
    perm = lambda: np.stack([rng.permutation(head_dim) for _ in range(n_kv_heads)])  # noqa: E731
    return VQCodec.create(books(), books(), perm(), perm(), label="tasq")


def _caches(kind, config):
    cache = {"f32": lambda: DenseKVCache(),
             "tasq": lambda: DenseKVCache(_tasq_codec(config.n_kv_heads, config.head_dim)),
             "paged": lambda: PagedKVCache(block_size=8)}[kind]()
    return (cache,) * config.n_layers


def _inputs(config, seed=1):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (B, T)), jnp.int32)
    lengths = jnp.asarray([16, 9, 3, 12], jnp.int32)
    return tokens, lengths


def _assert_close(got, want):
    got, want = np.asarray(got), np.asarray(want)
    scale = float(np.max(np.abs(want)))
    err = float(np.max(np.abs(got - want)))
    assert err <= 2e-5 * max(scale, 1.0), f"max |sharded - single| = {err} (scale {scale})"
    return err


@pytest.mark.parametrize("kind", ["f32", "tasq", "paged"])
def test_smollm2_layout_dp2_tp3_equals_single_device(params, kind):
    """Prefill logits, then greedy decode steps: same logits (f32 tolerance), same tokens;
    the state stays split; the compiled step gathers no parameter or KV array."""
    model = make_model(CONFIG, params).replace(caches=_caches(kind, CONFIG))
    mesh = make_mesh(data=2, tensor=3)
    sharded = shard_model(model, mesh)
    tokens, lengths = _inputs(CONFIG)
    ref_logits, ref_states = prefill(model, tokens, lengths, model.init_cache(B, MAX_LEN))
    logits, states = prefill(sharded, tokens, lengths, sharded.init_cache(B, MAX_LEN))
    errs = [_assert_close(logits, ref_logits)]
    active = jnp.asarray([True, True, False, True])
    nxt = jnp.argmax(ref_logits, -1).astype(jnp.int32)
    step = decode_step.lower(sharded, nxt, lengths, active, states).compile()
    hlo = step.as_text()
    for _ in range(3):  # greedy: each path feeds its own argmax back
        ref_logits, ref_states = decode_step(model, nxt, lengths, active, ref_states)
        logits, states = step(sharded, jnp.argmax(logits, -1).astype(jnp.int32) if _ else nxt,
                              lengths, active, states)
        errs.append(_assert_close(logits, ref_logits))
        np.testing.assert_array_equal(np.argmax(logits, -1), np.argmax(ref_logits, -1))
        nxt, lengths = jnp.argmax(ref_logits, -1).astype(jnp.int32), lengths + active
    # per device 1/6 of every KV array (rows / 2, KV heads / 3); block tables by rows only
    kv = per_device_bytes(states)
    total = kv_cache_bytes(model, B, MAX_LEN)
    table = 0 if kind != "paged" else CONFIG.n_layers * B * (MAX_LEN // 8) * 4
    assert kv["total"] == total
    assert kv["max"] == (total - table) // 6 + table // 2, kv
    p = per_device_bytes(sharded.params)
    assert p["max"] < p["total"] / 2.9, p  # norms replicate, everything else splits 3 ways
    print(f"{kind}: max |err| prefill {errs[0]:.2e} decode {max(errs[1:]):.2e}; per device "
          f"params {p['max']:,} of {p['total']:,} B, KV {kv['max']:,} of {kv['total']:,} B")
    assert gathers_of(hlo, sharded.params, states) == []
    assert not [c for c in collectives(hlo) if c.op == "all-gather"], collectives(hlo)


@pytest.mark.parametrize("kind", ["f32", pytest.param("tasq", marks=pytest.mark.slow),
                                  pytest.param("paged", marks=pytest.mark.slow)])
def test_greedy_generation_identical_on_tp8_and_dp8(kind):
    """8 query / 8 KV heads split over tensor 8; the same model data-parallel over 8."""
    config = tiny_config(vocab_size=128, dim=64, n_heads=8, n_kv_heads=8, head_dim=16,
                         ffn_dim=128)
    model = make_model(config, init_params(config, jax.random.key(2)))
    model = model.replace(caches=_caches(kind, config))
    prompts = [[5, 6, 7, 8, 9], [1, 2], [3] * 11, [100, 50, 25]] * 2
    want = generate(model, prompts, max_new_tokens=6)
    mesh = make_mesh(tensor=8) if kind != "paged" else make_mesh(data=8)
    got = generate(shard_model(model, mesh), prompts, max_new_tokens=6)
    assert got.tokens == want.tokens
    assert len({tuple(t) for t in want.tokens}) > 1  # not a degenerate continuation


@pytest.mark.slow
def test_real_smollm2_greedy_generation_identical_dp2_tp3(smollm2):
    """The embedded SmolLM2 with its weights, all 30 layers, chat prompts."""
    model, tokenizer = smollm2
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user",
                                                                "content": p}]))
               for p in ("What is the capital of France?", "Name a prime number.",
                         "Write one sentence about the sea.", "2 + 2 =")]
    want = generate(model, prompts, max_new_tokens=12)
    got = generate(shard_model(model, make_mesh(data=2, tensor=3)), prompts,
                   max_new_tokens=12)
    assert got.tokens == want.tokens


def test_scaleout_batch_control_row(params):
    """The scale-out experiment's control (one device, each row alone) on an f32 cache:
    it reproduces the batch reference's greedy tokens and reports its own errors."""
    from experiments.scaleout.experiment import _batch_control, _greedy
    model = make_model(CONFIG, params)
    tokens = jax.random.randint(jax.random.key(5), (B, T), 0, CONFIG.vocab_size)
    lengths = jnp.asarray([T, T - 3, T - 5, T - 1], jnp.int32)
    ref = _greedy(model, tokens, lengths, 3, MAX_LEN)
    row = _batch_control(model, tokens, lengths, ref, 3, MAX_LEN)
    assert row["part"] == "control" and row["devices"] == 1
    assert row["greedy identical"] == f"{B}/{B}" and row["KV codes equal"] == ""
    assert row["prefill max|err|"] <= 1e-4 * row["max|logit|"]
    assert row["decode max|err|"] <= 1e-4 * row["max|logit|"]


def test_scaleout_claims_without_float_caches():
    """A run of the TaSQ cache alone (no float rows) still reports its claims."""
    from experiments.scaleout.experiment import _claims
    row = {"KV codes equal": "0.98", "prefill max|err|": 2.6, "decode max|err|": 3.0,
           "max|logit|": 35.0, "greedy identical": "6/8", "all-gathers of params/KV": 0}
    control = {**row, "cache": "dense[tasq]"}
    claims = {c["claim"]: c for c in _claims([row], [control])}
    assert not any(name.startswith("sharded logits") for name in claims)
    assert claims["greedy generation identical"]["met"] == "no"
    assert any(name.startswith("control:") for name in claims)


def test_scaleout_report_of_an_equivalence_only_run(tmp_path):
    """results.json/table/plot of a TaSQ-only equivalence run (no throughput or roofline
    part) are written; the plot shows the codes written alike per layout."""
    import ml_collections

    from experiments import common
    from experiments.scaleout.experiment import _claims, _report
    rows = [{"part": p, "kind": "measured", "model": "SmolLM2-135M", "layout": lay,
             "devices": d, "cache": "dense[tasq]", "KV codes equal": codes,
             "prefill max|err|": 2.6, "decode max|err|": 3.0, "max|logit|": 35.0,
             "greedy identical": "6/8", "all-gathers of params/KV": 0}
            for p, lay, d, codes in (("control", "dp1, rows one at a time", 1, "0.983"),
                                     ("equivalence", "dp8", 8, "0.983"))]
    config = ml_collections.ConfigDict({"parts": ("equivalence",)})
    report = _report(config, rows, _claims(rows[1:], rows[:1]), None, None)
    common.save_plot(report.plot, report.columns, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0
    assert "dp1, rows one at a time" in common.markdown_table(report.columns, report.rows)
