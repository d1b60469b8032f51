"""The NNX adapter: logits equal the pure forward; NNX state/split/merge round-trip."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from research.model import NnxModel, forward
from research.tasq import int8_kv
from research.transforms import calibrate_and_apply


def _prompt(tok):
    ids = tok.encode("The capital of France is")
    return jnp.asarray([ids], jnp.int32)


def test_logits_equal_forward_on_smollm2(smollm2):
    model, tok = smollm2
    tokens = _prompt(tok)
    np.testing.assert_array_equal(np.asarray(NnxModel(model)(tokens).logits),
                                  np.asarray(forward(model, tokens).logits))


def test_every_weight_is_an_nnx_param_with_the_models_path(smollm2):
    model, _ = smollm2
    module = NnxModel(model)
    flat = dict(nnx.to_flat_state(nnx.state(module, nnx.Param)))
    want = {("params",) + tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path): x
            for path, x in jax.tree_util.tree_leaves_with_path(model.params)}
    assert set(flat) == set(want)
    assert ("params", "layers", 0, "wq") in flat
    for path, var in flat.items():
        assert var.get_value() is want[path]  # the model's arrays themselves, not copies


def test_split_merge_round_trip_and_updates_reach_forward(tiny):
    module = NnxModel(tiny)
    tokens = jnp.asarray([[3, 1, 4, 1, 5]], jnp.int32)
    graphdef, state = nnx.split(module)
    again = nnx.merge(graphdef, state)
    np.testing.assert_array_equal(np.asarray(again(tokens).logits),
                                  np.asarray(forward(tiny, tokens).logits))
    # a tool that edits Params (here: zero one projection) changes the forward it runs,
    # and to_model hands the edited weights back to the functional core
    params = nnx.state(again, nnx.Param)
    params["params"]["layers"][0]["wo"][...] = jnp.zeros_like(tiny.params["layers"][0]["wo"])
    nnx.update(again, params)
    edited = again.to_model()
    assert not np.any(np.asarray(edited.params["layers"][0]["wo"]))
    np.testing.assert_array_equal(np.asarray(again(tokens).logits),
                                  np.asarray(forward(edited, tokens).logits))
    assert not np.allclose(np.asarray(again(tokens).logits),
                           np.asarray(forward(tiny, tokens).logits))


def test_nnx_jit_and_grad_see_the_params(tiny):
    """What a trainer (tunix) does: nnx.jit a loss, nnx.grad w.r.t. the Params."""
    module = NnxModel(tiny)
    tokens = jnp.asarray([[2, 7, 1, 8, 2, 8]], jnp.int32)

    def loss(m):
        logits = m(tokens[:, :-1]).logits
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None],
                                             axis=-1))

    grads = nnx.jit(nnx.grad(loss))(module)

    def pure_loss(params):
        return loss(lambda t: forward(tiny.replace(params=params), t))

    want = jax.jit(jax.grad(pure_loss))(tiny.params)
    np.testing.assert_allclose(np.asarray(grads["params"]["layers"][1]["wq"][...]),
                               np.asarray(want["layers"][1]["wq"]), rtol=1e-4, atol=1e-6)


def test_caches_travel_with_the_module_prefill_and_decode(tiny):
    """A codec-carrying model through split/merge; cached prefill + decode == forward."""
    int8 = calibrate_and_apply(int8_kv(), tiny, None)[0]
    module = nnx.merge(*nnx.split(NnxModel(int8)))
    assert module.to_model().caches == int8.caches
    run_module = nnx.jit(lambda m, t, s, start: m(t, cache_states=s, start=start,
                                                  logits="last"))
    run_pure = jax.jit(lambda t, s, start: forward(int8, t, cache_states=s, start=start,
                                                   logits="last"))
    tokens = jnp.asarray([[5, 6, 7, 8]], jnp.int32)
    got = ref = (tokens, int8.init_cache(1, 8), jnp.zeros((1,), jnp.int32))
    for _ in range(2):  # prefill, then one decode step of the argmax token
        got_out, ref_out = run_module(module, *got), run_pure(*ref)
        # compiled apart (weights as arguments vs constants): equal up to f32 rounding
        np.testing.assert_allclose(np.asarray(got_out.logits), np.asarray(ref_out.logits),
                                   rtol=1e-5, atol=1e-6)
        step = jnp.argmax(ref_out.logits, -1)[:, None].astype(jnp.int32)
        start = ref[2] + ref[0].shape[1]
        got = (step, got_out.cache_states, start)
        ref = (step, ref_out.cache_states, start)


def test_rejects_what_is_not_a_model():
    with pytest.raises(TypeError, match="model must be a research.model.Model"):
        NnxModel({"embed": jnp.zeros((2, 2))})
