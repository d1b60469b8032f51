"""Train a small byte-level MoE language model with optax; checkpoint and resume with orbax.

The model is servax's Llama decoder with every FFN a routed MoE (research.model). Expert
matmuls use the tiled grouped matmul (kernels_pallas/grouped_matmul, "xla_tiled"), whose
cost on CPU follows the routed rows (ragged_dot's CPU lowering costs E times more).

Loss = next-byte cross-entropy + aux_loss_coef * Switch-style load-balancing loss
(E * sum_e f_e * P_e per MoE layer, f = fraction of assignments, P = mean router prob);
a small coefficient keeps real skew in the router.

Fault tolerance: every `ckpt_every` steps the params, optimizer state, step and loss
history are saved (orbax, atomic). `train` resumes from the latest checkpoint in
`ckpt_dir`; batches are a pure function of (seed, step), so a killed and resumed run ends
with exactly the params of an uninterrupted one. Each checkpoint carries a SHA-256 digest
of its arrays and loss history, and a list of its files with their sizes and SHA-256
(`servax_files.json`, written once orbax has finalized the step). A checkpoint whose files
do not match that list, that does not restore, or that does not match its digest
(truncated, bit-flipped, missing files) is moved aside to `damaged_step_<n>` with a
warning naming it, and training resumes from the newest readable step (or from scratch).
The file list is checked before orbax reads anything: a restore of a damaged checkpoint
fails on its first bad read and leaves orbax's other reads pending, and their errors,
reported later from background threads, raced with the main thread's traceback
formatting (CPython 3.11: "AST constructor recursion depth mismatch").
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import warnings
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm import tqdm

from kernels_pallas.grouped_matmul import BlockSizes, GroupedMatmul
from research.model import layers
from research.model.config import MoEConfig, ModelConfig
from research.model.llama import Model, forward, init_params, make_model
from research.moe import data

_TILED = GroupedMatmul("xla_tiled", block_sizes=BlockSizes(bm=64))


def moe_ffn_tiled(x, p, top_k: int, renormalize: bool):
    """layers.moe_ffn with the tiled grouped matmul (a hashable MoEConfig.ffn)."""
    return layers.moe_ffn(x, p, top_k, renormalize, matmul=_TILED)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    n_experts: int = 16
    top_k: int = 2
    expert_ffn_dim: int = 256
    seq_len: int = 128
    batch_size: int = 16
    steps: int = 300
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.01
    aux_loss_coef: float = 1e-3
    seed: int = 0
    ckpt_every: int = 50
    split: str = "calibration"  # research.data.corpus_text split (never "heldout")

    def __post_init__(self):
        if self.split == "heldout":
            raise ValueError("train on 'calibration' or 'all', never on the 'heldout' split")
        for name in ("steps", "ckpt_every", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"warmup must be in [0, steps={self.steps}), got {self.warmup}")
        if self.aux_loss_coef < 0:
            raise ValueError(f"aux_loss_coef must be >= 0, got {self.aux_loss_coef}")

    def model_config(self) -> ModelConfig:
        return ModelConfig(
            vocab_size=data.VOCAB_SIZE, dim=self.dim, n_layers=self.n_layers,
            n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
            head_dim=self.dim // self.n_heads, ffn_dim=self.expert_ffn_dim,
            max_position=self.seq_len + 1, bos_token_id=data.BOS,
            moe=MoEConfig(self.n_experts, self.top_k, self.expert_ffn_dim, ffn=moe_ffn_tiled))


class TrainResult(NamedTuple):
    model: Model
    losses: np.ndarray  # [steps] training loss per step (restored ones included)
    aux_losses: np.ndarray
    resumed_from: int  # the step restored from a checkpoint (0 = fresh start)


def load_balance_loss(routing: layers.Routing, n_experts: int) -> jax.Array:
    """Switch-Transformer auxiliary loss E * sum_e f_e * P_e (1.0 when uniform)."""
    probs = jax.nn.softmax(routing.logits, axis=-1)  # [N, E]
    counts = jnp.zeros((n_experts,)).at[routing.expert_ids.reshape(-1)].add(1.0)
    frac = counts / routing.expert_ids.size
    return n_experts * jnp.sum(jax.lax.stop_gradient(frac) * jnp.mean(probs, axis=0))


def _loss_fn(params, config: ModelConfig, batch, aux_coef: float):
    model = make_model(config, params)
    out = forward(model, batch[:, :-1])
    logp = jax.nn.log_softmax(out.logits, axis=-1)
    nll = -jnp.mean(jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1))
    aux = jnp.mean(jnp.stack([load_balance_loss(r, config.moe.n_experts)
                              for r in out.routing if r is not None]))
    return nll + aux_coef * aux, (nll, aux)


def init_train_params(config: ModelConfig, seed: int) -> dict:
    """init_params with the tied embedding scaled by 1/sqrt(dim), so initial logits are O(1)
    (a loss near log(vocab)) instead of O(sqrt(dim))."""
    params = init_params(config, jax.random.key(seed))
    return dict(params, embed=params["embed"] * config.dim ** -0.5)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, tc.lr, tc.warmup, tc.steps,
                                                  end_value=tc.lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, weight_decay=tc.weight_decay))


@functools.lru_cache(maxsize=8)
def make_train_step(tc: TrainConfig):
    """The jitted (params, opt_state, batch) -> (params, opt_state, nll, aux) of a config
    (cached, so a resumed run in the same process reuses the compiled step)."""
    config, optimizer = tc.model_config(), make_optimizer(tc)

    @jax.jit
    def step(params, opt_state, batch):
        grads, (nll, aux) = jax.grad(_loss_fn, has_aux=True)(params, config, batch,
                                                             tc.aux_loss_coef)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, nll, aux
    return step


def _manager(ckpt_dir: Path, tc: TrainConfig) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(ckpt_dir.resolve(), options=ocp.CheckpointManagerOptions(
        max_to_keep=2, save_interval_steps=tc.ckpt_every))


def _digest(state, meta: dict) -> str:
    """SHA-256 of every array (path, dtype, shape, bytes) and of the JSON metadata."""
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(jax.device_get(state))[0]:
        a = np.asarray(leaf)
        h.update(f"{jax.tree_util.keystr(path)}|{a.dtype.str}|{a.shape}|".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    h.update(json.dumps({k: v for k, v in meta.items() if k != "digest"},
                        sort_keys=True).encode())
    return h.hexdigest()


def _save(mngr, step, params, opt_state, losses, aux_losses, tc) -> None:
    state = {"params": params, "opt_state": opt_state}
    # Copies: orbax saves asynchronously and the caller keeps appending to these lists.
    meta = {"config": dataclasses.asdict(tc), "losses": list(losses),
            "aux_losses": list(aux_losses)}
    meta["digest"] = _digest(state, meta)
    saved = mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    meta=ocp.args.JsonSave(meta)))
    if saved:
        mngr.wait_until_finished()  # the step directory is final only now
        if jax.process_index() == 0:  # one writer when several processes share the dir
            _write_file_list(Path(mngr.directory) / str(step))


class _Damaged(Exception):
    pass


_FILE_LIST = "servax_files.json"


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_file_list(step_dir: Path) -> None:
    """{relative path: [size, sha256]} of every file of a finalized step, written atomically."""
    files = {str(p.relative_to(step_dir)): [p.stat().st_size, _sha256_file(p)]
             for p in sorted(step_dir.rglob("*")) if p.is_file() and p.name != _FILE_LIST}
    tmp = step_dir / (_FILE_LIST + ".tmp")
    tmp.write_text(json.dumps(files, indent=0))
    tmp.rename(step_dir / _FILE_LIST)


def _check_file_list(step_dir: Path) -> bool:
    """False if the step has no file list (a crash between finalize and the list, or an
    older checkpoint); _Damaged naming the first listed file that is missing or differs."""
    listing = step_dir / _FILE_LIST
    if not listing.is_file():
        return False
    for rel, (size, sha) in json.loads(listing.read_text()).items():
        path = step_dir / rel
        if not path.is_file():
            raise _Damaged(f"its file {rel} is missing")
        if path.stat().st_size != size:
            raise _Damaged(f"its file {rel} has {path.stat().st_size} bytes, "
                           f"{size} were written")
        if _sha256_file(path) != sha:
            raise _Damaged(f"its file {rel} does not match its SHA-256")
    return True


def _restore_step(mngr, step: int, abstract_state, tc: TrainConfig):
    """(step, state, losses, aux_losses) of one checkpoint; _Damaged if it is unreadable or
    fails its digest, ValueError if it is intact but from another config."""
    step_dir = Path(mngr.directory) / str(step)
    state_dir = step_dir / "state"
    listed = _check_file_list(step_dir)
    manifest_lost = (any(state_dir.glob("ocdbt.process_*"))
                     and not (state_dir / "manifest.ocdbt").is_file())
    if not listed and manifest_lost:
        # checked here: orbax would fail too, but noisily, from its background threads
        raise _Damaged("its OCDBT manifest state/manifest.ocdbt is missing")
    try:
        restored = mngr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
        meta = dict(restored.meta)
        saved, losses, aux_losses = meta["config"], meta["losses"], meta["aux_losses"]
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types
        raise _Damaged(f"{type(e).__name__}: {str(e).splitlines()[0][:200]}") from e
    # Checkpoints written before digests existed have none: restorable is all we can check.
    if "digest" in meta and meta["digest"] != _digest(restored.state, meta):
        raise _Damaged("its arrays or loss history do not match the saved SHA-256 digest")
    if saved != json.loads(json.dumps(dataclasses.asdict(tc))):
        raise ValueError(f"checkpoint at step {step} was trained with a different config: "
                         f"{saved} vs {dataclasses.asdict(tc)}; use a fresh ckpt_dir")
    return step, restored.state, losses, aux_losses


def _restore(ckpt_dir: Path, abstract_state, tc: TrainConfig):
    """(manager, newest readable checkpoint or None). Damaged newer steps are moved aside
    to `damaged_step_<n>` (so this run can write those steps again), each with a warning."""
    mngr = _manager(ckpt_dir, tc)
    restored, damaged = None, []
    for step in sorted(mngr.all_steps(), reverse=True):
        try:
            restored = _restore_step(mngr, step, abstract_state, tc)
            break
        except _Damaged as e:
            damaged.append(step)
            warnings.warn(f"MoE checkpoint step {step} in {ckpt_dir} is damaged ({e}); "
                          f"moving it to damaged_step_{step} and falling back to an older "
                          "step", RuntimeWarning, stacklevel=3)
    if damaged:
        mngr.close()
        for step in damaged:
            aside = ckpt_dir / f"damaged_step_{step}"
            n = 1
            while aside.exists():
                aside, n = ckpt_dir / f"damaged_step_{step}.{n}", n + 1
            (ckpt_dir / str(step)).rename(aside)
        if restored is None:
            warnings.warn(f"no readable MoE checkpoint in {ckpt_dir}: training from scratch",
                          RuntimeWarning, stacklevel=3)
        mngr = _manager(ckpt_dir, tc)
    return mngr, restored


def train(tc: TrainConfig, ckpt_dir: str | Path, *, stop_after: int | None = None,
          progress: bool = True) -> TrainResult:
    """Train (or resume) to tc.steps. stop_after: stop after that many steps of this call
    without a final checkpoint, as a crash would (for fault-tolerance tests)."""
    from research import data as corpus
    ids = data.encode(corpus.corpus_text(tc.split))
    config = tc.model_config()
    optimizer = make_optimizer(tc)
    params = init_train_params(config, tc.seed)
    opt_state = optimizer.init(params)
    mngr, restored = _restore(Path(ckpt_dir), {"params": params, "opt_state": opt_state}, tc)
    start, losses, aux_losses = 0, [], []
    if restored is not None:
        start, state, losses, aux_losses = restored
        # Restored arrays are committed to one device; fresh ones are not. Uncommit them
        # so a resumed model runs under any mesh exactly like a freshly trained one.
        state = jax.tree.map(jnp.asarray, jax.device_get(state))
        params, opt_state = state["params"], state["opt_state"]
    step_fn = make_train_step(tc)
    end = tc.steps if stop_after is None else min(tc.steps, start + stop_after)
    bar = tqdm(range(start, end), desc="train moe", disable=not progress, initial=start,
               total=tc.steps)
    for step in bar:
        batch = jnp.asarray(data.batch_at(ids, step, tc.batch_size, tc.seq_len, tc.seed))
        params, opt_state, nll, aux = step_fn(params, opt_state, batch)
        losses.append(float(nll))
        aux_losses.append(float(aux))
        bar.set_postfix(loss=f"{losses[-1]:.3f}", aux=f"{aux_losses[-1]:.3f}")
        done = step + 1
        if done % tc.ckpt_every == 0 or done == tc.steps:
            _save(mngr, done, params, opt_state, losses, aux_losses, tc)
    mngr.wait_until_finished()
    mngr.close()
    return TrainResult(make_model(config, params), np.asarray(losses),
                       np.asarray(aux_losses), start)


def routing_traces(model: Model, ids: np.ndarray, *, n_steps: int, tokens_per_step: int,
                   seq_len: int, seed: int = 0) -> np.ndarray:
    """[layers, steps, tokens_per_step, top_k] expert ids the trained router picks on
    `n_steps` batches of `tokens_per_step` tokens (windows of `seq_len` bytes)."""
    if tokens_per_step % seq_len:
        raise ValueError(f"tokens_per_step={tokens_per_step} must be a multiple of "
                         f"seq_len={seq_len}")
    run = jax.jit(lambda m, t: tuple(r.expert_ids for r in forward(m, t).routing
                                     if r is not None))
    steps = []
    for step in range(n_steps):
        batch = data.batch_at(ids, step, tokens_per_step // seq_len, seq_len - 1, seed)
        steps.append(np.stack([np.asarray(e) for e in run(model, jnp.asarray(batch))]))
    return np.stack(steps, axis=1)
