"""A thin `flax.nnx.Module` over the pure forward, for flax-based tools (qwix, tunix).

The model stays functional: `research.model.llama.forward(model, tokens, ...)` over a
`Model` pytree is the one forward. Tools written for flax NNX expect an `nnx.Module`
whose weights are `nnx.Param` variables, and quantization tools (qwix) expect each
projection to be a module whose `jax.lax.dot_general` takes its own Param. So
`NnxModel` holds

    params   the model's weight tree (embed, final_norm, layers[i]..., lm_head), same
             names and shapes; every 2-D projection the model runs through
             `layers.linear` (wq/wk/wv/wo, a dense FFN's w_gate/w_up/w_down, an untied
             lm_head) is an `NnxLinear` module with its array as `kernel`; every other
             array (norms, embeddings, MoE routers and expert stacks) is an `nnx.Param`;
    caches   the per-layer KV caches (a codec's calibrated arrays stay plain leaves);
    config   static.

`__call__` rebuilds the `Model` from the current values and calls `forward`; each
projection reaches `forward` as a `layers.LinearWeight` that calls its `NnxLinear`, so
the logits are exactly the pure forward's (tested on SmolLM2) and a tool that intercepts
module calls sees every projection. `qwix.quantize_model(NnxModel(m), qwix.PtqProvider(
rules), tokens)` quantizes the projections its rules name (module paths such as
`params/layers/3/wq`); `to_model()` hands back a pure `Model` after a tool changed the
weights, qwix's quantized kernels as `QwixLinear` weights (`qwix.dot_general` over the
stored QArray), so the engines serve them. `nnx.state`, `nnx.split` and `nnx.merge`
round-trip it like any NNX module.
"""
from __future__ import annotations

import jax
import qwix
from flax import nnx
from flax import struct
from jaxtyping import Array, Int

from research.model import layers
from research.model.llama import ForwardOutput, Model, forward

# The params keys `forward` runs through `layers.linear` when they hold a 2-D array.
LINEAR_KEYS = frozenset({"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head"})


class NnxLinear(nnx.Module):
    """One [K, N] projection: y = x @ kernel, as the `jax.lax.dot_general` qwix intercepts."""

    def __init__(self, kernel: Array):
        self.kernel = nnx.Param(kernel)

    def __call__(self, x: Array) -> Array:
        kernel = self.kernel[...]  # an array, or qwix's quantized kernel after PTQ
        return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))


class _CallModule(layers.LinearWeight):
    """How an `NnxLinear` reaches `forward`: its `linear` is the module's call."""

    def __init__(self, module: NnxLinear):
        self.module = module

    def linear(self, x: Array) -> Array:
        return self.module(x)


def _wrap(path, x):
    """NnxLinear for a projection weight, nnx.Param for every other array."""
    key = getattr(path[-1], "key", None) if path else None
    if key in LINEAR_KEYS and hasattr(x, "ndim") and x.ndim == 2:
        return NnxLinear(x)
    return nnx.Param(x)


def _is_quantized(kernel) -> bool:
    """qwix PTQ leaves a WithAux (its `.array` a QArray) where the kernel was."""
    return isinstance(getattr(kernel, "array", None), qwix.QArray)


@struct.dataclass
class QwixLinear(layers.LinearWeight):
    """A kernel qwix quantized, in the functional core: `linear(x)` is `qwix.dot_general`
    of x (quantized per token to `act_qtype` first, as qwix's dynamic activation
    quantization does, when that is set) with the stored QArray."""

    qarray: qwix.QArray
    act_qtype: object = struct.field(pytree_node=False, default=None)

    def linear(self, x: Array) -> Array:
        k = self.qarray.qvalue.shape[0]
        if x.shape[-1] != k:
            raise ValueError(f"quantized weight expects inputs [..., {k}], got {x.shape=}")
        lhs = x.reshape(-1, k)
        if self.act_qtype is not None:
            lhs = qwix.quantize(lhs, self.act_qtype, channelwise_axes=(0,))
        y = qwix.dot_general(lhs, self.qarray, (((1,), (0,)), ((), ())))
        return y.astype(x.dtype).reshape(*x.shape[:-1], -1)


class NnxModel(nnx.Module):
    """`Model` as an NNX module: projections as `NnxLinear`, other weights as `nnx.Param`,
    `__call__` = `forward`."""

    def __init__(self, model: Model):
        if not isinstance(model, Model):
            raise TypeError(f"model must be a research.model.Model, got "
                            f"{type(model).__name__}")
        self.config = nnx.static(model.config)
        self.tags = nnx.static(model.tags)
        self.params = nnx.data(jax.tree_util.tree_map_with_path(_wrap, model.params))
        self.caches = nnx.data(model.caches)

    def _params(self, linear) -> dict:
        """The weight tree with each NnxLinear replaced by `linear(module)`."""
        def leaf(x):
            return linear(x) if isinstance(x, NnxLinear) else x.get_value()
        return jax.tree.map(
            leaf, self.params, is_leaf=lambda x: isinstance(x, (NnxLinear, nnx.Variable)))

    def to_model(self, act_qtype=None) -> Model:
        """The pure `Model` of the current weights (the functional core). A kernel qwix
        quantized becomes a `QwixLinear`; qwix keeps no trace of whether its rules also
        quantized activations, so `act_qtype` says it (None: weight-only)."""
        def linear(module):
            kernel = module.kernel[...]
            return QwixLinear(kernel.array, act_qtype) if _is_quantized(kernel) else kernel
        return Model(config=self.config, params=self._params(linear),
                     caches=tuple(self.caches), tags=self.tags)

    def __call__(self, tokens: Int[Array, "B T"], *, cache_states: tuple | None = None,
                 start: Int[Array, "B"] | None = None, n_new: Int[Array, "B"] | None = None,
                 logits: str = "all", capture: bool = False,
                 check_finite: bool = False) -> ForwardOutput:
        """`research.model.llama.forward` of the current weights (same arguments)."""
        model = Model(config=self.config, params=self._params(_CallModule),
                      caches=tuple(self.caches), tags=self.tags)
        return forward(model, tokens, cache_states=cache_states, start=start, n_new=n_new,
                       logits=logits, capture=capture, check_finite=check_finite)
