"""The test-scoring ledger (experiments/protocol.py) and its place in experiments.run."""
import json
import types

import pytest
from ml_collections import ConfigDict

from experiments import protocol


def _module(defaults):
    return types.SimpleNamespace(__name__="fake", TECHNIQUE="fake",
                                 DEFAULTS_CHOSEN_ON="dev sweep", defaults=lambda c: defaults)


def test_count_resets_when_the_defaults_change(tmp_path):
    cfg = ConfigDict({"run_name": "fake_small", "split": "test"})
    counts = [protocol.protocol_block(_module({"k": 1}), cfg, ledger_dir=tmp_path)
              ["test_scorings"] for _ in range(3)]
    assert counts == [1, 2, 3]
    b = protocol.protocol_block(_module({"k": 2}), cfg, ledger_dir=tmp_path)
    assert b["test_scorings"] == 1 and b["defaults"] == {"k": 2}
    assert b["defaults_chosen_on"] == "dev sweep"
    # another test split of the same technique has its own count
    other = ConfigDict({"run_name": "fake_full", "split": "test"})
    assert protocol.protocol_block(_module({"k": 2}), other,
                                   ledger_dir=tmp_path)["test_scorings"] == 1
    ledger = json.loads((tmp_path / "fake.json").read_text())
    assert ledger["splits"]["fake_small"]["test_scorings"] == 1
    assert len(ledger["splits"]["fake_small"]["runs"]) == 1


def test_dev_runs_are_not_counted(tmp_path):
    cfg = ConfigDict({"run_name": "fake_dev", "split": "dev"})
    b = protocol.protocol_block(_module({"k": 1}), cfg, ledger_dir=tmp_path)
    assert b["split"] == "dev" and b["test_scorings"] is None
    assert not (tmp_path / "fake.json").exists()


def test_fingerprint_is_order_free_and_json_only():
    assert protocol.fingerprint({"a": 1, "b": (1, 2)}) == protocol.fingerprint(
        {"b": [1, 2], "a": 1})
    assert protocol.fingerprint({"a": 1}) != protocol.fingerprint({"a": 2})
    with pytest.raises(TypeError, match="use JSON types"):
        protocol.fingerprint({"a": object()})


def test_undeclared_module_or_bad_split_is_refused(tmp_path):
    cfg = ConfigDict({"run_name": "x", "split": "test"})
    with pytest.raises(ValueError, match=r"must declare \['TECHNIQUE', 'defaults'"):
        protocol.validate(types.SimpleNamespace(__name__="m"), cfg)
    with pytest.raises(ValueError, match="config.split must be one of"):
        protocol.validate(_module({}), ConfigDict({"run_name": "x", "split": "val"}))
    (tmp_path / "fake.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        protocol.protocol_block(_module({}), cfg, ledger_dir=tmp_path)


@pytest.mark.parametrize("name", ["baseline", "tasq", "specscale", "specdecode", "megaflux",
                                  "patchkv"])
def test_every_experiment_declares_the_protocol(name):
    import importlib
    module = importlib.import_module(f"experiments.{name}.experiment")
    config = importlib.import_module(f"experiments.{name}.{name}").get_config("small")
    assert protocol.validate(module, config) == "test"
    assert module.DEFAULTS_CHOSEN_ON


def test_bench_lock_holds_the_named_file(tmp_path, monkeypatch):
    import fcntl
    from experiments import common
    lock = tmp_path / "bench.lock"
    monkeypatch.setenv("SERVAX_BENCH_LOCK", str(lock))
    with common.bench_lock():
        with open(lock) as f:  # another holder cannot take it meanwhile
            with pytest.raises(BlockingIOError):
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(lock) as f:  # released afterwards
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    monkeypatch.delenv("SERVAX_BENCH_LOCK")
    with common.bench_lock():  # unset: a no-op
        pass
