"""The NNX adapter: logits equal the pure forward; NNX state/split/merge round-trip; qwix
attaches (PTQ through `qwix.quantize_model` quantizes every projection)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import nnx

from research.dynacore import quantize_weight, w8a16
from research.model import NnxModel, forward
from research.model.nnx_adapter import LINEAR_KEYS, QwixLinear

# qwix 0.1.8 reads nnx Variables through flax's deprecated `.value` / VariableState
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:qwix.*")
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
    want = {}
    for path, x in jax.tree_util.tree_leaves_with_path(model.params):
        names = ("params",) + tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path)
        # a projection is a module: its array is that module's `kernel`
        want[names + (("kernel",) if names[-1] in LINEAR_KEYS else ())] = x
    assert set(flat) == set(want)
    assert ("params", "layers", 0, "wq", "kernel") in flat
    assert ("params", "layers", 0, "attn_norm") in flat
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
    params["params"]["layers"][0]["wo"]["kernel"][...] = jnp.zeros_like(tiny.params["layers"][0]["wo"])
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
    np.testing.assert_allclose(np.asarray(grads["params"]["layers"][1]["wq"]["kernel"][...]),
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


_PROJECTIONS = r".*/(wq|wk|wv|wo|w_gate|w_up|w_down)"


def test_qwix_ptq_quantizes_every_projection_on_smollm2(smollm2):
    """qwix attaches: its int8 PTQ codes are DynaCore's W8A16 codes for every projection,
    the module runs them, and to_model hands them to the functional core."""
    model, tok = smollm2
    tokens = _prompt(tok)
    rules = [qwix.QuantizationRule(module_path=_PROJECTIONS, weight_qtype=jnp.int8)]
    quantized = qwix.quantize_model(NnxModel(model), qwix.PtqProvider(rules), tokens)
    codes = {path[:-3]: v.get_value() for path, v in nnx.to_flat_state(nnx.state(quantized))
             if path[-1] == "qvalue"}
    assert len(codes) == 7 * model.config.n_layers
    for (_, _, layer, name), q in codes.items():  # ("params", "layers", i, name)
        mine = quantize_weight(model.params["layers"][layer][name], w8a16())
        np.testing.assert_array_equal(np.asarray(q), np.asarray(mine.qvalue))
    got = np.asarray(quantized(tokens).logits)
    f32 = np.asarray(forward(model, tokens).logits)
    assert not np.array_equal(got, f32)  # the quantized kernels are what runs
    assert np.argmax(got[0, -1]) == np.argmax(f32[0, -1])
    pure = quantized.to_model()  # the functional core runs qwix's codes, jitted
    assert isinstance(pure.params["layers"][4]["w_up"], QwixLinear)
    run = jax.jit(lambda m, t: forward(m, t).logits)
    np.testing.assert_allclose(np.asarray(run(pure, tokens)), got, rtol=1e-4, atol=2e-4)


@pytest.mark.parametrize("weight, act", [(jnp.int8, jnp.int8), (jnp.int4, None)])
def test_qwix_w8a8_and_int4_rules_reach_the_functional_core(tiny, weight, act):
    tokens = jnp.asarray([[3, 1, 4, 1, 5, 9]], jnp.int32)
    rule = qwix.QuantizationRule(module_path=_PROJECTIONS, weight_qtype=weight,
                                 act_qtype=act)
    quantized = qwix.quantize_model(NnxModel(tiny), qwix.PtqProvider([rule]), tokens)
    got = np.asarray(quantized(tokens).logits)
    assert np.isfinite(got).all()
    assert not np.array_equal(got, np.asarray(forward(tiny, tokens).logits))
    np.testing.assert_allclose(np.asarray(forward(quantized.to_model(act), tokens).logits),
                               got, rtol=1e-4, atol=1e-4)
