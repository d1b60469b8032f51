"""DynaCore: quantizers against numpy references, the quantized model, the phase views in
generate, orbax round trip, the KV-size calculator and roofline, the two-process KV
handoff, and the bad-input errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix

from kernels_pallas.dispatch import custom_call_targets, has_pallas_call
from research.dynacore import (BF16, H200, LINKS, LLAMA_31_70B, W4A16_G64, DecodeProcess,
                               QuantConfig, crossover_tokens, dynacore, handoff_logits,
                               kv_bytes, linear_params, quantize, quantize_weight,
                               restore_state, save_state, tpot_s, transfer_s, w4a16, w8a8,
                               w8a16, weight_bytes)
from research.model import forward, init_params, make_model, tiny_config
from research.decode.generate import generate, prefill
from research.transforms import calibrate_and_apply

CONFIG = tiny_config(dim=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128)


def _model(seed=0):
    return make_model(CONFIG, init_params(CONFIG, jax.random.key(seed)))


def _w(seed, k=128, n=48):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(k, n)), jnp.float32)


def test_int8_weights_match_numpy_absmax_per_channel():
    w = _w(1)
    q = quantize_weight(w, w8a8())
    scale = np.abs(np.asarray(w)).max(0) / 127.5  # qwix: the bound is qmax + 0.5
    np.testing.assert_allclose(q.scale[0], scale, rtol=1e-6)
    want = np.clip(np.round(np.asarray(w) / q.scale[0]), -128, 127).astype(np.int8)
    assert (np.asarray(q.qvalue) != want).mean() < 1e-3  # a rare tie may round the other way
    assert q.qvalue.dtype == jnp.int8 and q.nbytes == 128 * 48 + 48 * 4


@pytest.mark.parametrize("g", [32, 64, 128])
def test_int4_weights_match_numpy_minmax_groups(g):
    w = np.asarray(_w(g))
    q = quantize_weight(jnp.asarray(w), w4a16(g))
    groups = w.reshape(128 // g, g, 48)
    lo, hi = np.minimum(groups.min(1), 0), np.maximum(groups.max(1), 0)
    np.testing.assert_allclose(q.scale, (hi - lo) / 15, rtol=1e-5)
    err = np.abs(np.asarray(q.dequantize()) - w).reshape(128 // g, g, 48)
    assert (err <= np.asarray(q.scale)[:, None] * 0.5 + 1e-5).all()  # round to nearest
    assert q.qvalue.shape == (64, 48) and q.qvalue.dtype == jnp.uint8  # two codes a byte
    sym = quantize_weight(jnp.asarray(w), w4a16(g, zero_point=False))
    assert sym.zero is None
    np.testing.assert_allclose(sym.scale, np.abs(groups).max(1) / 7.5, rtol=1e-5)


def test_linear_ops_match_fake_quant_references():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(2, 3, 128)), jnp.float32)
    w = _w(3)
    q8 = quantize_weight(w, w8a8())
    xa = qwix.quantize(x.reshape(6, 128), jnp.int8, channelwise_axes=(0,))
    xs = np.abs(np.asarray(x)).reshape(6, 128).max(-1, keepdims=True) / 127.5
    np.testing.assert_allclose(xa.scale, xs, rtol=1e-6)  # per-token dynamic absmax
    want = (np.asarray(xa.qvalue, np.float64) @ np.asarray(q8.qvalue, np.float64)) \
        * np.asarray(xa.scale) * np.asarray(q8.scale)
    np.testing.assert_allclose(q8.linear(x).reshape(6, 48), want, rtol=1e-5, atol=1e-4)
    for cfg in (w8a16(), w4a16(32)):
        q = quantize_weight(w, cfg)
        np.testing.assert_allclose(q.linear(x), np.asarray(x) @ np.asarray(q.dequantize()),
                                   rtol=1e-4, atol=1e-4)


def test_quantized_model_is_close_and_smaller():
    model = _model()
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 9)), jnp.int32)
    ref = forward(model, tokens).logits
    base = weight_bytes(model)["linear"]
    # int8: 1 byte + an f32 scale per output column; int4: half a byte + f32 scale and
    # uint8 zero point per 32 (the tiny model's 64-wide layers make the scales count)
    for cfg, max_err, ratio in ((w8a8(), 0.03, 0.3), (w8a16(), 0.02, 0.3),
                                (w4a16(32), 0.35, 0.2)):
        m, _ = calibrate_and_apply(quantize(cfg), model, None)
        err = float(jnp.linalg.norm(forward(m, tokens).logits - ref) / jnp.linalg.norm(ref))
        assert 0 < err < max_err, (cfg.name, err)
        assert weight_bytes(m)["linear"] < ratio * base


def test_dynacore_generate_prefills_with_one_set_and_decodes_with_the_other():
    model = _model()
    dc, (s_pre, s_dec) = calibrate_and_apply(dynacore(w8a8(), w4a16(32)), model, None)
    pre_m = quantize(w8a8()).apply(model, s_pre)
    dec_m = quantize(w4a16(32)).apply(model, s_dec)
    assert jax.tree.structure(dc.prefill_model.params) == jax.tree.structure(pre_m.params)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [3, 4, 5]]
    got = generate(dc, prompts, max_new_tokens=6).tokens
    # by hand: prefill with the W8A8 model, then step the W4A16 model from that cache
    toks = jnp.asarray([[5, 6, 7, 8, 9, 10, 11, 12], [3, 4, 5, 0, 0, 0, 0, 0]])
    lengths = jnp.asarray([8, 3])
    logits, states = prefill(pre_m, toks, lengths, pre_m.init_cache(2, 16))
    want = [[], []]
    for _ in range(6):
        nxt = jnp.argmax(logits, -1)
        for b in range(2):
            want[b].append(int(nxt[b]))
        out = forward(dec_m, nxt[:, None].astype(jnp.int32), cache_states=states,
                      start=lengths, logits="last")
        logits, states, lengths = out.logits, out.cache_states, lengths + 1
    assert got == want
    with pytest.raises(ValueError, match="prefill_model"):
        forward(dc, toks)


def test_handoff_chunk_equals_token_by_token_decode():
    model = _model()
    dec, _ = calibrate_and_apply(quantize(w4a16(32)), model, None)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 97, (2, 12)), jnp.int32)
    _, chunk = handoff_logits(model, dec, tokens, 8)
    _, states = prefill(model, tokens[:, :8], jnp.asarray([8, 8]), model.init_cache(2, 12))
    for t in range(4):
        out = forward(dec, tokens[:, 8 + t:9 + t], cache_states=states,
                      start=jnp.asarray([8 + t] * 2), logits="last")
        states = out.cache_states
        np.testing.assert_allclose(out.logits, chunk[:, t], rtol=2e-4, atol=2e-4)


def test_orbax_round_trip_keeps_bytes_and_logits(tmp_path):
    model = _model()
    t = dynacore(w8a8(), w4a16(64))
    state = t.calibrate(model, None)
    save_state(tmp_path / "dc", state)
    back = restore_state(tmp_path / "dc")
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(back)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    tokens = jnp.asarray([[1, 2, 3, 4, 5]])
    m1, m2 = t.apply(model, state), t.apply(model, back)
    np.testing.assert_array_equal(forward(m1.decode_model, tokens).logits,
                                  forward(m2.decode_model, tokens).logits)


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="unsupported bit widths"):
        QuantConfig(weight_bits=3, act_bits=16, group_size=64)
    with pytest.raises(ValueError, match="unsupported group_size"):
        w4a16(48)
    with pytest.raises(ValueError, match="does not divide the input dim 96"):
        quantize_weight(_w(0, k=96), w4a16(64))
    bad = _w(0).at[5, 7].set(jnp.nan)
    with pytest.raises(ValueError, match="params 0/wq: non-finite"):
        quantize_weight(bad, w8a8(), name="params 0/wq")
    model, other = _model(0), _model(1)
    t = quantize(w4a16(32))
    state = t.calibrate(model, None)
    with pytest.raises(ValueError, match="made from another model"):
        t.apply(other, state)
    state["weights"]["0/wk"]["scale"] = state["weights"]["0/wk"]["scale"].at[0, 0].set(jnp.nan)
    with pytest.raises(ValueError, match="0/wk: non-finite quantization scale"):
        t.apply(model, state)
    with pytest.raises(ValueError, match="already quantized"):
        t.calibrate(quantize(w8a8()).apply(model, quantize(w8a8()).calibrate(model, None)),
                    None)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_dynacore_steps_lower_to_the_quant_kernels(platform):
    model = _model()
    dc, _ = calibrate_and_apply(dynacore(w8a8(), w4a16(32)), model, None)
    tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    for view in (dc.prefill_model, dc.decode_model):
        fn = jax.jit(lambda m, t: forward(m, t, logits="last").logits)
        targets = custom_call_targets(fn.trace(view, tokens).lower(
            lowering_platforms=(platform,)).as_text())
        assert has_pallas_call(targets, platform)


def test_kv_calculator_and_transfer():
    kv = kv_bytes(LLAMA_31_70B, 32768)
    assert abs(kv / 1e9 - 10.74) < 0.01  # the seed's "about 10 GB"
    assert kv_bytes(LLAMA_31_70B, 32768, bits=1) == kv / 16
    assert abs(transfer_s(kv, LINKS["6.4 Tbps"]) - 0.01342) < 1e-4
    assert crossover_tokens(lambda p: 1e-3 * p, lambda p: 0.05 + 1e-4 * p) == 56
    assert crossover_tokens(lambda p: 1e-4 * p, lambda p: 1e-3 * p) is None
    with pytest.raises(ValueError, match="tokens must be"):
        kv_bytes(LLAMA_31_70B, -1)
    c = LLAMA_31_70B
    assert 69e9 < linear_params(c) < 71e9
    t_bf, t_q = (tpot_s(c, 1, 1024, s, H200)
                 for s in (BF16, W4A16_G64))
    assert 3.0 < t_bf / t_q < 16 / 4.625  # memory-bound: at most the byte ratio


def test_two_process_kv_handoff_decodes_the_same_tokens():
    model = make_model(tiny_config(), init_params(tiny_config(), jax.random.key(3)))
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5, 6, 7, 8, 9]]
    want = generate(model, prompts, max_new_tokens=5).tokens
    lengths = jnp.asarray([7, 7])
    logits, states = prefill(model, jnp.asarray(prompts), lengths, model.init_cache(2, 16))
    with DecodeProcess(tiny_seed=3) as dp:
        r = dp.handoff(logits, lengths, states, 16, 5)
        assert dp.handoff(logits, lengths, states, 16, 0)["tokens"] is None  # transfer only
    assert r["tokens"].tolist() == want
    assert r["kv_bytes"] == 2 * 2 * 2 * 7 * 2 * 8 * 4  # layers * K,V * B * P * Hkv * D * f32
    assert r["wire_bytes"] > r["kv_bytes"] and r["transfer_s"] > 0


def test_serving_engine_prefills_and_decodes_with_the_phase_sets():
    """The engine runs model.prefill_model for prompt chunks and model.decode_model for
    decode steps: its greedy tokens equal generate's on the same DynaCore model (a forward
    on the undivided model would raise)."""
    from research.serving.api import Request, SamplingParams
    from research.serving.engine import ServingEngine

    class Tok:
        eos_id = 0

        def decode(self, ids, skip_special=False):
            return "".join(chr(65 + i % 26) for i in ids)

        def token_to_id(self, token):
            return None

    dc, _ = calibrate_and_apply(dynacore(w8a8(), w4a16(32)), _model(), None)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [3, 4, 5]]
    want = generate(dc, prompts, max_new_tokens=6, max_len=32).tokens
    engine = ServingEngine(dc, Tok(), n_blocks=16, block_size=8, max_batch=2, max_len=32,
                           token_budget=16, prefill_chunk=8, stop_token_ids=(), max_queue=4)
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"r{i}", tuple(p), SamplingParams(max_new_tokens=6)))
    out = {}
    while engine.has_work():
        for e in engine.step():
            if e.token_id is not None:
                out.setdefault(e.request_id, []).append(e.token_id)
    assert [out["r0"], out["r1"]] == want
