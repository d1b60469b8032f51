"""The expert-parallel layer under jax.distributed: 2 CPU processes on localhost, each with
4 simulated devices, one 8-device mesh; both must match the single-process reference."""
import pytest

from tests.two_processes import run_two_processes


# slow: two fresh Python processes that import JAX and compile the layer (~30-60 s on a
# shared 2-core machine).
@pytest.mark.slow
def test_two_process_layer_matches_reference(tmp_path):
    reports = run_two_processes("experiments.megaflux.distributed_check", tmp_path, timeout=600)
    for i, r in enumerate(reports):
        assert r["process_id"] == i and r["process_count"] == 2
        assert r["device_count"] == 8 and r["local_devices"] == 4
        assert r["y_max_err"] < 2e-5 and r["grad_max_rel_err"] < 1e-5, str(r)
        assert r["replicas"] > 0
    assert reports[0]["device_load"] == reports[1]["device_load"]
