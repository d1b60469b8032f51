"""Test-wide setup: CPU only, 8 simulated host devices (for expert-parallel tests)."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()
# Tests check what programs compute, not how fast they run: on 2 CPU cores much of a small
# model's test is XLA's LLVM code generation, so tests (and the runs they start) compile
# with JAX's disable_most_optimizations (LLVM at optimization level 0; the same HLO
# passes): about 30% less make test time on 2 cores.
# JAX_DISABLE_MOST_OPTIMIZATIONS=0 tests the optimized programs.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2():
    """(Model, Tokenizer) of the embedded SmolLM2-135M-Instruct, loaded once per session."""
    from research.model import load
    return load()


@pytest.fixture
def tiny():
    """A 2-layer random-weight model for fast unit tests."""
    from research.model import init_params, make_model, tiny_config
    config = tiny_config()
    return make_model(config, init_params(config, jax.random.key(0)))
