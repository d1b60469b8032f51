"""Scale-out on JAX's own multi-device runtime: logical-axis sharding rules on a
(data, tensor, expert) mesh, GSPMD-jitted prefill/decode, shard_map'd KV caches, the
compiled step's collectives, and a roofline model of real slices.

    from research.sharding import make_mesh, shard_model
    sharded = shard_model(model, make_mesh(data=2, tensor=3))   # SmolLM2: 3 KV heads
    logits, states = prefill(sharded, tokens, lengths, sharded.init_cache(b, max_len))
"""
from research.sharding.hlo import Collective, collectives, gathers_of
from research.sharding.hlo import summary as collective_summary
from research.sharding.model import (ShardedKVCache, cache_state_specs, check_attention_layout,
                                     param_logical_axes, param_specs, per_device_bytes, place,
                                     shard_cache_states, shard_caches, shard_model)
from research.sharding.roofline import H200, SLICES, TPU_V5E, Chip
from research.sharding.roofline import decode_step as modeled_decode_step
from research.sharding.roofline import layouts as modeled_layouts
from research.sharding.rules import (DATA, DEFAULT_RULES, EXPERT, MESH_AXES, POOL_RULES,
                                     TENSOR, check_pool_mesh, logical_spec, make_mesh,
                                     override_rules, rules_dict)
from research.sharding.shapes import LLAMA31_8B, SMOLLM2_135M

__all__ = ["DATA", "TENSOR", "EXPERT", "MESH_AXES", "DEFAULT_RULES", "POOL_RULES",
           "check_pool_mesh", "make_mesh",
           "logical_spec", "rules_dict", "override_rules", "ShardedKVCache", "shard_model",
           "shard_caches", "shard_cache_states", "cache_state_specs", "param_logical_axes",
           "param_specs", "check_attention_layout", "per_device_bytes", "place",
           "Collective", "collectives", "gathers_of", "collective_summary", "Chip",
           "TPU_V5E", "H200", "SLICES", "modeled_decode_step", "modeled_layouts",
           "SMOLLM2_135M", "LLAMA31_8B"]
