"""lm-eval through the server, per KV codec / weight scheme (see harness.py)."""
from __future__ import annotations

import json
import os
import pathlib
import tempfile
import time

from experiments import common, protocol
from research import data

TECHNIQUE = "serving"
DEFAULTS_CHOSEN_ON = ("none here: KV codecs at their library defaults; DynaCore at the "
                      "settings chosen on dev in results/dynacore_small")
ROOT = pathlib.Path(__file__).resolve().parents[2]
TASK_DIR = ROOT / "tests" / "serving" / "lm_eval_tasks"
COLUMNS = ["variant", "mc acc", "mc acc_norm", "ppl word", "ppl bits/byte",
           "corpus ppl word", "corpus bits/byte", "gen exact", "requests", "requests/s",
           "wall s", "warmup s"]


def defaults(config) -> dict:
    return {k: config[k] for k in ("variants", "max_len", "block_size", "calibration_seqs")}


def corpus_docs(tok, max_len: int, n_docs: int, split: str = "test") -> list[str]:
    """The paragraphs of the pydoc `split` half (the run's config.split: "test", or "dev"
    for a dev run) that servax_corpus_ppl scores (each cut to fit one window of `max_len`
    tokens; the first `n_docs`, 0 = all)."""
    if split not in protocol.SPLITS:
        raise ValueError(f"split must be one of {protocol.SPLITS}, got {split!r}")
    docs = []
    for p in data.prose_paragraphs(data.corpus_text(split)):
        ids = tok.encode(p)
        if len(ids) < 16:
            continue
        docs.append(tok.decode(ids[:max_len - 8]) if len(ids) > max_len - 8 else p)
    return docs[:n_docs] if n_docs else docs


def test_items(config) -> list:
    """The corpus paragraphs this run scores, one item each (the item ledger,
    experiments/protocol.py: the runner counts their earlier scorings); the local plumbing
    tasks (tests/serving/lm_eval_tasks) are fixtures, not test text."""
    tok = common.tokenizer_only(config.gguf_path or None)
    split = config.get("split", "test")
    return [protocol.window_item(tok.encode(d), f"pydoc {split} half paragraph {i} "
                                                "(harness corpus)")
            for i, d in enumerate(corpus_docs(tok, config.max_len, config.corpus_docs,
                                              split))]


def write_tasks(out: pathlib.Path, tok, max_len: int, n_docs: int,
                split: str = "test") -> pathlib.Path:
    """The tests' task YAMLs with absolute data paths, plus servax_corpus_ppl over the
    `split` half's paragraphs (`corpus_docs`)."""
    out.mkdir(parents=True, exist_ok=True)
    for y in TASK_DIR.glob("*.yaml"):
        text = y.read_text().replace("tests/serving/lm_eval_tasks/data",
                                     str(TASK_DIR / "data"))
        (out / y.name).write_text(text)
    docs = corpus_docs(tok, max_len, n_docs, split)
    corpus = out / f"corpus_{split}.jsonl"
    with open(corpus, "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    (out / "servax_corpus_ppl.yaml").write_text(
        (TASK_DIR / "servax_ppl.yaml").read_text()
        .replace("task: servax_ppl", "task: servax_corpus_ppl")
        .replace("tests/serving/lm_eval_tasks/data/ppl.jsonl", str(corpus)))
    return out


def served_model(model, tok, variant: str, config):
    from research.serving.server import kv_codec_model
    if variant != "dynacore":
        return kv_codec_model(model, tok, variant, seed=config.seed,
                              calibration_seqs=config.calibration_seqs)
    from research.dynacore import dynacore, w4a16, w8a8
    from research.transforms import CalibrationData, calibrate_and_apply
    cal = CalibrationData.from_corpus(tok, 256, config.calibration_seqs)
    dc = dynacore(prefill=w8a8(smooth=0.5),
                  decode=w4a16(64, zero_point="float", method="gptq"))
    return calibrate_and_apply(dc, model, cal)[0]


def evaluate(served, tok, config, task_dir: pathlib.Path) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    from research.serving.engine import ServingEngine
    from research.serving.engine_loop import EngineLoop
    from research.serving.server import ServerThread, create_app
    from research.serving.state import ServerConfig
    # warm, as a server started with its default --warmup_scoring: the scoring / logprobs
    # programs compile here, outside the timed evaluation ("warmup s" column)
    w0 = time.perf_counter()
    engine = ServingEngine(served, tok, n_blocks=config.n_blocks, block_size=config.block_size,
                           max_batch=config.max_batch, max_len=config.max_len,
                           token_budget=256, prefill_chunk=64, max_queue=64,
                           warmup_scoring=True)
    warmup_s = time.perf_counter() - w0
    loop = EngineLoop(engine).start()
    name = "SmolLM2-135M-Instruct"
    app = create_app(loop, tok, ServerConfig(model_name=name, max_context=config.max_len))
    try:
        with ServerThread(app) as srv:
            t0 = time.perf_counter()
            out = lm_eval.simple_evaluate(
                model="local-completions",
                model_args=(f"base_url={srv.url}/v1/completions,model={name},"
                            f"tokenizer_backend=remote,max_length={config.max_len},"
                            f"batch_size={config.batch_size},max_retries=1,timeout=600"),
                tasks=list(config.tasks), task_manager=TaskManager(include_path=str(task_dir)),
                log_samples=True, bootstrap_iters=0, random_seed=config.seed,
                numpy_random_seed=config.seed, torch_random_seed=config.seed,
                fewshot_random_seed=config.seed)
            wall = time.perf_counter() - t0
    finally:
        loop.stop()
    n_requests = sum(len(s["resps"]) for task in out["samples"].values() for s in task)
    return {"results": out["results"], "wall_s": wall, "warmup_s": warmup_s,
            "requests": n_requests}


def prepare_tasks(config, task_dir: pathlib.Path) -> None:
    """Build the tasks' datasets once, untimed, so the first variant's clock does not
    carry the dataset cache's creation that later variants reuse (nothing is scored)."""
    from lm_eval.tasks import TaskManager
    for task in TaskManager(include_path=str(task_dir)).load(list(config.tasks))["tasks"].values():
        task.test_docs()


def run(config, out_dir) -> common.Report:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="servax-hf-"))
    from research.model import load
    model, tok = load(config.gguf_path or None)
    split = config.get("split", "test")
    task_dir = write_tasks(pathlib.Path(out_dir) / "tasks", tok, config.max_len,
                           config.corpus_docs, split)
    prepare_tasks(config, task_dir)
    rows, raw = [], {}
    for variant in config.variants:
        served = served_model(model, tok, variant, config)
        r = evaluate(served, tok, config, task_dir)
        res = r["results"]
        raw[variant] = res
        get = lambda t, m: res.get(t, {}).get(f"{m},none", float("nan"))  # noqa: E731
        rows.append({"variant": variant, "mc acc": get("servax_mc", "acc"),
                     "mc acc_norm": get("servax_mc", "acc_norm"),
                     "ppl word": get("servax_ppl", "word_perplexity"),
                     "ppl bits/byte": get("servax_ppl", "bits_per_byte"),
                     "corpus ppl word": get("servax_corpus_ppl", "word_perplexity"),
                     "corpus bits/byte": get("servax_corpus_ppl", "bits_per_byte"),
                     "gen exact": get("servax_gen", "exact_match"),
                     "requests": r["requests"], "requests/s": r["requests"] / r["wall_s"],
                     "wall s": r["wall_s"], "warmup s": r["warmup_s"]})
    f32 = next((x for x in rows if x["variant"] == "f32"), None)
    claims = []
    if f32 is not None:
        for x in rows:
            if x["variant"] in ("bf16", "int8"):
                d = x["corpus bits/byte"] / f32["corpus bits/byte"] - 1
                claims.append(common.claim(
                    f"{x['variant']} KV corpus bits/byte vs f32", "within 1%",
                    f"{100 * d:+.2f}%", abs(d) <= 0.01))
    return common.Report(
        columns=COLUMNS, rows=rows, claims=claims,
        title="lm-evaluation-harness (local-completions) through servax-serve, per variant",
        extra={"harness": raw, "lm_eval": __import__("lm_eval").__version__},
        notes=["tasks: tests/serving/lm_eval_tasks (6 multiple-choice questions, 3 "
               "documents, 4 generation prompts: plumbing-sized, their accuracy is noise) "
               f"and servax_corpus_ppl ({config.corpus_docs or 'all'} paragraphs of the "
               f"embedded corpus's {split} split, one item each in the item ledger)",
               "requests/s: harness requests (one per choice / document / generation) over "
               "the evaluation's wall time, batch_size prompts per HTTP request, on a "
               "shared 2-core CPU; DynaCore's loglikelihoods use its prefill (W8A8) weights",
               "every engine warmed before its clock (decode and scoring programs compiled: "
               "'warmup s'); the tasks' datasets built once before the first variant"])
