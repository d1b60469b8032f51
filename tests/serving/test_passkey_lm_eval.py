"""The passkey task (research/eval/passkey.py) through lm-evaluation-harness and the real
server on 127.0.0.1: lm-eval's `local-completions` gets, per trial, exactly the greedy
continuation `passkey_accuracy` decodes in process (f32 KV, a tiny random model with
SmolLM2's tokenizer), so its exact_match equals `passkey_accuracy`'s accuracy. The model's
head is rigged to answer only digits (`digit_model`) and one trial's key is set to its
answer, so the metric is neither trivially 0 nor 1."""
import os
import tempfile

import jax
import jax.numpy as jnp
import pytest

os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="servax-hf-datasets-"))

lm_eval = pytest.importorskip("lm_eval")

from research import data  # noqa: E402
from research.model import init_params, make_model, tiny_config  # noqa: E402
from research.eval.passkey import (first_number, passkey_accuracy, passkey_trials,  # noqa: E402
                                   write_lm_eval_task)
from research.serving.engine_loop import EngineLoop  # noqa: E402
from research.serving.server import ServerThread, build_engine, create_app  # noqa: E402
from research.serving.state import ServerConfig  # noqa: E402

MODEL = "tiny-random"
MAX_LEN = 256
NEW_TOKENS = 6


def digit_model(tok, seed):
    """A tiny random model whose every greedy token is the digit 3 or 5: the final norm
    keeps one channel, which only those two tokens' head weights read (+1 and -1)."""
    config = tiny_config(vocab_size=tok.vocab_size, max_position=512, dim=64, ffn_dim=128,
                         tie_embeddings=False)
    model = make_model(config, init_params(config, jax.random.key(seed)))
    p = dict(model.params)
    p["final_norm"] = jnp.zeros_like(p["final_norm"]).at[0].set(1.0)
    three, five = tok.encode("3"), tok.encode("5")
    assert len(three) == len(five) == 1
    head = jnp.zeros_like(p["lm_head"]).at[0, three[0]].set(1.0).at[0, five[0]].set(-1.0)
    p["lm_head"] = head
    return model.replace(params=p)


@pytest.mark.slow  # ~40 s on 2 cores: an engine, a server and lm-eval's task loading
def test_passkey_task_through_lm_eval_equals_the_in_process_scorer(tmp_path):
    from experiments.common import tokenizer_only
    from lm_eval.tasks import TaskManager
    tok = tokenizer_only(None)
    model = digit_model(tok, seed=3)
    trials = passkey_trials(tok, 192, 3, seed=5, filler=data.corpus_text("dev"))
    direct = passkey_accuracy(model, tok, trials, max_new_tokens=NEW_TOKENS, batch_size=2,
                              prefill_chunk=64)
    assert all(a is not None and set(a) <= {"3", "5"} for a in direct.answers), direct
    trials[1] = trials[1]._replace(key=direct.answers[1])  # the one correct trial
    direct = passkey_accuracy(model, tok, trials, max_new_tokens=NEW_TOKENS, batch_size=2,
                              prefill_chunk=64)
    assert direct.correct[1] and direct.accuracy < 1
    write_lm_eval_task(trials, tmp_path / "tasks", max_new_tokens=NEW_TOKENS)
    engine = build_engine(model, tok, kv_codec="f32", n_blocks=96, block_size=16,
                          max_batch=4, max_len=MAX_LEN, max_queue=16, token_budget=128,
                          prefill_chunk=64)
    loop = EngineLoop(engine).start()
    app = create_app(loop, tok, ServerConfig(model_name=MODEL, max_context=MAX_LEN))
    try:
        with ServerThread(app) as srv:
            out = lm_eval.simple_evaluate(
                model="local-completions",
                model_args=(f"base_url={srv.url}/v1/completions,model={MODEL},"
                            f"tokenizer_backend=remote,max_length={MAX_LEN},batch_size=3,"
                            "max_retries=1,timeout=120"),
                tasks=["servax_passkey"],
                task_manager=TaskManager(include_path=str(tmp_path / "tasks")),
                log_samples=True, bootstrap_iters=0, random_seed=0, numpy_random_seed=0,
                torch_random_seed=0, fewshot_random_seed=0)
    finally:
        loop.stop()
    samples = sorted(out["samples"]["servax_passkey"], key=lambda s: s["doc_id"])
    assert len(samples) == 3
    for s, t, generation in zip(samples, trials, direct.generations):
        assert s["arguments"][0][0] == t.prompt
        assert s["resps"][0][0] == generation.split("\n")[0]  # the server stops there
        assert s["filtered_resps"][0] == (first_number(generation) or "[none]")
    assert (out["results"]["servax_passkey"]["exact_match,first_number"]
            == pytest.approx(direct.accuracy))
