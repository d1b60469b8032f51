"""PagedKVCache on the core cache interface: equals the dense cache; shared == copied prefix."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.kv import paged
from research.kv.block_allocator import BlockManager
from research.kv.codec import FloatCodec
from research.kv.dense import DenseKVCache
from research.model import forward
from research.decode.generate import generate
from research.transforms import calibrate_and_apply


def _paged(model, **kw):
    return calibrate_and_apply(paged.paged_kv_cache(**kw), model, None)[0]


def test_rejects_bad_hyper_parameters():
    with pytest.raises(ValueError, match="block_size"):
        paged.PagedKVCache(block_size=0)
    with pytest.raises(ValueError, match="implementation"):
        paged.PagedKVCache(implementation="cuda")
    with pytest.raises(TypeError, match="codec"):
        paged.PagedKVCache(codec="bfloat16")


def test_generate_on_paged_cache_matches_dense(tiny):
    """The unmodified generation loop runs on the paged cache (default per-row tables)."""
    prompts = [[5, 9, 11, 3, 7], [2, 4], [8, 1, 6, 6, 6, 2, 9, 10, 12]]
    dense = generate(tiny, prompts, max_new_tokens=12)
    pg = generate(_paged(tiny, block_size=4), prompts, max_new_tokens=12)
    assert dense.tokens == pg.tokens


@pytest.mark.slow  # ~20 s; tests/serving/test_generate.py checks chunked prefill fast
def test_chunked_prefill_logits_match_dense(tiny):
    """Prefill in uneven chunks crossing block boundaries: same logits as the dense cache."""
    rng = np.random.default_rng(0)
    toks = jnp.asarray(rng.integers(0, tiny.config.vocab_size, (2, 23)), jnp.int32)
    outs = []
    for model in (tiny, _paged(tiny, block_size=5)):
        states, pieces, pos = model.init_cache(2, 32), [], 0
        for n in (7, 1, 9, 6):
            chunk = toks[:, pos:pos + n]
            out = forward(model, chunk, cache_states=states,
                          start=jnp.full((2,), pos, jnp.int32), logits="all")
            states, pos = out.cache_states, pos + n
            pieces.append(out.logits)
        outs.append(jnp.concatenate(pieces, axis=1))
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def _run(model, manager, states, seqs, chunks):
    """Append token chunks to sequences through the manager; returns last logits per seq."""
    lengths = [manager.length(s) for s in seqs]
    copies = manager.reserve({s: len(c) for s, c in zip(seqs, chunks)})
    if copies:
        src, dst = map(np.asarray, zip(*copies))
        states = paged.copy_blocks(states, jnp.asarray(src, jnp.int32),
                                   jnp.asarray(dst, jnp.int32))
    t = max(len(c) for c in chunks)
    toks = np.zeros((len(seqs), t), np.int32)
    for i, c in enumerate(chunks):
        toks[i, :len(c)] = c
    states = paged.with_block_tables(states, manager.block_table(seqs))
    out = forward(model, jnp.asarray(toks), cache_states=states,
                  start=jnp.asarray(lengths, jnp.int32),
                  n_new=jnp.asarray([len(c) for c in chunks], jnp.int32), logits="last")
    return out.logits, out.cache_states


# block-aligned (slow: ~15 s) and mid-block forks
@pytest.mark.parametrize("prefix_len", [pytest.param(8, marks=pytest.mark.slow), 10])
def test_shared_prefix_gives_identical_outputs_to_copied_prefix(tiny, prefix_len):
    bs, n_blocks = 4, 24
    model = _paged(tiny, block_size=bs, n_blocks=n_blocks)
    rng = np.random.default_rng(1)
    prefix = rng.integers(0, 97, prefix_len).tolist()
    tails = [rng.integers(0, 97, 5).tolist() for _ in range(3)]

    # shared: one prefill, then three forks continue
    m = BlockManager(n_blocks, bs, max_blocks_per_seq=6)
    states = model.init_cache(1, 24)
    root = m.new_sequence()
    _, states = _run(model, m, states, [root], [prefix])
    kids = [m.fork(root) for _ in tails]
    shared_logits, states = _run(model, m, states, kids, tails)
    used_shared = m.allocator.n_used

    # copied: every candidate gets its own prefill of the prefix
    m2 = BlockManager(n_blocks, bs, max_blocks_per_seq=6)
    states2 = model.init_cache(1, 24)
    seqs = [m2.new_sequence() for _ in tails]
    _, states2 = _run(model, m2, states2, seqs, [prefix] * 3)
    copied_logits, states2 = _run(model, m2, states2, seqs, tails)

    np.testing.assert_array_equal(np.asarray(shared_logits), np.asarray(copied_logits))
    assert used_shared < m2.allocator.n_used
    # and the parent still reads its own, unmodified prefix after the children wrote
    # (batch 1 instead of 3: XLA's CPU matmul blocking may differ in the last ulp)
    m.free(kids[0])
    after, _ = _run(model, m, states, [root], [tails[0]])
    np.testing.assert_allclose(np.asarray(after), np.asarray(shared_logits[:1]),
                               rtol=1e-5, atol=1e-5)


def test_rollback_then_rewrite_matches_fresh(tiny):
    """truncate() rolls back; writing new tokens over the old slots gives fresh results."""
    model = _paged(tiny, block_size=4, n_blocks=12)
    m = BlockManager(12, 4, max_blocks_per_seq=4)
    states = model.init_cache(1, 16)
    s = m.new_sequence()
    _, states = _run(model, m, states, [s], [[1, 2, 3, 4, 5, 6]])
    _, states = _run(model, m, states, [s], [[7, 8, 9, 10, 11]])
    m.truncate(s, 6)
    got, _ = _run(model, m, states, [s], [[20, 21]])
    m2 = BlockManager(12, 4, max_blocks_per_seq=4)
    t = m2.new_sequence()
    want, _ = _run(model, m2, model.init_cache(1, 16), [t], [[1, 2, 3, 4, 5, 6, 20, 21]])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_state_bytes_scale_with_pool_not_batch(tiny):
    """A shared pool: state memory is n_blocks * block_size tokens, whatever the batch."""
    from research.kv.base import state_nbytes
    model = _paged(tiny, block_size=4, n_blocks=10)
    s8 = jax.eval_shape(lambda: model.init_cache(8, 64))
    s1 = jax.eval_shape(lambda: model.init_cache(1, 64))
    pool = 2 * tiny.config.n_layers * 10 * 4 * tiny.config.n_kv_heads * tiny.config.head_dim * 4
    assert state_nbytes(s1) - pool == 1 * 16 * 4 * tiny.config.n_layers
    assert state_nbytes(s8) - pool == 8 * 16 * 4 * tiny.config.n_layers


def test_dense_cache_codec_is_kept(tiny):
    m = _paged(tiny.replace(caches=(DenseKVCache(FloatCodec("bfloat16")),) * 2))
    assert all(c.codec == FloatCodec("bfloat16") for c in m.caches)


def test_paged_cache_with_pallas_decode_generates_like_xla(tiny):
    """The Pallas paged kernel (interpret mode) on the decode steps of `generate`."""
    prompts = [[5, 9, 11, 3, 7], [2, 4, 8]]
    outs = []
    for impl in ("xla", "pallas"):
        model = _paged(tiny, block_size=4, implementation=impl, interpret=True)
        outs.append(generate(model, prompts, max_new_tokens=6).tokens)
    assert outs[0] == outs[1]


def _codec_caches(model, codec_name):
    """Every layer's dense cache with an int8, TaSQ-style VQ (post-RoPE, permuted groups)
    or CQ-style (pre-RoPE) codec; random codebooks over head_dim 8 (4 groups of 2)."""
    from research.kv.quantized import Int8Codec
    from research.tasq.cq import CQCodec
    from research.tasq.vq import VQCodec
    rng = np.random.default_rng(0)
    hkv, d = model.config.n_kv_heads, model.config.head_dim
    books = lambda: rng.normal(size=(hkv, d // 2, 16, 2)).astype(np.float32)  # noqa: E731
    perm = lambda: np.stack([rng.permutation(d) for _ in range(hkv)])  # noqa: E731
    codec = {"int8": lambda: Int8Codec(),
             "vq": lambda: VQCodec.create(books(), books(), perm(), perm()),
             "cq": lambda: CQCodec(jnp.asarray(books()), jnp.asarray(books()),
                                   rope_theta=model.config.rope_theta,
                                   key_perm=jnp.asarray(perm(), jnp.int32))}[codec_name]()
    return model.replace(caches=(DenseKVCache(codec),) * model.config.n_layers)


@pytest.mark.parametrize("codec_name", ["vq", pytest.param("cq", marks=pytest.mark.slow)])
def test_codec_pages_read_by_the_paged_kernel_generate_like_xla(tiny, codec_name):
    """Decode steps on VQ code pages go through the codec's page reader (the paged Pallas
    kernel, interpret mode, reading pages through the table; f32 dots): the same tokens
    as the gathered XLA read."""
    prompts = [[5, 9, 11, 3, 7], [2, 4, 8]]
    base = _codec_caches(tiny, codec_name)
    runs = [generate(_paged(base, block_size=4, implementation=impl, interpret=True), prompts,
                     max_new_tokens=6) for impl in ("xla", "pallas")]
    assert runs[0].tokens == runs[1].tokens


@pytest.mark.parametrize("codec_name,tol", [("int8", 3e-2), ("vq", 1e-4),
                                            pytest.param("cq", 1e-4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("layout", ["paged", "dense"])
def test_codec_decode_step_kernel_logits_match_xla(tiny, codec_name, tol, layout):
    """One decode step after a prefill, read by the codec's kernel (interpret) vs XLA, in
    the paged layout and in the dense layout viewed as pages. int8 pages dot in bf16 on
    the kernels (kernels_pallas/paged_attention): bf16-level agreement."""
    base = _codec_caches(tiny, codec_name)
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, tiny.config.vocab_size, (2, 21)), jnp.int32)
    step = jnp.asarray([[3], [7]], jnp.int32)
    logits = []
    for impl in ("xla", "pallas"):
        if layout == "paged":
            model = _paged(base, block_size=4, implementation=impl, interpret=True)
        else:
            model = base.replace(caches=tuple(c.replace(implementation=impl, interpret=True)
                                              for c in base.caches))
        states = model.init_cache(2, 32)
        out = forward(model, prompt, cache_states=states, start=jnp.zeros(2, jnp.int32))
        out = forward(model, step, cache_states=out.cache_states,
                      start=jnp.full(2, 21, jnp.int32), logits="last")
        logits.append(np.asarray(out.logits))
    np.testing.assert_allclose(logits[1], logits[0], rtol=tol, atol=tol)


@pytest.mark.parametrize("codec_name", ["int8", "vq", "cq"])
def test_codec_decode_step_uses_the_page_reader(tiny, codec_name):
    """With "pallas" the decode step's jaxpr holds the paged kernel and no gather of the
    pools' pages into rows: a pool is only read by the kernel."""
    model = _paged(_codec_caches(tiny, codec_name), block_size=4, implementation="pallas",
                   interpret=True)
    states = model.init_cache(2, 16)
    fn = lambda s: forward(model, jnp.ones((2, 1), jnp.int32), cache_states=s,  # noqa: E731
                           start=jnp.asarray([3, 5]), logits="last").logits
    text = str(jax.make_jaxpr(fn)(states))
    assert "pallas_call" in text
    n_pool_rows = states[0]["block_table"].shape[1] * 4
    pool_shapes = {tuple(x.shape[2:]) for name, x in states[0].items()
                   if name != "block_table"}
    for shape in pool_shapes:  # a gathered row view would be [B, M*block_size, *record]
        row_view = ",".join(map(str, (2, n_pool_rows) + shape))
        assert f"[{row_view}]" not in text, (codec_name, row_view)
