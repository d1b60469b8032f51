"""Sharding rules: which array splits over which mesh axis, and clear errors (never a
silent replication) when a mesh cannot split a dimension. No compilation here."""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from research.model import init_params, make_model, tiny_config
from research.sharding import (DEFAULT_RULES, logical_spec, make_mesh, override_rules,
                               param_specs, rules_dict, shard_model)
from research.sharding.shapes import LLAMA31_8B, SMOLLM2_135M


def _shapes(config):
    return jax.eval_shape(lambda: init_params(config, jax.random.key(0)))


def test_smollm2_tensor_parallel_3_splits_heads_ffn_and_vocab():
    config = SMOLLM2_135M.replace(n_layers=2)
    specs = param_specs(config, _shapes(config), make_mesh(data=2, tensor=3))
    layer = specs["layers"][0]
    assert layer["wq"] == P(None, "tensor") and layer["wk"] == P(None, "tensor")
    assert layer["wo"] == P("tensor", None) and layer["w_down"] == P("tensor", None)
    assert layer["w_gate"] == P(None, "tensor") and layer["attn_norm"] == P(None)
    assert specs["embed"] == P("tensor", None)


@pytest.mark.parametrize("tensor", [2, 4, 8])
def test_smollm2_heads_that_do_not_divide_are_an_error_naming_them(tensor):
    config = SMOLLM2_135M.replace(n_layers=1)
    # wq has 576 columns, which 2/4/8 divide, but 9 heads / 3 KV heads, which they don't
    with pytest.raises(ValueError, match=r"n_kv_heads=3.*\[1, 3\]"):
        shard_model(make_model(config, _shapes(config)), make_mesh(tensor=tensor))


def test_param_that_a_mesh_cannot_split_is_named():
    config = tiny_config(n_heads=8, n_kv_heads=8, ffn_dim=60, vocab_size=96)
    with pytest.raises(ValueError, match=r"params\['layers'\]\[0\]\['w_(down|gate|up)'\].*'ffn' has 60"):
        param_specs(config, _shapes(config), make_mesh(tensor=8))
    with pytest.raises(ValueError, match=r"params\['embed'\].*'vocab' has 97"):
        param_specs(tiny_config(), _shapes(tiny_config()), make_mesh(tensor=2))
    # replicating the vocabulary is a choice the rules must state
    specs = param_specs(tiny_config(), _shapes(tiny_config()), make_mesh(tensor=2),
                        override_rules(vocab=None))
    assert specs["embed"] == P(None, None) and specs["layers"][0]["wq"] == P(None, "tensor")


def test_llama_8b_on_tp8_and_moe_experts_on_the_expert_axis():
    specs = param_specs(LLAMA31_8B.replace(n_layers=1),
                        _shapes(LLAMA31_8B.replace(n_layers=1)), make_mesh(tensor=8))
    assert specs["lm_head"] == P(None, "tensor") and specs["layers"][0]["wv"] == P(None, "tensor")
    from research.moe import TrainConfig
    config = TrainConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, n_experts=8,
                         expert_ffn_dim=16).model_config()
    specs = param_specs(config, _shapes(config), make_mesh(2, 2, 2), override_rules(vocab=None))
    assert specs["layers"][0]["w_gate"] == P("expert", None, None)
    assert specs["layers"][0]["router"] == P(None, None)
    with pytest.raises(ValueError, match="'experts' has 8"):
        param_specs(config, _shapes(config), make_mesh(expert=3), override_rules(vocab=None))


def test_rule_and_mesh_errors():
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh(data=4, tensor=4)
    with pytest.raises(ValueError, match="tensor must be an int >= 1"):
        make_mesh(tensor=0)
    with pytest.raises(ValueError, match="appears twice"):
        rules_dict((("batch", "data"), ("batch", None)))
    with pytest.raises(ValueError, match="unknown logical axes"):
        override_rules(vocabulary=None)
    with pytest.raises(ValueError, match="mesh has axes"):
        logical_spec(("batch",), (("batch", "replica"),), make_mesh(data=2), shape=(4,))
    with pytest.raises(ValueError, match="would shard two dims"):
        logical_spec(("heads", "ffn"), DEFAULT_RULES, make_mesh(tensor=2), shape=(4, 4))
    assert logical_spec(("batch", None), DEFAULT_RULES, make_mesh(2, 1, 4), shape=(8, 3)) \
        == P(("data", "expert"), None)


def test_cache_batch_that_does_not_divide_is_an_error():
    config = tiny_config(n_heads=4, n_kv_heads=2)
    model = shard_model(make_model(config, init_params(config, jax.random.key(0))),
                        make_mesh(data=4), override_rules(vocab=None))
    with pytest.raises(ValueError, match="batch=6 is not divisible by the data-parallel "
                                         "degree 4"):
        model.init_cache(6, 16)
    states = model.init_cache(8, 16)
    assert states[0]["k"].sharding.spec == P("data", None, None, None)
    assert states[0]["k"].addressable_shards[0].data.shape == (2, 16, 2, 8)
    assert jnp.dtype(states[0]["k"].dtype) == jnp.float32


def test_make_mesh_is_jax_make_mesh_with_auto_axes(monkeypatch):
    """jax.make_mesh (topology-aware order on TPU) with Auto axis types; on the simulated
    CPU devices the order is jax.devices() order, as the hand-built mesh had it."""
    import numpy as np
    from jax.sharding import AxisType, Mesh

    calls = []
    real = jax.make_mesh
    monkeypatch.setattr(jax, "make_mesh", lambda *a, **kw: calls.append((a, kw)) or real(*a, **kw))
    for shape in [(1, 1, 1), (2, 3, 1), (2, 2, 2), (1, 8, 1)]:
        mesh = make_mesh(*shape)
        assert mesh.axis_names == ("data", "tensor", "expert")
        assert mesh.axis_types == (AxisType.Auto,) * 3
        assert mesh == Mesh(np.array(jax.devices()[:np.prod(shape)]).reshape(shape),
                            ("data", "tensor", "expert"))
    assert len(calls) == 4 and calls[1][0][:2] == ((2, 3, 1), ("data", "tensor", "expert"))
    assert [d.id for d in make_mesh(2, 2, devices=jax.devices()[4:]).devices.flat] == [4, 5, 6, 7]


def test_make_mesh_keeps_device_order_where_make_mesh_cannot_lay_it_out(monkeypatch):
    import numpy as np
    from jax.sharding import AxisType

    def refuse(*a, **kw):  # as mesh_utils does for a TPU subset that is no sub-torus
        raise NotImplementedError("no sub-torus")

    monkeypatch.setattr(jax, "make_mesh", refuse)
    mesh = make_mesh(data=2, tensor=3)
    assert mesh.axis_types == (AxisType.Auto,) * 3
    assert [d.id for d in mesh.devices.flat] == [d.id for d in jax.devices()[:6]]
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh(data=16)
    np.testing.assert_array_equal(mesh.devices.shape, (2, 3, 1))
