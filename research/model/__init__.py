"""Llama-family model: config, forward, GGUF loader, tokenizer.

Names are resolved lazily (PEP 562) so that low-level modules such as
`research.core.attention` can be imported by `research.kv` without pulling in the
model, which itself imports `research.kv`.
"""
import importlib

_EXPORTS = {
    "GLOBAL": "config", "SLIDING": "config", "ModelConfig": "config", "MoEConfig": "config",
    "tiny_config": "config", "GGUFError": "gguf_loader", "default_gguf_path": "gguf_loader",
    "load": "gguf_loader", "ForwardOutput": "llama", "Model": "llama", "forward": "llama",
    "init_params": "llama", "make_model": "llama", "Tokenizer": "tokenizer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'research.model' has no attribute {name!r}")
    return getattr(importlib.import_module(f"research.model.{_EXPORTS[name]}"), name)
