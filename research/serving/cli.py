r"""Generate text from the command line.

    python -m research.serving.cli --prompt="What is the capital of France?"
    python -m research.serving.cli --gguf=/path/model.gguf --nochat --prompt="Once upon" \
        --temperature=0.8 --top_p=0.95 --seed=1 --max_new_tokens=64
    python -m research.serving.cli --kv_codec=tasq-1bit --prompt="Hello"
"""
from absl import app, flags

from research.serving import kv_codecs as registry

_GGUF = flags.DEFINE_string("gguf", "", "llama-architecture GGUF file; default: SmolLM2")
_PROMPT = flags.DEFINE_multi_string("prompt", None, "prompt text (repeat for a batch)")
_CHAT = flags.DEFINE_bool("chat", True, "wrap prompts in the model's chat template")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "tokens to generate per prompt")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy")
_TOP_K = flags.DEFINE_integer("top_k", 0, "0 = off")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "1 = off")
_SEED = flags.DEFINE_integer("seed", 0, "PRNG seed for sampling")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "params/KV dtype")
_KV_CODEC = flags.DEFINE_enum(
    "kv_codec", "f32", list(registry.names()),
    "KV cache codec (research/serving/kv_codecs.py; calibrated ones on the corpus's calibration "
    "split): " + "; ".join(f"{n}: {registry.get(n).summary}" for n in registry.names()))
flags.mark_flag_as_required("prompt")


def main(argv):
    del argv
    import jax

    from research.model.tokenizer import check_unicode
    for i, prompt in enumerate(_PROMPT.value, 1):
        try:
            check_unicode(prompt, f"--prompt #{i}")
        except ValueError as e:
            raise app.UsageError(str(e)) from None

    from research.decode.generate import generate_text
    from research.decode.sampling import SamplingConfig, SamplingError
    from research.model import load

    try:  # the bounds the server checks too (research/decode/sampling.py)
        sampling = SamplingConfig(_TEMPERATURE.value, _TOP_K.value, _TOP_P.value)
    except SamplingError as e:
        raise app.UsageError(f"--{e.field} {e.bound}, got {e.value!r}") from None
    model, tok = load(_GGUF.value or None, dtype=_DTYPE.value)
    if _KV_CODEC.value != "f32":
        model = registry.served_model(model, tok, _KV_CODEC.value, seed=_SEED.value)
    outs = generate_text(model, tok, _PROMPT.value, chat=_CHAT.value,
                         max_new_tokens=_MAX_NEW.value, key=jax.random.key(_SEED.value),
                         sampling=sampling)
    for prompt, out in zip(_PROMPT.value, outs):
        print(f"### {prompt}\n{out}\n")


if __name__ == "__main__":
    app.run(main)
