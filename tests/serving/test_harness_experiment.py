"""experiments/serving/harness.py's task folder: the tests' local tasks with absolute data
paths plus the corpus perplexity task, loadable by lm-eval offline from any directory.
(The experiment itself serves SmolLM2 five times: minutes; its run is quoted in
experiments/serving/README.md.)"""
import json
import os
import tempfile

import pytest

os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="servax-hf-datasets-"))

lm_eval = pytest.importorskip("lm_eval")

from experiments.serving import harness, harness_experiment  # noqa: E402


@pytest.mark.slow  # ~25 s on SmolLM2; test_lm_eval runs the harness against the server
def test_harness_config_and_task_folder(smollm2, tmp_path, monkeypatch):
    _, tok = smollm2
    config = harness.get_config("small")
    assert config.variants == ("f32", "bf16", "int8", "tasq-1bit", "dynacore")
    with pytest.raises(ValueError, match="small"):
        harness.get_config("huge")
    out = harness_experiment.write_tasks(tmp_path / "tasks", tok, config.max_len, 5)
    docs = [json.loads(line) for line in (out / "corpus_test.jsonl").read_text().splitlines()]
    assert len(docs) == 5 and all(len(tok.encode(d["text"])) <= config.max_len - 8
                                  for d in docs)
    monkeypatch.chdir(tmp_path)  # absolute data paths: no need to run from the repo root
    from lm_eval.tasks import TaskManager
    tasks = TaskManager(include_path=str(out)).load(list(config.tasks))["tasks"]
    sizes = {name: len(list(t.test_docs())) for name, t in tasks.items()}
    assert sizes == {"servax_mc": 6, "servax_ppl": 3, "servax_gen": 4,
                     "servax_corpus_ppl": 5}, sizes
    harness_experiment.prepare_tasks(config, out)  # the untimed dataset build: no scoring
