"""lm-evaluation-harness (pinned in pyproject.toml's `test` extra) as a client of the real
server on 127.0.0.1: its `local-completions` model with `tokenizer_backend=remote` runs the
project's own local tasks (tests/serving/lm_eval_tasks: multiple_choice,
loglikelihood_rolling, generate_until; datasets' `json` loader, no hub access), and every
loglikelihood it got from the server equals servax's in-process scoring (a dense forward)
within 1e-4 with f32 KV.

The model is a tiny random-weight Llama with SmolLM2's real tokenizer: what is tested is
the plumbing and the numbers' equality, not the accuracy. The same command against the
real model:

    python -m research.serving.server --port=8000 --kv_codec=f32 &
    HF_DATASETS_OFFLINE=1 lm_eval --model local-completions \\
      --include_path tests/serving/lm_eval_tasks --tasks servax_mc,servax_ppl,servax_gen \\
      --batch_size 4 --model_args base_url=http://127.0.0.1:8000/v1/completions,\\
model=SmolLM2-135M-Instruct,tokenizer_backend=remote,max_length=1024

(`max_length` = the server's --max_len: lm-eval sends prompts of up to max_length - 1
tokens plus one generated token. Generation tasks also run through
`--model local-chat-completions --apply_chat_template`.)
"""
import os
import pathlib
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# offline before datasets is imported: the tasks' data are files in this repository
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="servax-hf-datasets-"))

lm_eval = pytest.importorskip("lm_eval")

from research.model.llama import forward  # noqa: E402
from research.serving.engine_loop import EngineLoop  # noqa: E402
from research.serving.server import ServerThread, build_engine, create_app  # noqa: E402
from research.serving.state import ServerConfig  # noqa: E402
from tests.serving.test_server_api import tiny_model  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
TASKS = ROOT / "tests" / "serving" / "lm_eval_tasks"
MODEL = "tiny-random"
MAX_LEN = 256
LM_EVAL_VERSION = "0.4.13"


@pytest.fixture(scope="module")
def served(smollm2):
    _, tok = smollm2
    model = tiny_model(tok, seed=1)
    engine = build_engine(model, tok, kv_codec="f32", n_blocks=96, block_size=16,
                          max_batch=4, max_len=MAX_LEN, max_queue=16, token_budget=128,
                          prefill_chunk=64)
    loop = EngineLoop(engine).start()
    app = create_app(loop, tok, ServerConfig(model_name=MODEL, max_context=MAX_LEN))
    with ServerThread(app) as srv:
        srv.loop, srv.tok, srv.model = loop, tok, model
        yield srv
    loop.stop()


def _in_process(model, context_ids, continuation_ids):
    """Sum of log p(continuation | context) from a dense forward (f32)."""
    ids = list(context_ids) + list(continuation_ids)
    logits = forward(model, jnp.asarray([ids], jnp.int32), logits="all").logits[0]
    lp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
    n = len(context_ids)
    return float(sum(lp[n - 1 + i, t] for i, t in enumerate(continuation_ids)))


def _encode_pair(tok, context, continuation):
    """lm-eval's TemplateLM._encode_pair with the remote tokenizer (no BOS)."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tok.encode(context + continuation)
    ctx = tok.encode(context)
    return ctx, whole[len(ctx):]


def test_lm_eval_local_completions_runs_the_local_tasks(served, monkeypatch):
    assert lm_eval.__version__ == LM_EVAL_VERSION
    from lm_eval.tasks import TaskManager
    monkeypatch.chdir(ROOT)  # the task YAMLs name their data files from the repo root
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=(f"base_url={served.url}/v1/completions,model={MODEL},"
                    f"tokenizer_backend=remote,max_length={MAX_LEN},batch_size=4,"
                    f"max_retries=1,timeout=120"),
        tasks=["servax_mc", "servax_ppl", "servax_gen"],
        task_manager=TaskManager(include_path=str(TASKS)), log_samples=True,
        bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
        fewshot_random_seed=0)
    res = results["results"]
    assert 0.0 <= res["servax_mc"]["acc,none"] <= 1.0
    assert np.isfinite(res["servax_ppl"]["word_perplexity,none"])
    assert res["servax_ppl"]["word_perplexity,none"] > 1.0
    assert 0.0 <= res["servax_gen"]["exact_match,none"] <= 1.0
    tok, model = served.tok, served.model
    samples = results["samples"]
    assert len(samples["servax_mc"]) == 6 and len(samples["servax_gen"]) == 4
    # multiple choice: every choice's loglikelihood is the in-process one
    n_checked = 0
    for s in samples["servax_mc"]:
        for (context, continuation), (ll, _greedy) in zip(
                (a for a in s["arguments"]), (r[0] for r in s["resps"])):
            ctx, cont = _encode_pair(tok, context, continuation)
            assert ll == pytest.approx(_in_process(model, ctx, cont), abs=1e-4)
            n_checked += 1
    assert n_checked == 24
    # rolling loglikelihood: each document fits one window after the prefix token
    prefix = tok.eos_id if tok.bos_id in (None, 0) else tok.bos_id
    for s in samples["servax_ppl"]:
        text = s["arguments"][0][0]
        ll = s["resps"][0][0]
        assert ll == pytest.approx(_in_process(model, [prefix], tok.encode(text)), abs=1e-4)
    # generation: lm-eval's text is the server's own greedy completion
    import openai
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0)
    for s in samples["servax_gen"]:
        prompt = s["arguments"][0][0]
        out = client.completions.create(model=MODEL, prompt=tok.encode(prompt), max_tokens=8,
                                        temperature=0, stop=["\n", "Q:"])
        assert s["resps"][0][0] == out.choices[0].text
