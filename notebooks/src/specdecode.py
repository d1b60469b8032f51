# %% [markdown]
# # Speculative decoding with the target's exact output distribution
#
# A cheap *drafter* guesses the next k tokens; the target model checks all of them in one forward
# pass over its KV cache and keeps a prefix by exact rejection sampling (Leviathan et al. 2023), so
# greedy output is plain greedy output token for token and sampled output has the target's
# distribution. Rejected tokens' K/V are rolled back by not advancing the row's length. The full
# measurement: `python -m experiments.run --config=experiments/specdecode/specdecode.py:small`.

# %%
import jax
from research.model import load
from research.decode.generate import generate, default_stop_tokens
from research.decode.sampling import SamplingConfig
from research.specdecode import (DraftLengthPolicy, prompt_lookup, early_exit,
                                 model_drafter, layer_subset_model, speculative_generate)
model, tokenizer = load()
stops = default_stop_tokens(tokenizer)

# %% [markdown]
# ## Prompt lookup on a repetitive prompt (greedy)
# The drafter copies what followed the latest earlier occurrence of the last 1-3 tokens; the
# adaptive policy picks k per step from the running acceptance rate of each n-gram size.

# %%
text = ('The cat sat on the warm windowsill every afternoon, watching the birds in '
        'the garden. When the sun moved behind the old oak tree, the cat would '
        'stretch and walk slowly to the kitchen.')
ids = [tokenizer.encode(tokenizer.apply_chat_template(
    [{'role': 'user', 'content': 'Repeat the following text exactly:\n\n' + text}]))]
plain = generate(model, ids, max_new_tokens=48, stop_tokens=stops)
spec = speculative_generate(model, ids, drafter=prompt_lookup(), max_new_tokens=48,
                            stop_tokens=stops)
print(tokenizer.decode(spec.tokens[0], skip_special=True))
print('identical to plain greedy:', spec.tokens == plain.tokens)
print(f'acceptance {spec.stats.acceptance_rate:.2f}, '
      f'{spec.tokens_per_forward():.2f} tokens per target forward, '
      f'draft lengths used: {spec.stats.branch_counts}')

# %% [markdown]
# ## Wall time in this process (warm, interleaved)
# On a CPU a verify pass of k + 1 tokens costs more than one token; `measure_step_costs` measures
# that curve and the policy uses it.

# %%
from research.core.timing import time_interleaved
times = time_interleaved({
    'plain': lambda: generate(model, ids, max_new_tokens=48, stop_tokens=stops),
    'spec': lambda: speculative_generate(model, ids, drafter=prompt_lookup(),
                                         max_new_tokens=48, stop_tokens=stops)},
    warmup=0, repeats=2)  # both already compiled above
t_plain, t_spec = (min(times[k]['wall_s']) for k in ('plain', 'spec'))
print(f'plain {t_plain:.2f}s, speculative {t_spec:.2f}s: {t_plain / t_spec:.2f}x')

# %% [markdown]
# ## Other drafters
# `early_exit(L)` drafts with the target's first L layers and its shared head and KV caches
# (self-speculative); `model_drafter(m)` plugs in any separate model with the same vocabulary (here,
# for illustration, a 10-layer slice of SmolLM2 with its own cache). On this 135M model such drafts
# agree rarely, and the adaptive policy falls back to plain decoding steps.

# %%
small = layer_subset_model(model, range(10))
policy = DraftLengthPolicy(draft_lengths=(0, 2, 4))
for drafter in [early_exit(10), model_drafter(small, name='10-layer slice')]:
    out = speculative_generate(model, ids, drafter=drafter, max_new_tokens=16,
                               stop_tokens=stops, policy=policy)
    same = out.tokens == generate(model, ids, max_new_tokens=16, stop_tokens=stops).tokens
    print(drafter.name, 'identical:', same, 'acceptance:',
          round(out.stats.acceptance_rate, 2), out.stats.branch_counts)

# %% [markdown]
# ## Exactness of sampling
# On a random model with a 6-token vocabulary, the joint law of the first three sampled tokens is
# enumerated exactly and compared with 20,000 speculative samples (chi-square).

# %%
from research.model import init_params, make_model, tiny_config
from research.specdecode import chisquare_pvalue, exact_sequence_law
cfg = tiny_config(vocab_size=6)
params = jax.tree.map(lambda x: 1.5 * x if x.ndim >= 2 else x,
                      init_params(cfg, jax.random.key(0)))
params['embed'] = params['embed'] * 0.1
tiny = make_model(cfg, params)
prompt, sampling = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], SamplingConfig(temperature=1.0, top_k=4)
out = speculative_generate(tiny, [prompt] * 20_000, drafter=prompt_lookup(),
                           max_new_tokens=5, key=jax.random.key(1), sampling=sampling,
                           policy=DraftLengthPolicy(draft_lengths=(0, 2), adaptive=False))
law = exact_sequence_law(tiny, prompt, sampling, 3)
print('acceptance', round(out.stats.acceptance_rate, 3), 'chi-square p-value',
      round(chisquare_pvalue([t[:3] for t in out.tokens], law), 3))
