r"""The one prepared GPU run: check each Pallas kernel, compiled for CUDA (the kernel the
platform dispatch picks there; not interpreted), against its plain-JAX reference on fresh
random inputs, then time it against the XLA path in the same process.

    PYTHONPATH=. python scripts/gpu_check.py --out gpu_check.json [--sections a,b] [--quick]
    PYTHONPATH=. python scripts/gpu_check.py --dry-run   # CPU: bench bookkeeping only

Sections (in order): check_vq, check_paged, check_paged_codecs, check_gmm,
bench_paged_codecs, bench_vq, bench_paged, bench_gmm; tune_vq, tune_paged_vq and
prefill_memory (executed peak memory of a 4 x 8192 SmolLM2-shaped prefill) only when named. The whole run
stays under --budget-s (default 450 s, for an 8-minute device slot): a section that would
start past the budget is recorded as skipped. A failing case is recorded with its error
and the run goes on; the JSON file is rewritten after every section, so a run stopped at
its time limit still leaves what it measured.
Exits 1 if any check failed or raised. Timings are medians after warm-up
(research.core.timing.time_fn); checks compare against the references the CPU tests use.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import triton as pltriton

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling bench scripts

import bench_grouped_matmul_gpu as gmm_bench  # noqa: E402
import bench_paged_attention_gpu as paged_bench  # noqa: E402
import bench_paged_codecs_gpu as codecs_bench  # noqa: E402
import bench_vq_attention_gpu as vq_bench  # noqa: E402
from research.core.timing import time_fn  # noqa: E402
from kernels_pallas.grouped_matmul import (BlockSizes as GmmBlocks, grouped_matmul,  # noqa: E402
                                           gmm_reference, tgmm_reference,
                                           transposed_grouped_matmul)
from kernels_pallas.grouped_matmul import kernel as gmm_kernel  # noqa: E402
from kernels_pallas.paged_attention import api as paged  # noqa: E402
from kernels_pallas.vq_attention import (BlockSizes, KeyRope, vq_decode_attention,  # noqa: E402
                                         vq_decode_attention_paged_codes)
from research.kv.quantized import quantize_int8  # noqa: E402

SECTIONS = ("check_vq", "check_paged", "check_paged_codecs", "check_gmm",
            "bench_paged_codecs", "bench_vq", "bench_paged", "bench_gmm", "tune_vq",
            "tune_paged_vq", "prefill_memory")
DEFAULT_SECTIONS = SECTIONS[:-3]
DRY_SECTIONS = ("bench_paged_codecs", "bench_vq", "bench_paged")
GPU_VQ_BLOCKS = BlockSizes(block_kv=64, blocks_per_split=32)


def error_head(e: Exception) -> str:
    """Type and opening of the message: compiler errors end with a long IR dump."""
    return f"{type(e).__name__}: {str(e)[:1500]}"


def checked(row: dict, got, want) -> dict:
    """row with rel_err of got() vs want; a compile or runtime error of the kernel is a
    result too (rel_err inf, the error's head)."""
    try:
        row["rel_err"] = rel_err(got(), want)
    except Exception as e:  # noqa: BLE001 - one case's failure must not end the run
        row["rel_err"], row["error"] = float("inf"), error_head(e)
    return row


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-12))


# ----------------------------------------------------------------------------- checks
# (batch, Hkv, q per kv, groups, group size, centroids, context, shared codebook, pre-RoPE)
VQ_CASES = [
    (3, 3, 3, 8, 8, 256, 1000, True, False),   # SmolLM2 1-bit layout, ragged tail
    (3, 3, 3, 8, 8, 256, 1000, False, True),   # the same, keys coded before RoPE
    (2, 2, 4, 16, 4, 256, 777, False, False),  # 2 bits per channel (4-channel groups), GQA 4
    (2, 2, 4, 16, 4, 256, 777, True, True),
    (4, 4, 1, 4, 16, 16, 50, False, False),    # MHA, context shorter than one block
    (1, 1, 8, 8, 8, 256, 5000, True, False),   # many splits
]


def check_vq(rng, quick: bool) -> list[dict]:
    rows = []
    for case in VQ_CASES[:3] if quick else VQ_CASES:
        b, hkv, gq, g, gs, k, s, shared, pre = case
        d, hc = g * gs, 1 if shared else hkv
        q = jnp.asarray(rng.normal(size=(b, hkv * gq, d)), jnp.float32)
        kc = jnp.asarray(rng.integers(0, k, (b, s, hkv, g)), jnp.uint8)
        vc = jnp.asarray(rng.integers(0, k, (b, s, hkv, g)), jnp.uint8)
        kcb = jnp.asarray(rng.normal(size=(hc, g, k, gs)), jnp.float32)
        vcb = jnp.asarray(rng.normal(size=(hc, g, k, gs)), jnp.float32)
        lengths = np.asarray(rng.integers(1, s + 1, (b,)), np.int32)
        lengths[0] = s
        rope = (KeyRope.from_permutation(np.stack([rng.permutation(d) for _ in range(hkv)]),
                                         10000.0) if pre else None)
        args = (q, kc, vc, kcb, vcb, jnp.asarray(lengths))
        want = vq_decode_attention(*args, key_rope=rope, implementation="xla")
        # the XLA reference's own f32 einsums run at TF32 on GPU (~4e-4 here)
        for precision, tol in (("highest", 1e-3), ("default", 1e-2)):
            blocks = dataclasses.replace(GPU_VQ_BLOCKS, precision=precision)
            rows.append(checked(
                {"case": list(case), "precision": precision, "tol": tol},
                lambda blocks=blocks: vq_decode_attention(
                    *args, key_rope=rope, implementation="pallas", block_sizes=blocks),
                want))
    return rows


def check_paged(rng, quick: bool) -> list[dict]:
    """Token-major pages [N, 16, Hkv, D], SmolLM2 and Llama-3.1-8B layer shapes, ragged rows
    (one empty, one with an unmapped tail), two block configurations."""
    rows = []
    for hq, hkv, d in ((9, 3, 64), (32, 8, 128)):
        b, bs, n_blocks, m = 4, 16, 300, 64
        for dtype in (jnp.float32, jnp.bfloat16):
            for window, blocks in ((None, paged.kernel.BlockSizes()),
                                   (100, paged.kernel.BlockSizes(pages_per_split=8))):
                q = jnp.asarray(rng.normal(size=(b, hq, d)), dtype)
                k = jnp.asarray(rng.normal(size=(n_blocks, bs, hkv, d)), dtype)
                v = jnp.asarray(rng.normal(size=(n_blocks, bs, hkv, d)), dtype)
                table = rng.permutation(n_blocks)[:b * m].reshape(b, m).astype(np.int32)
                lengths = np.asarray([m * bs, m * bs - 5, 37, 0], np.int32)  # one empty row
                table[2, 3:] = -1  # unmapped past row 2's length
                args = (q, k, v, jnp.asarray(table), jnp.asarray(lengths))
                want = paged.paged_decode_attention(*args, window=window,
                                                    implementation="xla")
                row = {"shape": [hq, hkv, d], "dtype": jnp.dtype(dtype).name,
                       "window": window, "blocks": str(blocks)}
                try:
                    got = paged.paged_decode_attention(*args, window=window,
                                                       implementation="pallas",
                                                       block_sizes=blocks)
                    row["rel_err"] = rel_err(got, want)
                    row["empty_row_zero"] = bool(not np.any(np.asarray(got[3], np.float32)))
                except Exception as e:  # noqa: BLE001 - a compile error is a result
                    row["rel_err"], row["error"] = float("inf"), error_head(e)
                rows.append(row)
    return rows


def check_paged_codecs(rng, quick: bool) -> list[dict]:
    """Compressed pages read through the block table: int8 pages + float16 scales
    (paged_attention with scales) and 1-bit VQ code pages (vq_attention.paged, post- and
    pre-RoPE), SmolLM2 layer shapes, ragged rows: one full, one with an unmapped page inside
    its length (masked), one short with an unmapped tail, one empty."""
    b, hq, hkv, d, bs, n, m = 4, 9, 3, 64, 16, 300, 64
    table = rng.permutation(n)[:b * m].reshape(b, m).astype(np.int32)
    table[1, 5] = -1
    table[2, 3:] = -1
    lengths = jnp.asarray([m * bs, m * bs - 5, 37, 0], jnp.int32)
    table = jnp.asarray(table)
    q = jnp.asarray(rng.normal(size=(b, hq, d)), jnp.float32)
    rows = []
    (k8, ks), (v8, vs) = (quantize_int8(jnp.asarray(rng.normal(size=(n, bs, hkv, d)),
                                                    jnp.float32)) for _ in range(2))
    for window in (None, 100):
        args = (q, k8, v8, table, lengths)
        kw = dict(k_scale=ks, v_scale=vs, window=window)
        want = paged.paged_decode_attention(*args, implementation="xla", **kw)
        row = checked({"codec": "int8", "window": window, "tol": 1e-2},  # bf16 dots
                      lambda: paged.paged_decode_attention(*args, implementation="pallas", **kw),
                      want)
        rows.append(row)
    codes = lambda: jnp.asarray(rng.integers(0, 256, (n, bs, hkv, 8)), jnp.uint8)  # noqa
    books = lambda: jnp.asarray(rng.normal(size=(hkv, 8, 256, 8)), jnp.float32)  # noqa
    args = (q, codes(), codes(), books(), books(), table, lengths)
    rope = KeyRope.from_permutation(np.stack([rng.permutation(d) for _ in range(hkv)]),
                                    10000.0)
    for pre in (False, True):
        key_rope = rope if pre else None
        want = vq_decode_attention_paged_codes(*args, key_rope=key_rope, implementation="xla")
        for precision, tol in (("highest", 1e-3), ("default", 1e-2)):
            got = lambda: vq_decode_attention_paged_codes(  # noqa: E731
                *args, key_rope=key_rope, implementation="pallas", precision=precision)
            row = checked({"codec": "tasq", "pre_rope": pre, "precision": precision,
                           "tol": tol}, got, want)
            if "error" not in row:
                row["empty_row_zero"] = bool(not np.any(np.asarray(got()[3])))
            rows.append(row)
    return rows


def _gmm_pairs(rng, dtype, m: int, sizes, full: bool) -> dict:
    """{op: (reference, kernel) thunks} on fresh inputs; `full` adds rhs^T, tgmm, grads."""
    k, n = 256, 384
    blocks = GmmBlocks(128, 64, 128)
    lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((len(sizes), k, n)) / np.sqrt(k), dtype)
    dout = jnp.asarray(rng.standard_normal((m, n)), dtype)
    sizes = jnp.asarray(sizes, jnp.int32)
    pallas = dict(implementation="pallas", backend="triton", block_sizes=blocks)
    pairs = {"gmm": (lambda: gmm_reference(lhs, rhs, sizes),
                     lambda: grouped_matmul(lhs, rhs, sizes, **pallas))}
    if not full:
        return pairs

    def grads(impl):
        kw = pallas if impl == "pallas" else {}
        loss = lambda a, w: jnp.sum(grouped_matmul(a, w, sizes, **kw).astype(jnp.float32)
                                    * dout)
        return jax.grad(loss, argnums=(0, 1))(lhs, rhs)

    pairs.update({
        "gmm rhs^T": (lambda: gmm_reference(dout, rhs, sizes, transpose_rhs=True),
                      lambda: grouped_matmul(dout, rhs, sizes, transpose_rhs=True, **pallas)),
        "tgmm": (lambda: tgmm_reference(lhs, dout, sizes),
                 lambda: transposed_grouped_matmul(lhs, dout, sizes, **pallas)),
        "grad lhs": (lambda: grads("xla")[0], lambda: grads("pallas")[0]),
        "grad rhs": (lambda: grads("xla")[1], lambda: grads("pallas")[1]),
    })
    return pairs


def check_gmm(rng, quick: bool) -> list[dict]:
    """The shipped config on ragged groups (empty ones, m not a row-block multiple), every
    op; then, for diagnosis, forward gmm with one pipeline stage and with aligned rows."""
    ragged = [300, 0, 7, 250, 0, 1, 400, 30]  # sums to 988 < m = 1000: trailing rows unused
    variants = [(dtype, 2, 1000, ragged, True) for dtype in (jnp.float32, jnp.bfloat16)]
    variants += [(jnp.bfloat16, 1, 1000, ragged, False),
                 (jnp.bfloat16, 2, 1024, [128] * 8, False)]
    shipped = gmm_kernel.compiler_params
    rows = []
    for dtype, stages, m, sizes, full in variants:
        gmm_kernel.compiler_params = lambda backend, semantics, stages=stages: (
            pltriton.CompilerParams(num_warps=4, num_stages=stages))
        try:
            for op, (want, got) in _gmm_pairs(rng, dtype, m, sizes, full).items():
                rows.append(checked({"dtype": jnp.dtype(dtype).name, "num_stages": stages,
                                     "m": m, "op": op}, got, want()))
        finally:
            gmm_kernel.compiler_params = shipped
    return rows


# ---------------------------------------------------------------------------- benches
def _bench_sizes(quick: bool):
    return dict(batches=(1, 32) if quick else vq_bench.BATCHES, contexts=vq_bench.CONTEXTS)


def bench_vq(rng, quick: bool, dry_run: bool = False) -> list[dict]:
    return vq_bench.run(**_bench_sizes(quick), warmup=3, repeats=20, dry_run=dry_run)


def bench_paged(rng, quick: bool, dry_run: bool = False) -> list[dict]:
    return paged_bench.run(**_bench_sizes(quick), warmup=3, repeats=20, dry_run=dry_run)


def bench_paged_codecs(rng, quick: bool, dry_run: bool = False) -> list[dict]:
    contexts = (4096, 32768) if quick else codecs_bench.CONTEXTS
    return codecs_bench.run(codecs_bench.BATCHES, contexts, warmup=3, repeats=20,
                            dry_run=dry_run)


def tune_vq(rng, quick: bool) -> list[dict]:
    """Pallas VQ kernel times over block shapes and dot precision, batch 32, 32k context."""
    x = vq_bench.coded_inputs(rng, "smollm2_layer", 32, 32768)
    args = tuple(x.values())
    rows = []
    for block_kv, bps, precision in itertools.product((32, 64, 128), (8, 32),
                                                      ("highest", "default")):
        bs = BlockSizes(block_kv=block_kv, blocks_per_split=bps, precision=precision)
        fn = jax.jit(lambda *a, bs=bs: vq_decode_attention(
            *a, implementation="pallas", block_sizes=bs))
        try:
            ms = time_fn(lambda: fn(*args), warmup=2, repeats=10)["median_s"] * 1e3
        except Exception as e:  # noqa: BLE001 - a shape Triton rejects is a result
            ms = error_head(e)[:300]
        rows.append({"block_kv": block_kv, "blocks_per_split": bps, "precision": precision,
                     "ms": ms})
    return rows


def tune_paged_vq(rng, quick: bool) -> list[dict]:
    """The paged VQ Triton kernel's times over launch shapes (warps, pages per split) at
    batch 32 x 32k, 1-bit codes, post- and pre-RoPE keys."""
    x = codecs_bench.inputs(rng, 32, 32768)
    kc, vc, kb, vb = x["codes"]
    rows = []
    for pre, warps, per_split in itertools.product((False, True), (1, 2, 4), (16, 64)):
        blocks = paged.kernel.BlockSizes(pages_per_split=per_split, num_warps=warps)
        rope = x["rope"] if pre else None
        fn = jax.jit(lambda *a, blocks=blocks, rope=rope: vq_decode_attention_paged_codes(
            *a, key_rope=rope, implementation="pallas", block_sizes=blocks))
        args = (x["q"], kc, vc, kb, vb, x["table"], x["lengths"])
        try:
            ms = time_fn(lambda: fn(*args), warmup=2, repeats=10)["median_s"] * 1e3
        except Exception as e:  # noqa: BLE001 - a launch shape Triton rejects is a result
            ms = error_head(e)[:300]
        rows.append({"pre_rope": pre, "num_warps": warps, "pages_per_split": per_split,
                     "ms": ms})
    return rows


def bench_gmm(rng, quick: bool) -> list[dict]:
    shapes = dict(list(gmm_bench.SHAPES.items())[:2]) if quick else gmm_bench.SHAPES
    rows = []
    for name, dims in shapes.items():
        rows += gmm_bench.bench_shape(name, dims, jnp.bfloat16, GmmBlocks(128, 64, 128), 20,
                                      rng)
    return rows


# SmolLM2-135M-Instruct's shapes (research.model.load()'s config): the GGUF (98 MB) cannot
# travel to the device, so the prefill-memory section runs random weights of this shape;
# memory and time do not depend on the weights' values.
SMOLLM2_SHAPE = dict(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                     head_dim=64, ffn_dim=1536, rope_theta=100000.0, max_position=8192)


def prefill_memory(rng, quick: bool, batch: int = 4, context: int = 8192,
                   chunk: int = 512) -> list[dict]:
    """Executed peak GPU memory and time of one batch x context prefill of a SmolLM2-shaped
    model (f32 weights, bf16 dense cache), three ways, in this order: 512-token pieces over
    the live slots only (`generate.prefill_in_chunks`, masked key blocks skipped), the same
    pieces over the whole cache capacity, and one piece. Peaks are the allocator's
    `peak_bytes_in_use`, cumulative: the ways run from the smallest expected peak up, and
    each row reports the peak after it (a later row's peak is its own when it rose)."""
    from research.model import init_params, make_model
    from research.model.config import ModelConfig
    from research.model.precision import kv_cache_dtype
    from research.decode import generate as G
    from research.transforms import calibrate_and_apply
    del rng
    cfg = ModelConfig(**SMOLLM2_SHAPE)
    model = make_model(cfg, init_params(cfg, jax.random.key(0)))
    model = calibrate_and_apply(kv_cache_dtype("bfloat16"), model, None)[0]
    dev = jax.devices()[0]
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (batch, context), 1,
                                           cfg.vocab_size), np.int32)
    lengths = np.full((batch,), context, np.int32)

    def full_capacity_pieces(states):
        out = None
        for c0 in range(0, context, chunk):
            out, states, _ = G.prefill_piece(
                model, jnp.asarray(tokens[:, c0:c0 + chunk]), jnp.full((batch,), c0, jnp.int32),
                jnp.full((batch,), chunk, jnp.int32), states)
        return out, states

    ways = {"pieces_live_slots": lambda s: G.prefill_in_chunks(model, tokens, lengths, s,
                                                               chunk)[:2],
            "pieces_full_capacity": full_capacity_pieces,
            "one_piece": lambda s: G.prefill_piece(model, jnp.asarray(tokens),
                                                   jnp.zeros((batch,), jnp.int32),
                                                   jnp.asarray(lengths), s)[:2]}
    rows, ref = [], None
    for name, fn in ways.items():
        before = dev.memory_stats() or {}
        times = []
        for _ in range(2 if quick else 3):  # the first call compiles
            states = model.init_cache(batch, context)
            t0 = time.perf_counter()
            logits, states = fn(states)
            jax.block_until_ready((logits, states))
            times.append(time.perf_counter() - t0)
        after = dev.memory_stats() or {}
        last = np.asarray(logits, np.float32)
        ref = last if ref is None else ref
        rows.append({"way": name, "batch": batch, "context": context, "chunk": chunk,
                     "peak_bytes_after": after.get("peak_bytes_in_use"),
                     "bytes_in_use_before": before.get("bytes_in_use"),
                     "seconds_warm": min(times[1:]), "seconds_first": times[0],
                     "max_abs_logit_diff_vs_first_way": float(np.abs(last - ref).max())})
        del states, logits
    return rows


CHECK_TOLERANCE = {"check_vq": 1e-3, "check_paged": 2e-2, "check_paged_codecs": 1e-3,
                   "check_gmm": 2e-2}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--sections", default="")
    ap.add_argument("--quick", action="store_true", help="fewer cases and sizes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=450.0,
                    help="start no section after this many seconds")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU: the bench sections' bookkeeping at tiny sizes")
    args = ap.parse_args(argv)
    if not args.dry_run and jax.default_backend() != "gpu":
        raise SystemExit(f"needs a CUDA GPU (or --dry-run); jax backend is "
                         f"{jax.default_backend()!r}")
    names = args.sections.split(",") if args.sections else list(
        DRY_SECTIONS if args.dry_run else DEFAULT_SECTIONS)
    for name in names:
        if name not in SECTIONS or (args.dry_run and name not in DRY_SECTIONS):
            allowed = DRY_SECTIONS if args.dry_run else SECTIONS
            raise SystemExit(f"--sections: unknown {name!r}; expected some of {allowed}")
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "seed": args.seed, "dry_run": args.dry_run, "sections": {}}
    failed = False
    start = time.perf_counter()
    for name in names:
        t0 = time.perf_counter()
        if t0 - start > args.budget_s:
            report["sections"][name] = {"skipped": f"past the {args.budget_s:.0f} s budget"}
            continue
        try:
            fn = globals()[name]
            rng = np.random.default_rng(args.seed)
            rows = fn(rng, args.quick, dry_run=True) if args.dry_run else fn(rng, args.quick)
            entry = {"rows": rows}
            tol = CHECK_TOLERANCE.get(name)
            if tol is not None:
                entry["tolerance"] = tol
                entry["passed"] = all(r["rel_err"] <= r.get("tol", tol)
                                      and r.get("empty_row_zero", True) for r in rows)
                failed |= not entry["passed"]
        except Exception as e:  # noqa: BLE001 - record and go on to the next section
            entry = {"error": error_head(e),
                     "where": "".join(traceback.format_tb(e.__traceback__)[-3:])}
            failed = True
        entry["seconds"] = time.perf_counter() - t0
        report["sections"][name] = entry
        print(f"== {name} ({entry['seconds']:.0f} s)", flush=True)
        print(json.dumps(entry, indent=1, default=str)[:6000], flush=True)
        Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
