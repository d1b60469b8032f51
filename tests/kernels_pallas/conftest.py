"""Triton lowerings made in these tests are verified as MLIR on the CPU.

Pallas lowers a kernel to a Triton module on any host, but only the GPU parses and
verifies it: a kernel could lower here and be rejected there (seen on an H200: an scf.for
whose bounds had different types). Wrapping the lowering with `verify()` catches that
class of error in CPU tests. Uses JAX internals; skipped if they move.
"""
import pytest


@pytest.fixture(autouse=True)
def verify_triton_modules(monkeypatch):
    try:
        from jax._src.pallas.triton import pallas_call_registration as registration
    except ImportError:  # pragma: no cover - internals moved: lowering tests still run
        yield
        return
    lower = registration.lowering.lower_jaxpr_to_triton_module

    def lower_and_verify(*args, **kwargs):
        result = lower(*args, **kwargs)
        result.module.operation.verify()  # raises MLIRError with the diagnostics
        return result

    monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module",
                        lower_and_verify)
    yield
