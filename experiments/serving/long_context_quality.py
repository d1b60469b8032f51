r"""Long-context quality of every KV codec: next-token KL and top-1 agreement against the
bf16-KV model, continuation perplexity and passkey retrieval at 2k, 4k and 8k tokens.

Command:   python -m experiments.run --config=experiments/serving/long_context_quality.py:small
           (dev first: --config.split=dev; `smoke`: one length, 2 windows, 4 trials, 2
           codecs, minutes, for checking the plumbing on the real model)
Hardware:  CPU (2 cores): not run yet at full size (hours: every codec prefills 16
           windows and 50 passkey prompts per length; see the README of
           experiments/serving for the measured per-item cost).
What:      SmolLM2-135M-Instruct, f32 weights, each registered KV codec (`codecs`,
           research/serving/kv_codecs.py; calibrated ones on the calibration split)
           against the bf16-KV model (`reference`), per length in `lengths`:
           (a) over `windows` windows of `length` tokens (`windows=0` skips it: a
           passkey-only run, no KL / ppl columns), the last `continuation` tokens
           scored given the rest (prefilled through the codec's cache in `chunk`-token
           pieces): mean per-token KL(bf16 || codec), top-1 agreement and both
           continuation perplexities (research/eval/divergence.py);
           (b) passkey retrieval (research/eval/passkey.py; `passkey.trials=0` skips it:
           a quality-only run, no passkey column): `passkey.trials` prompts of
           ~`length` tokens (at 8k: 8192 - max_new_tokens), a random 5-digit key at
           depths spread evenly over 0-100% of filler read from the split's text, greedy
           decoding, the first number answered vs the key.
           `exact_part="k"` (or "v"): an ablation, every scored codec keeps keys (values)
           in bfloat16 and codes only the other half (research/kv/exact_part.py), rows
           labelled "<codec> (K bf16)": which half a codec's loss comes from.
           Text: test = the fresh stdlib-docstring text (research.data.stdlib_text; the
           windows' starts spread evenly over it, so at 8k neighbouring windows share
           context but never scored tokens); dev = the pydoc dev half, read cyclically
           where a window or filler is longer than it (6.7k tokens: dev windows past that
           repeat text, so dev numbers choose settings, they are not results).
Expected:  bf16 KL 0 and top-1 1 (the reference itself); int8 / fp8 near 0; 1-bit codecs
           far larger, growing with length; passkey accuracy of the bf16 model is the
           ceiling every codec is read against.
Settings to choose on dev before the test run: `continuation`, the passkey `template`
("plain" | "chat") and `max_new_tokens`; the codecs' own settings are their dev-chosen
defaults.
"""
import ml_collections

from experiments import common

DEFAULT_CODECS = ("bf16", "fp8", "fp8-head", "int8", "int4", "tasq-1bit", "tasq-1bit-post",
                  "tasq-2bit", "sign-1bit", "tasq-1bit+w128", "tasq-1bit-post+w128",
                  "kivi-2bit+w128")


def get_config(arg: str = "small") -> ml_collections.ConfigDict:
    c = common.new_config(arg, "experiments.serving.long_context_quality_experiment",
                          args=("small", "full", "smoke"),
                          run_name=f"serving_long_context_quality_{arg}")
    smoke = arg == "smoke"
    c.split = "test"  # "dev": the pydoc dev half, recorded nowhere
    c.test_text = "stdlib"  # test runs read the fresh test text (research/data.py)
    c.reference = "bf16"
    c.codecs = ("bf16", "int8") if smoke else DEFAULT_CODECS
    c.lengths = (2048,) if smoke else (2048, 4096, 8192)
    c.windows = 2 if smoke else (16 if arg == "small" else 32)
    c.continuation = 256 if smoke else 512  # scored tokens at the end of each window
    c.batch = 2  # windows per pass
    c.chunk = 512  # prefill piece
    c.passkey = ml_collections.ConfigDict(dict(
        trials=4 if smoke else (50 if arg == "small" else 100), template="plain",
        max_new_tokens=8, batch=4))
    c.calibration_seqs = 16
    c.exact_part = ""  # "k" / "v": the K-or-V ablation (docstring); "": the codecs as served
    return c
