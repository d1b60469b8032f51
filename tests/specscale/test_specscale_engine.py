"""PagedEngine: sampling/scoring agree with the core model; forks share; randomness is per path."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.kv.block_allocator import OutOfBlocksError
from research.model import forward
from research.decode.generate import generate
from research.specscale.engine import PagedEngine, _draw_tokens, child_key


def _engine(model, **kw):
    kw.setdefault("n_blocks", 64)
    kw.setdefault("block_size", 4)
    kw.setdefault("max_len", 64)
    return PagedEngine(model, **kw)


def test_greedy_sampling_matches_core_generate(char_model):
    prompt = [10, 20, 30, 40, 50, 60, 70]
    want = generate(char_model, [prompt], max_new_tokens=9).tokens[0]
    eng = _engine(char_model, temperature=0.0)
    seq = eng.new_sequence(prompt)
    eng.prefill([seq])
    got = [int(eng.sample([seq])[0][0]) for _ in range(9)]
    assert got == want


def test_score_equals_cache_free_log_probs(char_model):
    rng = np.random.default_rng(0)
    prefix, tail = rng.integers(0, 128, 9).tolist(), rng.integers(0, 128, 6).tolist()
    eng = _engine(char_model)
    seq = eng.new_sequence(prefix)
    eng.prefill([seq])
    kid = eng.fork(seq)
    eng.extend(kid, tail)
    got = eng.score([kid])[0]
    full = jnp.asarray([prefix + tail], jnp.int32)
    logp = np.asarray(jax_log_softmax(forward(char_model, full).logits))[0]
    want = [logp[len(prefix) - 1 + i, tail[i]] for i in range(len(tail))]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def jax_log_softmax(x):
    import jax
    return jax.nn.log_softmax(x, axis=-1)


def test_fork_shares_blocks_and_no_sharing_mode_copies(char_model):
    for share, extra in ((True, 0), (False, 3)):
        eng = _engine(char_model, share_prefix=share)
        seq = eng.new_sequence(list(range(1, 14)))  # 13 tokens, 12 computed = 3 blocks
        eng.prefill([seq])
        used = eng.blocks_in_use
        kid = eng.fork(seq)
        assert eng.blocks_in_use == used + extra
        eng.free(kid)
        eng.free(seq)
        assert eng.blocks_in_use == 0


def test_sampling_does_not_depend_on_batch_mates(char_model):
    """A path's samples depend on its lineage key, not on who shares the forward pass."""
    eng = _engine(char_model, temperature=1.0)
    a = eng.new_sequence([5, 6, 7], key=11)
    b = eng.new_sequence([9, 9, 9, 9, 9], key=12)
    eng.prefill([a, b])
    a2 = eng.fork(a, salt=1)
    together = [int(x) for x in eng.sample([a2, b])[0][:1]]
    for _ in range(2):
        together.append(int(eng.sample([a2, b])[0][0]))
    alone = eng.fork(a, salt=1)
    solo = [int(eng.sample([alone])[0][0]) for _ in range(3)]
    assert solo == together


def test_draw_gives_each_lineage_the_token_its_own_sequence_would_sample(char_model):
    """One row drawing for several lineages == each lineage sampled on its own fork."""
    eng = _engine(char_model, temperature=0.7)
    root = eng.new_sequence([5, 6, 7, 8], key=21)
    eng.prefill([root])
    salts = list(range(6))
    kids = [eng.fork(root, salt=e) for e in salts]  # before `draw` computes the last token
    lineages = [child_key(eng.key(root), e) for e in salts]
    drawn, logps = eng.draw([root], [lineages])
    assert drawn.shape[1] >= len(salts) and len(set(drawn[0, :6].tolist())) > 1
    for e, kid in zip(salts, kids):
        assert (eng.key(kid) == lineages[e]).all()
        tok, lp = eng.sample([kid])
        assert int(tok[0]) == int(drawn[0, e])
        assert float(lp[0]) == pytest.approx(float(logps[0, e]), abs=1e-5)
        eng.free(kid)
    with pytest.raises(ValueError, match="lineage"):
        eng.draw([root], [[]])
    with pytest.raises(ValueError, match="one entry per sequence"):
        eng.draw([root], [])


def test_inverse_cdf_sampling_follows_the_distribution():
    """The sampler's token frequencies match softmax(logits / T) (chi-square-free check:
    every probability within 4 standard errors over 20k draws)."""
    logits = jnp.array([[2.0, 1.0, 0.0, -1.0, -30.0, 0.5]])
    n, temperature = 20_000, 0.8
    words = jax.random.key_data(jax.random.split(jax.random.key(0), n))[None]
    toks = np.asarray(_draw_tokens(logits, words, temperature))[0]
    p = np.asarray(jax.nn.softmax(logits[0] / temperature))
    freq = np.bincount(toks, minlength=p.size) / n
    assert np.all(np.abs(freq - p) <= 4 * np.sqrt(p * (1 - p) / n) + 1e-12)
    assert freq[4] == 0  # a negligible-probability token is (essentially) never drawn


def test_truncate_rolls_back_and_resampling_is_reproducible(char_model):
    eng = _engine(char_model, temperature=1.0)
    s = eng.new_sequence([1, 2, 3, 4, 5], key=3)
    eng.prefill([s])
    first = [int(eng.sample([s])[0][0]) for _ in range(6)]
    eng.truncate(s, 5)
    again = [int(eng.sample([s])[0][0]) for _ in range(6)]
    assert first == again  # same lineage + positions -> same draws after a rollback


def test_out_of_blocks_raises_and_leaves_state_usable(char_model):
    eng = _engine(char_model, n_blocks=3)
    s = eng.new_sequence(list(range(1, 12)))  # needs 3 blocks for 10 computed tokens
    eng.prefill([s])
    kid = eng.fork(s)
    eng.extend(kid, [1, 2, 3, 4, 5])
    with pytest.raises(OutOfBlocksError, match="free KV blocks"):
        eng.prefill([kid])
    eng.free(kid)
    assert eng.blocks_in_use == 3


def test_bad_input_is_rejected(char_model):
    eng = _engine(char_model)
    with pytest.raises(ValueError, match="at least one token"):
        eng.new_sequence([])
    with pytest.raises(ValueError, match="outside"):
        eng.new_sequence([1, 500])
    with pytest.raises(TypeError, match="int token ids"):
        eng.new_sequence([1.5])
    with pytest.raises(ValueError, match="max_position"):
        _engine(char_model, max_len=4096)
    s = eng.new_sequence([1, 2])
    with pytest.raises(ValueError, match="twice"):
        eng.sample([s, s])
    with pytest.raises(ValueError, match="no pending token to score"):
        eng.score([s, eng.new_sequence([3])])
    with pytest.raises(ValueError, match="unknown or freed"):
        eng.tokens(999)


def test_default_implementation_is_auto(char_model):
    """Like the serving engine's: XLA on CPU, the Pallas paged kernel on TPU and GPU."""
    eng = _engine(char_model)
    assert {c.implementation for c in eng.model.caches} == {"auto"}


@pytest.mark.parametrize("platform", ["tpu", "cuda", "cpu"])
def test_default_decode_step_lowers_to_the_paged_kernel_on_tpu_and_gpu(platform):
    """A one-token sample pass of a default engine reaches the Pallas paged-attention
    kernel when lowered for TPU or CUDA, and none on the CPU. Lowering only."""
    from kernels_pallas.dispatch import custom_call_targets, has_pallas_call
    from research.model import init_params, make_model, tiny_config
    from research.specscale.engine import _forward

    config = tiny_config(dim=64, n_heads=4, n_kv_heads=2, head_dim=16)
    model = make_model(config, init_params(config, jax.random.key(0)))
    eng = PagedEngine(model, n_blocks=16, block_size=16, max_len=64)
    r, m = eng.row_multiple, eng.manager.max_blocks_per_seq
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    lowered = _forward.trace(eng.model, eng.pools, i32(r, m), i32(r, 1), i32(r), i32(r),
                             jax.ShapeDtypeStruct((r, 1, 2), jnp.uint32), mode="sample",
                             temperature=1.0).lower(lowering_platforms=(platform,))
    targets = custom_call_targets(lowered.as_text())
    if platform == "cpu":
        assert not has_pallas_call(targets, "tpu") and not has_pallas_call(targets, "cuda")
    else:
        assert has_pallas_call(targets, platform), targets
