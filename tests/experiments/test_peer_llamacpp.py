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
    assert {"--cont-batching", "--no-repack"} <= set(cmd)
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
