r"""lm-evaluation-harness scores servax's techniques through the server.

Command:   python -m experiments.run --config=experiments/serving/harness.py:small
Hardware:  CPU (2 cores): small 1,306 s (five served variants; results/serving_harness_small/,
           at 448e273).
What:      SmolLM2-135M-Instruct served by `research.serving.server` (real uvicorn on
           127.0.0.1, the continuous-batching engine) with each KV codec (f32, bf16, int8,
           TaSQ 1-bit) and with DynaCore's weight schemes (W8A8 prefill | W4A16 GPTQ
           decode, the settings chosen on dev in results/dynacore_small); lm-eval
           (`local-completions`, `tokenizer_backend=remote`) runs the same local tasks
           against each: the multiple-choice, perplexity and generation tasks of
           tests/serving/lm_eval_tasks, plus a perplexity task over the paragraphs of the
           embedded corpus's test split (`servax_corpus_ppl`; `--config.split=dev` reads
           the dev half instead and records nothing). A test run declares each paragraph
           as an item (the item ledger) and reports how many were scored before.
           Per variant: accuracy, perplexities, exact match and the harness's
           requests/s (loglikelihood + rolling + generation requests / wall time of the
           evaluation).
Expected:  bf16 and int8 KV within noise of f32; TaSQ 1-bit and DynaCore cost some
           perplexity (their own experiments measure how much on held-out text).
Nothing is chosen on these tasks: codec and weight settings are the library's / their
experiments' dev-chosen defaults; calibration uses the corpus's calibration split.
Note: scoring is prefill only, so DynaCore's loglikelihood rows measure its prefill
weights (W8A8); its generation row decodes with W4A16.
"""
import ml_collections

from experiments import common


def get_config(arg: str = "small") -> ml_collections.ConfigDict:
    c = common.new_config(arg, "experiments.serving.harness_experiment",
                          run_name=f"serving_harness_{arg}")
    c.variants = ("f32", "bf16", "int8", "tasq-1bit", "dynacore")
    c.tasks = ("servax_mc", "servax_ppl", "servax_gen", "servax_corpus_ppl")
    c.max_len = 512
    c.n_blocks = 256
    c.block_size = 16
    c.max_batch = 4
    c.batch_size = 4  # prompts per harness request
    c.corpus_docs = 24 if arg == "small" else 0  # paragraphs of the split (0 = all)
    c.calibration_seqs = 4 if arg == "small" else 16
    c.split = "test"
    return c
