"""A thin `flax.nnx.Module` over the pure forward, for flax-based tools (qwix, tunix).

The model stays functional: `research.model.llama.forward(model, tokens, ...)` over a
`Model` pytree is the one forward. Tools written for flax NNX expect an `nnx.Module`
whose weights are `nnx.Param` variables, so `NnxModel` holds

    params   the model's weight tree (embed, final_norm, layers[i].wq/wk/wv/wo/...,
             lm_head) with every array an `nnx.Param`, same names and shapes;
    caches   the per-layer KV caches (a codec's calibrated arrays stay plain leaves);
    config   static.

`__call__` rebuilds the `Model` from the current Param values and calls `forward`, so
the logits are exactly the pure forward's (tested on SmolLM2), and `to_model()` hands back
a pure `Model` after a tool changed the weights. `nnx.state`, `nnx.split` and
`nnx.merge` round-trip it like any NNX module.
"""
from __future__ import annotations

import jax
from flax import nnx
from jaxtyping import Array, Int

from research.model.llama import ForwardOutput, Model, forward


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


class NnxModel(nnx.Module):
    """`Model` as an NNX module: weights as `nnx.Param`, `__call__` = `forward`."""

    def __init__(self, model: Model):
        if not isinstance(model, Model):
            raise TypeError(f"model must be a research.model.Model, got "
                            f"{type(model).__name__}")
        self.config = nnx.static(model.config)
        self.tags = nnx.static(model.tags)
        self.params = nnx.data(jax.tree.map(nnx.Param, model.params))
        self.caches = nnx.data(model.caches)

    def to_model(self) -> Model:
        """The pure `Model` of the current Param values (the functional core)."""
        params = jax.tree.map(lambda v: v.get_value(), self.params, is_leaf=_is_variable)
        return Model(config=self.config, params=params, caches=tuple(self.caches),
                     tags=self.tags)

    def __call__(self, tokens: Int[Array, "B T"], *, cache_states: tuple | None = None,
                 start: Int[Array, "B"] | None = None, n_new: Int[Array, "B"] | None = None,
                 logits: str = "all", capture: bool = False,
                 check_finite: bool = False) -> ForwardOutput:
        """`research.model.llama.forward` of the current weights (same arguments)."""
        return forward(self.to_model(), tokens, cache_states=cache_states, start=start,
                       n_new=n_new, logits=logits, capture=capture,
                       check_finite=check_finite)
