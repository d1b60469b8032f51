"""Writes notebooks/megaflux.ipynb from the cells below (keeps the notebook reviewable).

    python -m experiments.megaflux.make_notebook
"""
from pathlib import Path

from nbformat.v4 import new_code_cell, new_markdown_cell

from experiments import notebook_cells
from experiments.notebook_cells import write_default, write_notebook

INSTALL = notebook_cells.INSTALL + '''
# 8 simulated CPU devices for expert parallelism: must be set before JAX starts.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")'''

CELLS = [
    new_markdown_cell(
        "# MegaFlux: skew-aware runtime expert replication\n\n"
        "Routing skew makes some expert-parallel devices stragglers. MegaFlux plans, per "
        "step and on device, replicas of the hot experts on under-loaded devices and splits "
        "their tokens, so every device does about the same work. This notebook walks the "
        "public API on 8 simulated CPU devices: skew, the planner, the expert-parallel "
        "layer (exact vs the dense reference, forward and backward), the grouped-matmul "
        "kernel, the step-time model and a tiny trained router. The full comparison with "
        "static EP, EPLB and capacity dropping is "
        "`python -m experiments.run --config=experiments/megaflux/megaflux.py:small`."),
    new_code_cell(INSTALL),
    new_code_cell(
        "import jax, jax.numpy as jnp, numpy as np\n"
        "jax.config.update('jax_default_matmul_precision', 'highest')\n"
        "from research.megaflux import (B200, DEEPSEEK_V3_EXPERT, H200, EPConfig, SkewSpec,\n"
        "                               device_loads, ep_moe_ffn, gamma, max_vio,\n"
        "                               per_device_histograms, plan_replicas, static_plan,\n"
        "                               step_times, synthetic_routing)\n"
        "print(jax.device_count(), 'devices')"),
    new_markdown_cell("## Skew and the per-step plan\n\n64 experts, top-8, Zipf 1.2: the "
                      "static placement's straggler factor gamma vs the water-filling plan "
                      "with 4 replica slots per device."),
    new_code_cell(
        "ids = synthetic_routing(SkewSpec(zipf=1.2), n_experts=64, top_k=8,\n"
        "                             n_tokens=8 * 2048, n_steps=1, seed=0)\n"
        "hist = per_device_histograms(ids, 8, 64)[0]     # [source device, expert]\n"
        "loads = jnp.asarray(hist.sum(0), jnp.int32)\n"
        "static = static_plan(loads, 8)\n"
        "plan = jax.jit(plan_replicas, static_argnums=(1, 2, 3))(loads, 8, 4, 300)\n"
        "print('MaxVio', round(max_vio(loads), 2))\n"
        "print('static gamma', round(gamma(device_loads(static)), 3),\n"
        "      '-> MegaFlux gamma', round(gamma(device_loads(plan)), 3))\n"
        "print('replica slots (expert per slot, -1 empty):')\n"
        "print(np.asarray(plan.slot_expert))"),
    new_markdown_cell("## The expert-parallel layer: same outputs and gradients as the "
                      "dense reference\n\nTokens are sharded over the 8 devices; dispatch "
                      "and combine are all_to_all, replica weights move with collective "
                      "permutes, and their gradients flow back to the home experts."),
    new_code_cell(
        "from jax.sharding import Mesh\n"
        "from research.model import layers\n"
        "mesh = Mesh(np.array(jax.devices()[:8]), ('ep',))\n"
        "rng = np.random.default_rng(0)\n"
        "E, D, F = 16, 32, 48\n"
        "p = {'router': rng.normal(size=(D, E)), 'w_gate': rng.normal(size=(E, D, F)) / 6,\n"
        "     'w_up': rng.normal(size=(E, D, F)) / 6, 'w_down': rng.normal(size=(E, F, D)) / 7}\n"
        "p['router'][0, 3] += 3.0                       # make expert 3 hot\n"
        "p = {k: jnp.asarray(v, jnp.float32) for k, v in p.items()}\n"
        "x = jnp.asarray(rng.normal(size=(203, D)), jnp.float32)  # not a multiple of 8\n"
        "x = x.at[:, 0].set(1 + jnp.abs(x[:, 0]))\n"
        "cfg = EPConfig(E, top_k=2, replica_slots=2)\n"
        "y, routing, stats = jax.jit(lambda x, p: ep_moe_ffn(x, p, mesh, cfg))(x, p)\n"
        "y_ref, _ = layers.moe_ffn(x, p, 2, True)\n"
        "print('max |y - y_ref|', float(jnp.max(jnp.abs(y - y_ref))), '| dropped', "
        "int(stats.dropped))\n"
        "print('device loads', np.asarray(stats.device_load), 'static would be',\n"
        "      np.asarray(device_loads(static_plan(stats.hist.sum(0), 8))))\n"
        "loss = lambda f: (lambda x, p: jnp.sum(f(x, p)[0] ** 2))\n"
        "g = jax.jit(jax.grad(loss(lambda x, p: ep_moe_ffn(x, p, mesh, cfg)), argnums=1))(x, p)\n"
        "g_ref = jax.grad(loss(lambda x, p: layers.moe_ffn(x, p, 2, True)), argnums=1)(x, p)\n"
        "print({k: float(jnp.max(jnp.abs(g[k] - g_ref[k]))) for k in g})"),
    new_markdown_cell("## Grouped-matmul kernel\n\nTokens sorted by expert with ragged "
                      "group sizes; the Pallas kernel (Triton or Mosaic TPU backend, here "
                      "in interpret mode) against `jax.lax.ragged_dot`."),
    new_code_cell(
        "from kernels_pallas.grouped_matmul import BlockSizes, grouped_matmul, gmm_reference\n"
        "lhs = jnp.asarray(rng.normal(size=(70, 32)), jnp.float32)\n"
        "rhs = jnp.asarray(rng.normal(size=(4, 32, 40)), jnp.float32)\n"
        "gs = jnp.array([13, 0, 40, 17], jnp.int32)     # an empty group, ragged sizes\n"
        "out = grouped_matmul(lhs, rhs, gs, implementation='pallas', backend='triton',\n"
        "                     interpret=True, block_sizes=BlockSizes(16, 16, 16))\n"
        "print('max err vs ragged_dot', float(jnp.max(jnp.abs(out - gmm_reference(lhs, rhs, "
        "gs)))))"),
    new_markdown_cell("## Modeled step time on an 8-GPU node\n\nPer-device compute at the "
                      "GPU's FLOP rate (roofline per expert group) plus NVLink transfers, "
                      "with the replica transfer overlapped with resident-expert compute "
                      "(constants in `cost_model.py`)."),
    new_code_cell(
        "hist_j = jnp.asarray(hist, jnp.int32)\n"
        "for node in (B200, H200):\n"
        "    s = step_times(static, hist_j, node, DEEPSEEK_V3_EXPERT)\n"
        "    m = step_times(plan, hist_j, node, DEEPSEEK_V3_EXPERT,\n"
        "                              planner_s=2e-4)\n"
        "    print(node.name, f\"fwd {s['fwd_s'] * 1e3:.2f} -> {m['fwd_s'] * 1e3:.2f} ms \"\n"
        "          f\"({s['fwd_s'] / m['fwd_s']:.2f}x), bwd {s['bwd_s'] * 1e3:.2f} -> \"\n"
        "          f\"{m['bwd_s'] * 1e3:.2f} ms ({s['bwd_s'] / m['bwd_s']:.2f}x)\")"),
    new_markdown_cell("## A real router's skew\n\nA tiny byte-level MoE LM, a few optax "
                      "steps (checkpointed with orbax, resumable), then its routing on "
                      "held-out text. The experiment trains a larger one for longer."),
    new_code_cell(
        "import tempfile\n"
        "from research import data\n"
        "from research.moe import TrainConfig, encode, train, routing_traces\n"
        "tc = TrainConfig(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, n_experts=8, top_k=2,\n"
        "                 expert_ffn_dim=32, seq_len=64, batch_size=8, steps=6, warmup=2)\n"
        "result = train(tc, tempfile.mkdtemp(), progress=False)\n"
        "print('loss', result.losses[0].round(3), '->', result.losses[-1].round(3))\n"
        "ids = encode(data.corpus_text('heldout'))\n"
        "traces = routing_traces(result.model, ids, n_steps=2, tokens_per_step=8 * 64,\n"
        "                        seq_len=64)\n"
        "h = per_device_histograms(traces[0], 8, 8)[0]\n"
        "l = jnp.asarray(h.sum(0), jnp.int32)\n"
        "print('layer 0: static gamma', round(gamma(device_loads(\n"
        "    static_plan(l, 8))), 2), '-> planned', round(gamma(\n"
        "    device_loads(plan_replicas(l, 8, 2))), 2))"),
]


def write(path: Path) -> None:
    write_notebook(path, CELLS)


if __name__ == "__main__":
    write_default("megaflux", CELLS)
