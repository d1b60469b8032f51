"""Leaf building blocks shared by model and caches: reference attention, RoPE.

Kept dependency-free within servax so that model/, kv/ and the techniques layer on top of
it without import cycles (Bazel targets are per package and must form a DAG).
"""
