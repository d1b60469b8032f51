"""Leaf building blocks shared by model and caches: pytree dataclasses, reference attention.

Kept dependency-free within servax so that model/, kv/ and the techniques layer on top of
it without import cycles (Bazel targets are per package and must form a DAG).
"""
