"""Llama-family model: config, forward, GGUF loader, tokenizer.

Plain imports: `research.kv` and `research.core` do not import the model at run time
(only under TYPE_CHECKING), so there is no cycle to break here.
"""
from research.model.config import GLOBAL, SLIDING, ModelConfig, MoEConfig, tiny_config
from research.model.gguf_loader import GGUFError, default_gguf_path, load
from research.model.llama import (ForwardOutput, Model, forward, forward_live, init_params,
                                  make_model)
from research.model.nnx_adapter import NnxModel
from research.model.tokenizer import Tokenizer

__all__ = sorted(["GLOBAL", "SLIDING", "ModelConfig", "MoEConfig", "tiny_config", "GGUFError",
                  "default_gguf_path", "load", "ForwardOutput", "Model", "forward", "forward_live",
                  "init_params", "make_model", "NnxModel", "Tokenizer"])
