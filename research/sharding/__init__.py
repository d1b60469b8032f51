"""Scale-out on JAX's own multi-device runtime: logical-axis sharding rules on a
(data, tensor, expert) mesh, GSPMD-jitted prefill/decode, shard_map'd KV caches.

    from research.sharding import make_mesh, shard_model
    sharded = shard_model(model, make_mesh(data=2, tensor=3))
"""
from research.sharding.model import (ShardedKVCache, cache_state_specs, check_attention_layout,
                                     param_logical_axes, param_specs, per_device_bytes,
                                     shard_cache_states, shard_caches, shard_model)
from research.sharding.rules import (DATA, DEFAULT_RULES, EXPERT, MESH_AXES, TENSOR,
                                     logical_spec, make_mesh, override_rules, rules_dict)

__all__ = ["DATA", "TENSOR", "EXPERT", "MESH_AXES", "DEFAULT_RULES", "make_mesh",
           "logical_spec", "rules_dict", "override_rules", "ShardedKVCache", "shard_model", "shard_caches",
           "shard_cache_states", "cache_state_specs", "param_logical_axes", "param_specs",
           "check_attention_layout", "per_device_bytes"]
