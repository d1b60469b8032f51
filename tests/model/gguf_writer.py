"""Test helper: write a small llama GGUF (the way llama.cpp's converter does) from params."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from research.model.config import ModelConfig

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def byte_vocab() -> tuple[list[str], list[str], list[int]]:
    """tokens, merges, token types: 2 specials + 256 bytes + a few merges."""
    b2u = bytes_to_unicode()
    tokens = ["<|im_start|>", "<|im_end|>"] + [b2u[b] for b in range(256)]
    merges = []
    for a, b in [("t", "h"), ("th", "e"), ("Ġ", "t"), ("Ġ", "the"), ("i", "n")]:
        merges.append(f"{a} {b}")
        tokens.append(a + b)
    types = [3, 3] + [1] * (len(tokens) - 2)
    return tokens, merges, types


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp converter's Q/K row permutation (inverse of servax's unpermute_qk)."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_llama_gguf(path: Path, config: ModelConfig, params: dict, *, arch: str = "llama",
                     qtype: str = "F32", tokens=None, merges=None, types=None,
                     extra_tensors: dict | None = None) -> Path:
    tokens_, merges_, types_ = byte_vocab()
    tokens, merges, types = tokens or tokens_, merges or merges_, types or types_
    w = gguf.GGUFWriter(str(path), arch)
    c = config
    w.add_block_count(c.n_layers)
    w.add_context_length(c.max_position)
    w.add_embedding_length(c.dim)
    w.add_feed_forward_length(c.ffn_dim)
    w.add_head_count(c.n_heads)
    w.add_head_count_kv(c.n_kv_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(c.head_dim)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    if c.moe is not None:
        w.add_expert_count(c.moe.n_experts)
        w.add_expert_used_count(c.moe.top_k)
        w.add_expert_feed_forward_length(c.moe.expert_ffn_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    qt = gguf.GGMLQuantizationType[qtype]

    def put(name, arr):
        arr = np.ascontiguousarray(np.asarray(arr, np.float32))
        if arr.ndim == 1 or qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, arr)
        else:
            try:
                data = gguf.quants.quantize(arr, qt)
            except NotImplementedError:  # gguf cannot quantize K-quants: write dummy bytes
                data = np.zeros(gguf.quants.quant_shape_to_byte_shape(arr.shape, qt), np.uint8)
            w.add_tensor(name, data, raw_dtype=qt)

    put("token_embd.weight", params["embed"])
    put("output_norm.weight", params["final_norm"])
    if "lm_head" in params:
        put("output.weight", np.asarray(params["lm_head"]).T)
    for i, p in enumerate(params["layers"]):
        p = {k: np.asarray(v) for k, v in p.items()}
        put(f"blk.{i}.attn_norm.weight", p["attn_norm"])
        put(f"blk.{i}.ffn_norm.weight", p["ffn_norm"])
        put(f"blk.{i}.attn_q.weight", permute_qk(p["wq"].T, c.n_heads))
        put(f"blk.{i}.attn_k.weight", permute_qk(p["wk"].T, c.n_kv_heads))
        put(f"blk.{i}.attn_v.weight", p["wv"].T)
        put(f"blk.{i}.attn_output.weight", p["wo"].T)
        if "router" in p:
            put(f"blk.{i}.ffn_gate_inp.weight", p["router"].T)
            put(f"blk.{i}.ffn_gate_exps.weight", p["w_gate"].transpose(0, 2, 1))
            put(f"blk.{i}.ffn_up_exps.weight", p["w_up"].transpose(0, 2, 1))
            put(f"blk.{i}.ffn_down_exps.weight", p["w_down"].transpose(0, 2, 1))
        else:
            put(f"blk.{i}.ffn_gate.weight", p["w_gate"].T)
            put(f"blk.{i}.ffn_up.weight", p["w_up"].T)
            put(f"blk.{i}.ffn_down.weight", p["w_down"].T)
    for name, arr in (extra_tensors or {}).items():
        put(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
