"""The dev sweeps (experiments/patchkv/dev/, experiments/specscale/dev/) are configs of
`experiments.run`: dev runs, recorded as such in results.json, counted in no ledger, and
refused on the test split."""
import importlib
import json

import pytest
from ml_collections import ConfigDict

from experiments import protocol

SWEEPS = ["experiments.patchkv.dev.sweep", "experiments.patchkv.dev.retrieval",
          "experiments.specscale.dev.difficulty"]


@pytest.mark.parametrize("name", SWEEPS)
def test_a_dev_sweep_is_a_dev_run_of_the_runner(name, tmp_path):
    module = importlib.import_module(name)
    config = module.get_config()
    assert config.experiment == name and config.split == "dev"
    assert protocol.validate(module, config) == "dev"
    assert protocol.begin_test_run(module, config, ledger_dir=tmp_path) is None
    block = protocol.protocol_block(module, config, ledger_dir=tmp_path)
    assert block["split"] == "dev" and block["test_scorings"] is None
    test = ConfigDict(config.to_dict())
    test.split = "test"
    with pytest.raises(ValueError, match="is a dev sweep"):
        protocol.begin_test_run(module, test, ledger_dir=tmp_path)
    assert not list(tmp_path.iterdir())  # nothing recorded
    with pytest.raises(ValueError, match="config.settings"):
        module.defaults(ConfigDict({**config.to_dict(), "settings": "nonesuch"}))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny random model with room for the sweeps' prompts (SpecScale's few-shot
    verifier prompt is ~650 byte tokens)."""
    import jax

    from research.model import init_params, tiny_config
    from tests.model.gguf_writer import byte_vocab, write_llama_gguf
    config = tiny_config(vocab_size=len(byte_vocab()[0]), head_dim=16, max_position=2048)
    return write_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", config,
                            init_params(config, jax.random.key(0)))


RUNS = {  # the smallest sweep of each: one setting, one dev context or 2 problems
    "specscale_dev_difficulty": ("experiments/specscale/dev/difficulty.py", [
        "--config.n=2", "--config.settings=2x1digit", "--config.engine.n_blocks=512"]),
    "patchkv_dev_sweep": ("experiments/patchkv/dev/sweep.py", [
        "--config.contexts=1", "--config.tasq=False", "--config.only=snapkv",
        "--config.settings=base"]),
    "patchkv_dev_retrieval": ("experiments/patchkv/dev/retrieval.py", [
        "--config.contexts=1", "--config.settings=base", "--config.compressions=snapkv@0.1"]),
}


FAST_RUN = "patchkv_dev_sweep"  # the cheapest (specscale's took ~45 s on 2 cores)


# one sweep in the default suite, the others in the slow one (~20-45 s each)
@pytest.mark.parametrize("run_name", [n if n == FAST_RUN else
                                      pytest.param(n, marks=pytest.mark.slow) for n in RUNS])
def test_a_dev_sweep_runs_through_the_runner(run_name, tiny_gguf, tmp_path):
    """Each dev sweep end to end on a tiny random model (~20 s each): its results go to
    the workdir, its protocol block says dev, and no ledger record is written."""
    from tests.experiments.test_run import _run_config
    config, overrides = RUNS[run_name]
    work = tmp_path / "w"
    proc = _run_config(config, work, f"--config.gguf_path={tiny_gguf}", *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((work / run_name / "results.json").read_text())
    assert r["protocol"]["split"] == "dev" and r["protocol"]["test_scorings"] is None
    assert r["protocol"]["items"] is None and r["rows"]
    assert r["command"].startswith(f"python -m experiments.run --config={config}")
    assert not list(work.glob("ledger/*.json"))
    assert f"experiments.commit_run {run_name}" in proc.stdout
