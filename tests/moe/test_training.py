"""MoE LM training: learning, checkpoint resume with nothing lost, routing traces, errors."""
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from research.moe import TrainConfig, data, routing_traces, train

TINY = TrainConfig(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, n_experts=8, top_k=2,
                   expert_ffn_dim=32, seq_len=32, batch_size=4, steps=12, warmup=2,
                   ckpt_every=4, lr=1e-2, aux_loss_coef=1e-3)


def _leaves(model):
    return [np.asarray(x) for x in jax.tree.leaves(model.params)]


def test_resume_after_interruption_matches_uninterrupted_run(tmp_path):
    full = train(TINY, tmp_path / "full", progress=False)
    assert full.resumed_from == 0 and len(full.losses) == TINY.steps
    assert full.losses[-1] < full.losses[0]  # it learns
    partial = train(TINY, tmp_path / "crash", stop_after=6, progress=False)  # "killed" at 6
    assert len(partial.losses) == 6
    resumed = train(TINY, tmp_path / "crash", progress=False)
    assert resumed.resumed_from == 4  # steps 5-6 were never checkpointed: recomputed
    for a, b in zip(_leaves(resumed.model), _leaves(full.model)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(resumed.losses, full.losses)
    again = train(TINY, tmp_path / "crash", progress=False)  # finished: nothing to do
    assert again.resumed_from == TINY.steps


def test_checkpoint_from_another_config_is_refused(tmp_path):
    train(TINY, tmp_path / "ck", stop_after=4, progress=False)
    with pytest.raises(ValueError, match="different config"):
        train(TINY.__class__(**{**TINY.__dict__, "lr": 5e-3}), tmp_path / "ck",
              progress=False)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """An uninterrupted TINY run; its directory keeps the checkpoints of steps 8 and 12."""
    ckpt = tmp_path_factory.mktemp("moe") / "ck"
    return train(TINY, ckpt, progress=False), ckpt


def _damage(step_dir: Path, how: str) -> None:
    """Damage a step; "<how>_unlisted" also deletes its file list (an older checkpoint, or
    a crash between orbax's finalize and the list), so orbax or the digest must catch it."""
    if how.endswith("_unlisted"):
        (step_dir / "servax_files.json").unlink()
        how = how.removesuffix("_unlisted")
    state = step_dir / "state"
    data_files = [p for p in state.rglob("*") if p.is_file() and p.parent.name == "d"]
    biggest = max(data_files, key=lambda p: p.stat().st_size)
    blob = bytearray(biggest.read_bytes())
    if how == "truncated":
        biggest.write_bytes(bytes(blob[:len(blob) // 2]))
    elif how == "bit_flipped":  # orbax itself restores this without complaint
        blob[len(blob) // 2] ^= 0x10
        biggest.write_bytes(bytes(blob))
    elif how == "missing_manifest":
        (state / "manifest.ocdbt").unlink()
    else:
        raise ValueError(how)


@pytest.mark.parametrize("how", ["truncated", "bit_flipped", "missing_manifest",
                                 "bit_flipped_unlisted", "missing_manifest_unlisted"])
def test_damaged_latest_checkpoint_falls_back_to_the_newest_readable(tmp_path, finished_run,
                                                                     how):
    full, done_dir = finished_run
    ckpt = tmp_path / "ck"
    shutil.copytree(done_dir, ckpt)
    assert sorted(p.name for p in ckpt.iterdir()) == ["12", "8"]
    _damage(ckpt / "12", how)
    with pytest.warns(RuntimeWarning, match=r"checkpoint step 12 .* is damaged"):
        resumed = train(TINY, ckpt, progress=False)
    assert resumed.resumed_from == 8  # steps 9-12 recomputed, bit for bit
    for a, b in zip(_leaves(resumed.model), _leaves(full.model)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(resumed.losses, full.losses)
    assert (ckpt / "damaged_step_12").is_dir() and (ckpt / "12").is_dir()
    assert train(TINY, ckpt, progress=False).resumed_from == 12  # the rewritten step reads


def test_no_readable_checkpoint_trains_from_scratch(tmp_path, finished_run):
    _, done_dir = finished_run
    ckpt = tmp_path / "ck"
    shutil.copytree(done_dir, ckpt)
    _damage(ckpt / "12", "truncated")
    _damage(ckpt / "8", "bit_flipped")
    with pytest.warns(RuntimeWarning) as record:
        resumed = train(TINY, ckpt, stop_after=1, progress=False)
    messages = " ".join(str(w.message) for w in record)
    assert "step 12" in messages and "step 8" in messages and "from scratch" in messages
    assert resumed.resumed_from == 0


def test_routing_traces_and_batches(tmp_path):
    model = train(TINY, tmp_path / "t", stop_after=2, progress=False).model
    ids = data.encode("The quick brown fox jumps over the lazy dog. " * 20)
    traces = routing_traces(model, ids, n_steps=3, tokens_per_step=64, seq_len=32)
    assert traces.shape == (TINY.n_layers, 3, 64, TINY.top_k)
    assert traces.min() >= 0 and traces.max() < TINY.n_experts
    b0, b1 = data.batch_at(ids, 0, 2, 16, 0), data.batch_at(ids, 1, 2, 16, 0)
    assert b0.shape == (2, 17) and (b0[:, 0] == data.BOS).all()
    np.testing.assert_array_equal(b0, data.batch_at(ids, 0, 2, 16, 0))
    assert not np.array_equal(b0, b1)
    assert data.decode(data.encode("héllo")) == "héllo"


def test_bad_configs():
    with pytest.raises(ValueError, match="heldout"):
        TrainConfig(split="heldout")
    with pytest.raises(ValueError, match="warmup"):
        TrainConfig(steps=10, warmup=10)
    with pytest.raises(ValueError, match="aux_loss_coef"):
        TrainConfig(aux_loss_coef=-1.0)
    with pytest.raises(ValueError, match="top_k"):
        TrainConfig(n_experts=4, top_k=5).model_config()
    with pytest.raises(ValueError, match="seq_len"):
        data.batch_at(np.arange(10), 0, 2, 16, 0)


_KILL_SCRIPT = """
import dataclasses, json, sys
from research.moe import TrainConfig, train
train(TrainConfig(**json.loads(sys.argv[2])), sys.argv[1], progress=False)
"""


# slow: a subprocess killed with SIGKILL mid-run, then resumed (two JAX start-ups).
@pytest.mark.slow
def test_sigkill_mid_run_then_resume(tmp_path):
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root))
    ckpt = tmp_path / "killed"
    tc = TINY.__class__(**{**TINY.__dict__, "ckpt_every": 2, "steps": 40})
    proc = subprocess.Popen([sys.executable, "-c", _KILL_SCRIPT, str(ckpt),
                             json.dumps(dataclasses.asdict(tc))], cwd=root,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and not any(
            p.name.isdigit() and int(p.name) >= 6 for p in (ckpt.glob("*") if ckpt.exists()
                                                            else [])):
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    resumed = train(tc, ckpt, progress=False)
    assert 6 <= resumed.resumed_from < 40
    full = train(tc, tmp_path / "full", progress=False)
    for a, b in zip(_leaves(resumed.model), _leaves(full.model)):
        np.testing.assert_array_equal(a, b)
