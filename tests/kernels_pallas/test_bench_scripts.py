"""The GPU benchmark scripts and the prepared GPU run import and do their shape and byte
bookkeeping on the CPU (--dry-run: tiny sizes, XLA paths), so a device session finds them
working."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_paged_attention_gpu as paged_bench  # noqa: E402
import bench_vq_attention_gpu as vq_bench  # noqa: E402
import gpu_check  # noqa: E402


@pytest.mark.slow  # ~50 s; the compressed-page dry run below keeps gpu_check covered
def test_gpu_check_dry_run_runs_both_attention_benches(tmp_path):
    out = tmp_path / "check.json"
    assert gpu_check.main(["--dry-run", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["sections"]) == set(gpu_check.DRY_SECTIONS)
    for name in ("bench_vq", "bench_paged"):
        rows = report["sections"][name]["rows"]
        assert {r["shape"] for r in rows} == set(vq_bench.SHAPES)
        for r in rows:
            assert r["max_abs_err"] < 1e-2  # "auto" on CPU is the reference itself
            assert r["kernel_ms"] > 0 and 0 < r["kernel_hbm_roofline_frac"] < 1
            assert r["bf16_over_kernel"] == pytest.approx(r["bf16_ms"] / r["kernel_ms"])
    for r in report["sections"]["bench_paged"]["rows"]:  # JAX's own GPU kernel, interpreted
        assert r["jax_paged_max_abs_err"] < 1e-2 and r["jax_paged_ms"] > 0
    vq = report["sections"]["bench_vq"]["rows"][0]  # smollm2, batch 2, 40 tokens
    hq, hkv, d = vq_bench.SHAPES["smollm2_layer"]
    g, k = d // vq_bench.GROUP, vq_bench.CENTROIDS
    q_bytes = 2 * hq * d * 2  # bf16
    assert vq["bytes"]["bf16"] == 2 * (2 * 40 * hkv * d) * 2 + q_bytes  # K and V, bf16
    # codes (1 byte per token, head, group) + f32 codebooks + q + int32 lengths
    assert vq["bytes"]["kernel"] == 2 * (2 * 40 * hkv * g) + 2 * hkv * d * k * 4 + q_bytes + 8


def test_gpu_check_dry_run_times_the_compressed_page_kernels(tmp_path):
    """bench_paged_codecs on CPU: the paged int8 / TaSQ kernels in interpret mode agree with
    their references and every path is timed; bytes are the attended tokens' codes."""
    out = tmp_path / "check.json"
    assert gpu_check.main(["--dry-run", "--sections", "bench_paged_codecs",
                           "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["sections"]["bench_paged_codecs"]["rows"]
    paths = ("bf16_paged", "int8_paged", "int8_gather", "tasq_paged", "tasq_gather",
             "tasq_pre_paged", "tasq_pre_gather")
    assert not [k for k in row if k.endswith("_error")], row
    for name in paths:
        assert row[f"{name}_ms"] > 0
        bf16_dots = name in ("bf16_paged", "int8_paged")
        assert row[f"{name}_rel_err"] < (1e-2 if bf16_dots else 1e-5), name
    tokens = row["batch"] * row["context"]
    assert row["bytes"]["tasq"] * 16 == row["bytes"]["bf16"] == tokens * 3 * 64 * 2 * 2
    assert row["int8_gather_over_paged"] == pytest.approx(
        row["int8_gather_ms"] / row["int8_paged_ms"])


def test_paged_bench_main_and_bad_shape(tmp_path):
    out = tmp_path / "paged.json"
    assert paged_bench.main(["--dry-run", "--shapes", "smollm2_layer", "--page", "8",
                             "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["page"] for r in rows] == [8]
    hq, hkv, d = vq_bench.SHAPES["smollm2_layer"]
    assert rows[0]["pool_bytes"] == 2 * (2 * 5 * 8 * hkv * d) * 2  # 5 pages of 8 a row
    with pytest.raises(SystemExit, match="unknown 'gpt5'"):
        vq_bench.parse_args(["--shapes", "gpt5"])
    with pytest.raises(SystemExit, match="unknown"):
        gpu_check.main(["--dry-run", "--sections", "check_vq"])


def test_cpu_key_read_bench_dry_run(capsys):
    """scripts/bench_vq_key_reads_cpu.py (issue 44 item 2's timings) runs at tiny sizes and
    its rotated-table read matches the rebuild read it is timed against."""
    import bench_vq_key_reads_cpu as key_reads
    assert key_reads.main(["--dry-run"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["ms"]) == {"bf16", "post", "rebuild", "rotated", "post_keys",
                                 "rebuild_keys", "rotated_keys"}
    assert report["rotated_vs_rebuild_max_abs_diff"] < 1e-4


def test_cpu_windowed_read_bench_dry_run(capsys):
    """scripts/bench_windowed_read_cpu.py (issue 44 item 3's timings) runs at tiny sizes
    and reports every row against bf16."""
    import bench_windowed_read_cpu as windowed_read
    windowed_read.main(["--dry-run"])
    report = json.loads(capsys.readouterr().out)
    assert set(report["median_ms"]) == set(report["vs_bf16"]) == {"bf16", "codes",
                                                                  "codes+window"}
    assert report["vs_bf16"]["bf16"] == 1.0
    # a prefill chunk adds the slot-by-slot window read the banded one replaced
    windowed_read.main(["--dry-run", "--chunk", "32"])
    report = json.loads(capsys.readouterr().out)
    assert report["chunk"] == 32
    assert set(report["median_ms"]) == {"bf16", "codes", "codes+window",
                                        "codes+window slot by slot"}
