"""Token and weight transport between expert-parallel devices (inside shard_map).

* Padded all_to_all: fixed [D, C, ...] buffers per destination; works everywhere
  (XLA:CPU has no ragged_all_to_all). Dropless when C is the worst case, n_local * top_k.
* Ragged all_to_all: jax.lax.ragged_all_to_all moves only the real rows; GPU/TPU only.
  `ragged_all_to_all_padded` emulates its exact semantics with a padded all_to_all so the
  offsets logic of the ragged path is tested on CPU.
* Replica weights: D-1 collective permutes (shift 1..D-1); in round `shift` each device
  sends the experts that device (me + shift) wants in its slots (zeros elsewhere).
  Autodiff transposes these into reverse permutes that add the replicas' gradients into
  the home experts' gradients.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from research.megaflux.planner import EMPTY, home_of

TRANSPORTS = ("auto", "padded", "ragged", "ragged_emulated")


def vary_like(x: Array, *refs: Array) -> Array:
    """Mark a fresh buffer as varying over the shard_map axes its refs vary over (the type
    of ragged_all_to_all's result is its `output` buffer's, so that buffer must carry the
    data's axes). A no-op outside shard_map or with vma checking off."""
    vma = lambda a: set(jax.typeof(a).mat.varying)  # noqa: E731
    axes = set().union(*map(vma, refs)) - vma(x)
    return jax.lax.pcast(x, tuple(sorted(axes)), to="varying") if axes else x


def platform_has_ragged_all_to_all(platform: str | None = None) -> bool:
    """XLA implements ragged-all-to-all on GPU and TPU, not on CPU."""
    platform = platform or jax.devices()[0].platform
    return platform in ("gpu", "cuda", "rocm", "tpu")


def resolve_transport(transport: str, platform: str | None = None) -> str:
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if transport == "auto":
        return "ragged" if platform_has_ragged_all_to_all(platform) else "padded"
    if transport == "ragged" and not platform_has_ragged_all_to_all(platform):
        raise ValueError("transport='ragged' needs GPU or TPU (XLA:CPU has no "
                         "ragged_all_to_all); use 'padded' or 'ragged_emulated'")
    return transport


def ragged_all_to_all_padded(operand: Array, output: Array, input_offsets: Array,
                             send_sizes: Array, output_offsets: Array, recv_sizes: Array,
                             *, axis_name: str, max_slice: int | None = None) -> Array:
    """jax.lax.ragged_all_to_all semantics (one slice per peer) over a padded all_to_all.

    max_slice: static bound on any slice's rows (default: all of operand)."""
    chunk = min(operand.shape[0], max_slice or operand.shape[0])
    steps = jnp.arange(chunk, dtype=jnp.int32)
    src_idx = jnp.clip(input_offsets[:, None] + steps[None], 0, operand.shape[0] - 1)
    keep = (steps[None] < send_sizes[:, None]).reshape(*src_idx.shape,
                                                       *(1,) * (operand.ndim - 1))
    send = jnp.where(keep, operand[src_idx], 0)
    recv = jax.lax.all_to_all(send, axis_name, 0, 0)  # [D(src), chunk, ...]
    landing = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    dst = landing[:, None] + steps[None]
    dst = jnp.where(steps[None] < recv_sizes[:, None], dst, output.shape[0])  # drop pads
    return output.at[dst].set(recv, mode="drop")


def send_replica_weights(local_experts: Array, slot_expert: Int[Array, "D S"], me,
                         *, axis_name: str, n_devices: int) -> Array:
    """Replica weights for my S slots via D-1 collective permutes.

    local_experts: [E/D, P] my home experts' packed weights. Returns [S, P] (zeros in
    empty slots).
    """
    per_device = local_experts.shape[0]
    s = slot_expert.shape[1]
    mine = slot_expert[me]  # [S]
    received = jnp.zeros((s, local_experts.shape[1]), local_experts.dtype)
    for shift in range(1, n_devices):
        wanted = slot_expert[(me + shift) % n_devices]  # what the receiver wants
        from_me = (wanted != EMPTY) & (home_of(wanted, per_device) == me)
        payload = jnp.where(from_me[:, None],
                            local_experts[jnp.maximum(wanted, 0) % per_device], 0)
        perm = [(i, (i + shift) % n_devices) for i in range(n_devices)]
        got = jax.lax.ppermute(payload, axis_name, perm)
        src = (me - shift) % n_devices
        mask = (mine != EMPTY) & (home_of(mine, per_device) == src)
        received = jnp.where(mask[:, None], got, received)
    return received
