"""Test helper: write a small llama GGUF (the way llama.cpp's converter does) from params."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

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


def q4_k_m_type(name: str, n_layers: int) -> str:
    """llama.cpp's Q4_K_M mix (llama-quant.cpp): Q6_K for output.weight and for attn_v and
    ffn_down in the "more bits" layers (first and last eighth, every third between), Q4_K
    elsewhere."""
    if name == "output.weight":
        return "Q6_K"
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        i = int(name.split(".")[1])
        more_bits = i < n_layers // 8 or i >= 7 * n_layers // 8 or (i - n_layers // 8) % 3 == 2
        return "Q6_K" if more_bits else "Q4_K"
    return "Q4_K"


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp converter's Q/K row permutation (inverse of servax's unpermute_qk)."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_llama_gguf(path: Path, config: ModelConfig, params: dict, *, arch: str = "llama",
                     qtype: str | Callable[[str], str] = "F32", tokens=None, merges=None,
                     types=None, extra_tensors: dict | None = None,
                     file_type: int | None = None) -> Path:
    """Write `params` as llama.cpp's converter would. `qtype` is one GGML type name for every
    matrix, or a function from tensor name to type name (mixes such as Q4_K_M); vectors
    (norms) stay F32. `file_type` sets general.file_type (a gguf.LlamaFileType)."""
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
    if file_type is not None:
        w.add_file_type(int(file_type))

    def put(name, arr):
        arr = np.ascontiguousarray(np.asarray(arr, np.float32))
        type_name = qtype(name) if callable(qtype) else qtype
        qt = gguf.GGMLQuantizationType[type_name]
        if arr.ndim == 1 or qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, arr)
        else:
            byte_shape = gguf.quants.quant_shape_to_byte_shape(arr.shape, qt)
            if type_name in K_QUANTIZERS:  # gguf cannot quantize these: the tests' own
                data = K_QUANTIZERS[type_name](arr.reshape(-1, arr.shape[-1]))
                data = data.reshape(byte_shape)
            else:
                try:
                    data = gguf.quants.quantize(arr, qt)
                except NotImplementedError:  # neither can quantize it: write zero bytes
                    data = np.zeros(byte_shape, np.uint8)
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


# K-quant blocks. gguf 0.19's `gguf.quants.quantize` raises NotImplementedError for the
# K-quants, so the tests build them here, packed as llama.cpp's reference quantizers
# (quantize_row_q4_K_ref / quantize_row_q6_K_ref) pack them, with simpler scale choices.
# Correct packing is checked by dequantizing with `gguf.quants.dequantize`: the values come
# back within the quantization step of the input.
QK_K = 256


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Q4_K bytes [rows, cols // 256 * 144]: per 256 weights f16 d, f16 dmin, 12 bytes of
    6-bit sub-block scales and mins, 128 bytes of nibbles; w = d * sc * q - dmin * m."""
    rows = x.shape[0]
    b = np.asarray(x, np.float32).reshape(-1, 8, 32)  # blocks x sub-blocks x weights
    lo = np.minimum(b.min(-1), 0.0)
    hi = b.max(-1)
    sub_scale, sub_min = (hi - lo) / 15.0, -lo
    d = (sub_scale.max(-1) / 63.0).astype(np.float16)
    dmin = (sub_min.max(-1) / 63.0).astype(np.float16)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.clip(np.round(sub_scale / df), 0, 63), 0).astype(np.uint8)
        m = np.where(dminf > 0, np.clip(np.round(sub_min / dminf), 0, 63), 0).astype(np.uint8)
        step = (df * sc)[..., None]
        q = np.where(step > 0, np.round((b + (dminf * m)[..., None]) / step), 0)
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(-1, QK_K)
    scales = np.zeros((b.shape[0], 12), np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    q = q.reshape(-1, 4, 2, 32)  # 64-weight chunks: low nibble first 32, high nibble next 32
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qs], axis=1)
    return blocks.reshape(rows, -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K bytes [rows, cols // 256 * 210]: per 256 weights 128 bytes of low nibbles,
    64 bytes of high 2-bit pairs, 16 int8 sub-block scales, f16 d; w = d * sc * (q - 32)."""
    rows = x.shape[0]
    b = np.asarray(x, np.float32).reshape(-1, 16, 16)
    sub_scale = np.abs(b).max(-1) / 31.0
    d = (sub_scale.max(-1) / 127.0).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.clip(np.round(sub_scale / df), 0, 127), 0).astype(np.int8)
        step = (df * sc)[..., None]
        q = np.where(step > 0, np.round(b / step), 0)
    L = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # halves of 128
    ql = np.concatenate([L[:, :, 0] & 0xF | ((L[:, :, 2] & 0xF) << 4),
                         L[:, :, 1] & 0xF | ((L[:, :, 3] & 0xF) << 4)], axis=2)
    qh = ((L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4)
          | ((L[:, :, 3] >> 4) << 6))
    blocks = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8),
                             _f16_bytes(d)], axis=1)
    return blocks.reshape(rows, -1)


K_QUANTIZERS = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}


def random_blocks(type_name: str, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks of any GGUF block type: random bytes with every f16 scale field
    set to a finite random value (random f16 bits can be NaN or inf)."""
    qtype = gguf.GGMLQuantizationType[type_name]
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    for offset in F16_FIELDS.get(type_name, ()):
        o = offset % size
        raw[:, o:o + 2] = _f16_bytes(rng.uniform(-2, 2, n_blocks) * 10.0 ** rng.integers(-3, 1))
    return raw


# Byte offsets of f16 fields per block (negative: from the block's end), from ggml-common.h.
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
              "Q2_K": (-4, -2), "Q3_K": (-2,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (-2,),
              "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,),
              "IQ1_S": (0,), "IQ4_NL": (0,), "IQ4_XS": (0,), "TQ1_0": (-2,), "TQ2_0": (-2,)}
