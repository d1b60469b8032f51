"""Decoding primitives, the floor below serving: batched prefill + decode under `jit`
(generate.py), next-token selection and the sampling settings' bounds (sampling.py), and
the paged KV pool every engine keeps its K/V in (paged_pool.py).

Techniques (specdecode, specscale, patchkv, dynacore) and the serving engine import
these; nothing here imports `research.serving` (tests/test_import_graph.py)."""
