# %% [markdown]
# # SpecScale: speculative search control on a prefix-shared paged KV cache
#
# 1. the paged KV cache: block tables, reference-counted blocks, copy-on-write forks;
# 2. a verifiable task suite and a likelihood verifier that costs a model call;
# 3. beam search vs SpecScale (early pruning, dedup, deferred verification) on
#    SmolLM2-135M-Instruct;
# 4. the Pallas paged decode-attention kernel vs its reference.
#
# The full comparison (accuracy vs compute, throughput, peak KV blocks) is the experiment `python -m
# experiments.run --config=experiments/specscale/specscale.py:small`.

# %% [markdown]
# ## 1. Blocks, forks and copy-on-write (host bookkeeping)

# %%
from research.kv.block_allocator import BlockManager
m = BlockManager(n_blocks=8, block_size=4, max_blocks_per_seq=4)
prompt = m.new_sequence(); m.append(prompt, 6)      # 6 tokens: 1 full + 1 partial block
a, b = m.fork(prompt), m.fork(prompt)               # share both blocks, nothing copied
print('tables', m.blocks(prompt), m.blocks(a), 'in use', m.allocator.n_used)
print('a appends -> copies', m.append(a, 1))        # only the shared partial block
print('tables', m.blocks(prompt), m.blocks(a), m.blocks(b))
for s in (prompt, a, b): m.free(s)
print('in use after freeing all:', m.allocator.n_used)
try:
    m.append(m.new_sequence(), 4 * 9)
except ValueError as e:
    print('clear error:', e)

# %% [markdown]
# ## 2. The task suite and the model

# %%
from research.model import load
from research.specscale import ArithmeticChains
model, tokenizer = load()
task = ArithmeticChains()          # 2 steps, single digits
problems = task.problems(2, seed=0)
print(task.shared_prompt() + task.problem_prompt(problems[0]))
print('reference solution:', repr(problems[0].solution()))

# %% [markdown]
# ## 3. Search on one shared paged pool
# The generator prompt and the verifier prompt are prefilled once; every problem and every candidate
# forks them. `stats` counts model calls, tokens, verifier judgements and the peak number of KV
# blocks. Dedup alone makes beam search's decisions on the same seed (each merged path keeps its own
# sampling lineage), so its texts equal beam search's at a fraction of the tokens.

# %%
from research.specscale import (PagedEngine, SearchContext, run_search, single_sample,
                                beam_search, specscale)
engine = PagedEngine(model, n_blocks=512, block_size=16, max_len=512, temperature=0.5)
ctx = SearchContext(engine, tokenizer, task)
print('shared prompts hold', engine.blocks_in_use, 'blocks of', engine.block_bytes, 'bytes')
limits = dict(max_lines=4, max_line_tokens=16)
dedup_only = specscale(2, 4, reject_below=None, prune_margin=None, prune_token_logp=None,
                       name='dedup only', **limits)
texts = {}
for cfg in [single_sample(**limits), beam_search(2, 4, **limits), dedup_only,
            specscale(2, 4, **limits)]:
    r = run_search(ctx, problems, cfg, group_size=2)
    texts[cfg.label] = [p.text for p in r.problems]
    keys = ('generated_tokens', 'tokens_computed', 'verifier_judgements', 'peak_kv_blocks')
    print(f'{cfg.label:16s} acc={r.accuracy:.2f}', {k: r.stats[k] for k in keys})
    print('   ', texts[cfg.label])
print('dedup only == beam search:', texts['dedup only'] == texts['beam 2x4'])

# %% [markdown]
# ## 4. The Pallas paged decode-attention kernel (interpret mode on CPU)

# %%
import jax.numpy as jnp, numpy as np
from kernels_pallas.paged_attention import paged_decode_attention
rng = np.random.default_rng(0)
q = jnp.asarray(rng.normal(size=(2, 9, 64)), jnp.float32)
# pages are token-major: [n_blocks, block_size, kv_heads, head_dim]
k_pool, v_pool = (jnp.asarray(rng.normal(size=(16, 16, 3, 64)), jnp.float32) for _ in range(2))
table = jnp.asarray([[3, 7, 1, -1], [0, 2, 5, 9]], jnp.int32)
lengths = jnp.asarray([40, 61], jnp.int32)
ref = paged_decode_attention(q, k_pool, v_pool, table, lengths)
for backend in ('mosaic_tpu', 'triton'):
    out = paged_decode_attention(q, k_pool, v_pool, table, lengths, implementation='pallas',
                                 backend=backend, interpret=True)
    print(backend, 'max |kernel - reference| =', float(jnp.abs(out - ref).max()))
