"""Two processes under jax.distributed (gloo on CPU, 4 simulated devices each, one
data 2 x tensor 4 mesh across both): the sharded prefill and decode step agree with one
process (experiments/scaleout/distributed_check.py). Small: a 2-layer 8-head model."""
from tests.two_processes import run_two_processes


def test_two_processes_sharded_forward_and_decode_match_one_process(tmp_path):
    reports = run_two_processes("experiments.scaleout.distributed_check", tmp_path,
                                timeout=300, extra_args=("--tensor=4",))
    for i, r in enumerate(reports):
        assert r["process_id"] == i and r["process_count"] == 2, r
        assert r["device_count"] == 8 and r["local_devices"] == 4, r
        assert r["mesh"] == {"data": 2, "tensor": 4, "expert": 1}, r
        assert r["prefill_max_err"] < 1e-4 and r["decode_max_err"] < 1e-4, r
        assert r["greedy_equal"], r
        # tensor 4: every matrix split 4 ways, only norms replicated
        assert r["param_bytes_local_max"] < r["param_bytes_total"] / 3.5, r
