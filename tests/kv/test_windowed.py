"""A full-precision sink + recent window over a low-bit codec (research/kv/windowed.py): exact
bf16 below S + W, the inner codec beyond it, the per-query choice independent of chunking,
the same in every layout, and refusals that name what is wrong."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.core.attention import attend, gqa_scores
from research.decode.paged_pool import PagedPool
from research.kv.codec import FloatCodec
from research.kv.dense import DenseKVCache
from research.kv.paged import PagedKVCache
from research.kv.quantized import Int8Codec, int8_kv
from research.kv.window import WindowKVCache
from research.kv.layouts import kv_window
from research.kv.windowed import WindowedCodec
from research.model import forward
from research.model.precision import kv_cache_dtype
from research.tasq.cq import CQCodec
from research.tasq.kivi import KIVICodec
from research.tasq.vq import VQCodec
from research.transforms import calibrate_and_apply

B, HQ, HKV, D = 2, 4, 2, 8


def _qkv(seed, t):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(ks[0], (B, t, HQ, D)), jax.random.normal(ks[1], (B, t, HKV, D)),
            jax.random.normal(ks[2], (B, t, HKV, D)))


def _run(cache, q, k, v, chunks, window=None):
    """Outputs [B, T, Hq, D] of writing and attending the tokens in `chunks` pieces."""
    state = cache.init(B, q.shape[1], HKV, D)
    outs, start = [], 0
    for n in chunks:
        sl = slice(start, start + n)
        out, state = cache.update_and_attend(
            state, q[:, sl], k[:, sl], v[:, sl], start=jnp.full((B,), start, jnp.int32),
            n_new=jnp.full((B,), n, jnp.int32), window=window)
        outs.append(out)
        start += n
    return jnp.concatenate(outs, axis=1)


def _reference(inner, sink, recent, q, k, v):
    """Each query t attends over bf16 K/V at p < sink or p > t - recent, inner-decoded
    K/V elsewhere (its own rebuilt keys)."""
    t = q.shape[1]
    pos = jnp.broadcast_to(jnp.arange(t)[None], (B, t))
    k_lo, v_lo = inner.decode(_codes(inner, k, v), pos)
    outs = []
    for i in range(t):
        hi = ((jnp.arange(t) < sink) | (jnp.arange(t) > i - recent))[None, :, None, None]
        km = jnp.where(hi, k.astype(jnp.bfloat16).astype(jnp.float32), k_lo)
        vm = jnp.where(hi, v.astype(jnp.bfloat16).astype(jnp.float32), v_lo)
        outs.append(attend(q[:, i:i + 1], km, vm, pos[:, i:i + 1], pos,
                           jnp.ones((B, t), bool)))
    return jnp.concatenate(outs, axis=1)


def _codes(inner, k, v):
    """The inner codec's records of a whole sequence: token by token, or (KIVI) in whole
    groups of its bfloat16 K/V, as the window writes them."""
    t = k.shape[1]
    if inner.align == 1:
        return inner.encode(k, v, jnp.broadcast_to(jnp.arange(t)[None], (B, t)))
    bf = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
    return inner.encode_groups(bf(k), bf(v), jnp.ones((B, t), bool))


def _kivi():
    """KIVI 2-bit (keys per channel over groups of 4 positions): a grouped codec, written
    whole by the window from its own copies (its per-sequence ring unused)."""
    return KIVICodec(bits=2, key_group=4, value_group=4, residual=4)


def _vq():
    rng = np.random.default_rng(3)
    books = lambda: rng.normal(size=(HKV, D // 2, 16, 2)).astype(np.float32)  # noqa: E731
    perm = lambda: np.stack([rng.permutation(D) for _ in range(HKV)])  # noqa: E731
    return VQCodec.create(books(), books(), perm(), perm())


def _cq():
    """TaSQ's default codec: pre-RoPE key codes in permuted groups, keys rebuilt a block
    at a time (it scores its codes itself: the window's decode steps take its fast path)."""
    rng = np.random.default_rng(4)
    books = lambda: jnp.asarray(rng.normal(size=(HKV, D // 2, 16, 2)), jnp.float32)  # noqa
    perm = lambda: jnp.asarray(np.stack([rng.permutation(D) for _ in range(HKV)]))  # noqa
    return CQCodec(books(), books(), rope_theta=10000.0, key_perm=perm(), value_perm=perm(),
                   block=4)


@pytest.mark.parametrize("inner", [Int8Codec(), _vq(), _cq(), _kivi()],
                         ids=["int8", "vq", "cq", "kivi"])
def test_the_window_reads_bf16_inside_and_the_codec_beyond(inner):
    q, k, v = _qkv(0, 24)
    windowed = WindowedCodec(inner, sink=2, recent=5)
    ref = _reference(inner, 2, 5, q, k, v)
    assert not np.allclose(ref, _reference(inner, 24, 0, q, k, v), atol=1e-3)  # codes read
    for cache in (DenseKVCache(windowed), PagedKVCache(windowed, block_size=4),
                  PagedKVCache(windowed, block_size=8)):
        # (a window pool's own table is the engine's: tests/serving/test_engine_window.py)
        # any chunking, a group's write split or not (KIVI): the same reads
        for chunks in ((24,), (7, 1, 1, 9, 6), (1,) * 24, (3, 5, 2, 14)):
            got = _run(cache, q, k, v, chunks)
            np.testing.assert_allclose(got, ref, atol=2e-5, err_msg=f"{cache.describe()} "
                                       f"chunks {chunks}")


@pytest.mark.parametrize("inner", [_vq(), _cq(), _kivi()],
                         ids=["vq-lookup-tables", "cq-rebuild", "kivi-rebuild"])
def test_a_codecs_own_scores_and_values_equal_its_rebuilt_kv(inner):
    """decode_scores / weighted_values (the window's fast decode step) read the codes the
    codec's way and agree with the dense K/V its `decode` rebuilds, on fresh inputs."""
    q, k, v = _qkv(5, 12)
    pos = jnp.broadcast_to(jnp.arange(12)[None], (B, 12))
    records = _codes(inner, k, v)
    k_lo, v_lo = inner.decode(records, pos)
    scores = inner.decode_scores(q[:, 0], records)
    np.testing.assert_allclose(scores, gqa_scores(q[:, :1], k_lo)[:, :, :, 0], atol=2e-5)
    w = jax.nn.softmax(scores, axis=-1)
    want = jnp.einsum("bkjs,bskd->bkjd", w, v_lo).reshape(B, HQ, D)
    np.testing.assert_allclose(inner.weighted_values(w, records), want, atol=2e-5)


def test_shorter_than_sink_plus_window_is_exactly_bf16():
    q, k, v = _qkv(1, 12)
    bf16 = _run(DenseKVCache(FloatCodec("bfloat16")), q, k, v, (8, 1, 1, 1, 1))
    for cache in (DenseKVCache(WindowedCodec(Int8Codec(), 4, 8)),
                  PagedKVCache(WindowedCodec(_vq(), 4, 8), block_size=4),
                  PagedKVCache(WindowedCodec(_cq(), 4, 8), block_size=4),
                  PagedKVCache(WindowedCodec(_kivi(), 4, 8), block_size=4)):
        got = _run(cache, q, k, v, (8, 1, 1, 1, 1))
        assert np.array_equal(np.asarray(got[:, :8]), np.asarray(bf16[:, :8])), cache.describe()
        # a codec scoring its own codes takes the fast decode step: one softmax over its
        # (all masked) code scores and the S + W copies, a shorter sum than bf16's over
        # every slot, so equal to float rounding (measured: <= 1 ulp)
        np.testing.assert_allclose(got[:, 8:], bf16[:, 8:], rtol=0, atol=3e-7,
                                   err_msg=cache.describe())
    # one token more and the earliest non-sink token is read from codes; the chunk then
    # takes the banded read (codes once, the window band from the copies: one online
    # softmax over both), so its earlier queries, all-window, equal bf16's to float
    # rounding (measured: <= 5 ulp)
    q, k, v = _qkv(1, 13)
    bf16 = _run(DenseKVCache(FloatCodec("bfloat16")), q, k, v, (13,))
    got = _run(DenseKVCache(WindowedCodec(Int8Codec(), 4, 8)), q, k, v, (13,))
    np.testing.assert_allclose(got[:, :12], bf16[:, :12], rtol=1e-6, atol=3e-7)
    assert np.max(np.abs(np.asarray(got[:, 12]) - np.asarray(bf16[:, 12]))) > 1e-4


def test_no_window_is_the_inner_codec():
    q, k, v = _qkv(2, 16)
    for inner in (Int8Codec(), _vq()):
        plain = _run(DenseKVCache(inner), q, k, v, (16,))
        got = _run(DenseKVCache(WindowedCodec(inner, 0, 0)), q, k, v, (16,))
        np.testing.assert_allclose(got, plain, atol=2e-5, err_msg=inner.describe())


@pytest.mark.parametrize("inner", [Int8Codec(), _kivi()], ids=["int8", "kivi"])
def test_the_ring_layout_reads_the_same_window(inner):
    q, k, v = _qkv(3, 20)
    windowed = WindowedCodec(inner, sink=0, recent=4)
    ring = WindowKVCache(window=12, codec=windowed)  # >= 8 + align - 1: whole groups
    dense = _run(DenseKVCache(windowed), q, k, v, (20,), window=8)
    for chunks in ((5, 5, 5, 5), (1,) * 20):
        np.testing.assert_allclose(_run(ring, q, k, v, chunks, window=8), dense, atol=2e-5)
    if inner.align > 1:  # a ring of just the window would split its oldest group
        with pytest.raises(ValueError, match=r"plus align - 1 \(3\) slots"):
            _run(WindowKVCache(window=8, codec=windowed), q, k, v, (20,), window=8)


def test_the_model_with_a_window_matches_bf16_on_a_short_prompt(tiny):
    tokens = jnp.arange(10, dtype=jnp.int32)[None] % tiny.config.vocab_size
    bf16, _ = calibrate_and_apply(kv_cache_dtype("bfloat16"), tiny, None)
    windowed, _ = calibrate_and_apply(int8_kv(), tiny, None)
    windowed, _ = calibrate_and_apply(kv_window(sink=2, recent=8), windowed, None)
    assert all(c.codec.describe().endswith("+sink2+w8(bf16)") for c in windowed.caches)

    def logits(m):
        states = m.init_cache(1, 16)
        return np.asarray(forward(m, tokens, cache_states=states).logits)
    assert np.array_equal(logits(windowed), logits(bf16))


def test_refusals_name_the_problem(tiny):
    with pytest.raises(ValueError, match="recent must be an int >= 0"):
        kv_window(sink=4, recent=-1)
    with pytest.raises(ValueError, match="sink must be an int >= 0"):
        WindowedCodec(Int8Codec(), sink=True)
    with pytest.raises(ValueError, match="already has a full-precision window"):
        WindowedCodec(WindowedCodec(Int8Codec()))
    with pytest.raises(ValueError, match="a position is read from codes only once its "
                       "group is whole"):
        WindowedCodec(KIVICodec(bits=2, key_group=8, value_group=4, residual=8), recent=4)
    with pytest.raises(TypeError, match="writes whole groups"):
        WindowedCodec(_kivi()).encode(*_qkv(0, 4)[1:], jnp.zeros((B, 4), jnp.int32))
    windowed, _ = calibrate_and_apply(kv_window(), tiny, None)
    with pytest.raises(TypeError, match="pass window_blocks >= 1"):
        PagedPool(windowed, n_blocks=8, block_size=4, max_len=16)
    mixed = windowed.replace(caches=(tiny.caches[0],) + windowed.caches[1:])
    with pytest.raises(ValueError, match="the same full-precision window"):
        PagedPool(mixed, n_blocks=8, block_size=4, max_len=16, window_blocks=4)
