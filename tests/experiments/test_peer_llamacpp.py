"""experiments/serving/peer_llamacpp.py without its peers (they are not servax
dependencies): the servers' command lines, the refusals and the saturation claim."""
import pytest

from experiments.serving import peer_llamacpp as P


def test_llama_server_runs_parallel_slots_with_continuous_batching():
    config = P.get_config("saturation")
    cmd = P._command("llama-server", config, 8123, "/m.gguf")
    assert cmd[0] == config.llama_server
    arg = {k: v for k, v in zip(cmd[1:], cmd[2:]) if k.startswith("--")}
    assert arg["--parallel"] == str(config.peer_slots) == str(config.servax.max_batch)
    assert arg["--ctx-size"] == str(config.peer_slots * config.servax.max_len)
    assert arg["--threads"] == arg["--threads-batch"] == str(config.threads)
    assert arg["--model"] == "/m.gguf" and arg["--alias"] == P.MODEL_NAME
    assert "--cont-batching" in cmd
    assert ("--no-repack" in cmd) == (not P.repack_on(config.repack))
    config.repack = "off"
    assert "--no-repack" in P._command("llama-server", config, 8123, "/m.gguf")
    assert "-c" in P._command("llama.cpp", config, 8123, "/m.gguf")  # the no-repack launcher
    config.repack = "on"
    assert "--no-repack" not in P._command("llama-server", config, 8123, "/m.gguf")
    assert P._command("llama.cpp", config, 8123, "/m.gguf")[1:3] == ["-m", "llama_cpp.server"]
    assert config.servers == ("servax", "llama-server", "llama.cpp")
    with pytest.raises(ValueError, match="unknown server 'vllm'"):
        P._command("vllm", config, 8123, "/m.gguf")


def test_missing_peers_and_unknown_names_are_refused_before_any_server_starts(tmp_path):
    config = P.get_config("saturation")
    config.llama_server = str(tmp_path / "nope")
    config.servers = ("servax", "llama-server")
    with pytest.raises(FileNotFoundError, match="config.llama_server"):
        P.run(config, tmp_path)
    config.servers = ("servax", "sglang")
    with pytest.raises(ValueError, match="sglang"):
        P.run(config, tmp_path)


def test_saturation_claim_is_servax_over_the_batching_peer_at_the_highest_rate():
    rows = [{"server": s, "rate": r, "out_tok_s": v} for s, r, v in [
        ("servax", 4.0, 30.0), ("servax", 16.0, 33.0), ("llama-server", 4.0, 40.0),
        ("llama-server", 16.0, 30.0), ("llama.cpp", 16.0, 10.0)]]
    notes, claims = P.peer_ratios(rows, (4.0, 16.0))
    assert "rate 4.0: servax / llama-server output tok/s = 0.75x" in notes
    assert "rate 16.0: servax / llama.cpp output tok/s = 3.30x" in notes
    assert len(claims) == 1 and claims[0]["measured"] == pytest.approx(1.1)
    assert claims[0]["met"] is False and "16.0 req/s" in claims[0]["claim"]


def test_repacking_is_the_default_except_where_the_cpu_lists_amx():
    assert P.repack_on("auto", "fpu avx2 fma") is True
    assert P.repack_on("auto", "fpu avx512f amx_tile amx_int8") is False
    assert P.repack_on("off", "fpu") is False and P.repack_on("on", "amx_tile") is True
    with pytest.raises(ValueError, match="config.repack"):
        P.repack_on("sometimes")
