"""The one platform dispatch every op's api uses: which implementation runs where.

    implementation="auto"   (default) plain-JAX/XLA reference on CPU (and any platform
                            without a kernel), the Pallas Mosaic kernel on TPU, the Pallas
                            GPU kernel on CUDA;
    implementation="xla"    the reference everywhere;
    implementation="pallas" the kernel of the platform (TPU kernel on TPU, GPU kernel on
                            CUDA; elsewhere the TPU kernel, which needs `interpret=True`).

The choice is made with `jax.lax.platform_dependent`, i.e. when the program is LOWERED:
`jax.jit(f).trace(...).lower(lowering_platforms=("tpu",))` on a CPU host selects the TPU
kernel, running the same `f` on the CPU selects XLA. Never `jax.default_backend()` at
trace time, which would bake the host's choice into an exported or cross-lowered program.
Every branch is traced, so a kernel that cannot serve the shapes at hand must be replaced
by the reference *for its platform* before dispatch (see each api's `*_supports`).

`interpret` is not chosen here: it is an explicit argument of the kernels.
"""
from __future__ import annotations

import re
from typing import Callable

import jax

IMPLEMENTATIONS = ("auto", "xla", "pallas")


def check_implementation(implementation: str) -> None:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got "
                         f"{implementation!r}")


def dispatch(*args, implementation: str, xla: Callable, tpu: Callable, cuda: Callable):
    """`xla(*args)`, `tpu(*args)` or `cuda(*args)` by `implementation` and the lowering
    platform (module docstring)."""
    check_implementation(implementation)
    if implementation == "xla":
        return xla(*args)
    default = xla if implementation == "auto" else tpu
    return jax.lax.platform_dependent(*args, tpu=tpu, cuda=cuda, default=default)


def custom_call_targets(hlo_text: str) -> set[str]:
    """The custom-call targets of a lowered module's text (`lowered.as_text()`): the
    markers the lowering tests look for ("tpu_custom_call" for Mosaic TPU,
    "__gpu$xla.gpu.triton" for Triton, "mosaic_gpu*" for Mosaic GPU)."""
    return set(re.findall(r"custom_call @([\w$.]+)", hlo_text))


PALLAS_TPU = "tpu_custom_call"
PALLAS_TRITON = "__gpu$xla.gpu.triton"


def has_pallas_call(targets: set[str], platform: str) -> bool:
    """Whether a lowering for `platform` ("tpu" | "cuda") contains a Pallas kernel."""
    if platform == "tpu":
        return PALLAS_TPU in targets
    return PALLAS_TRITON in targets or any(t.startswith("mosaic_gpu") for t in targets)
