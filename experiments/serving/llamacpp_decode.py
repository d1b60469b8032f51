"""Child of peer_llamacpp_long.py, run by the peer's Python (llama-cpp-python, not a servax
dependency): prefill the given token ids with llama.cpp at one KV cache type, then time
greedy decode steps. Prints one JSON line.

    python llamacpp_decode.py MODEL.gguf IDS.json KV_TYPE DECODE_STEPS THREADS

KV_TYPE: f16, q8_0 or q4_0 (keys and values; flash attention on, which quantized V needs).
"""
import json
import statistics
import sys
import time

import llama_cpp
import llama_cpp.llama_cpp as C

KV_TYPES = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0,
            "q4_0": llama_cpp.GGML_TYPE_Q4_0}


def _no_repack(default=C.llama_model_default_params):
    # this VM lists AMX and ggml's AMX Q4_1 matmul segfaults in it (peer_llamacpp.py)
    p = default()
    p.use_extra_bufts = False
    return p


def main(model: str, ids_path: str, kv: str, steps: int, threads: int) -> dict:
    if kv not in KV_TYPES:
        raise SystemExit(f"KV_TYPE must be one of {sorted(KV_TYPES)}, got {kv!r}")
    C.llama_model_default_params = _no_repack
    with open(ids_path) as f:
        ids = json.load(f)
    llm = llama_cpp.Llama(model_path=model, n_ctx=len(ids) + steps + 1, n_batch=512,
                          n_ubatch=512, n_threads=threads, n_threads_batch=threads,
                          flash_attn=True, type_k=KV_TYPES[kv], type_v=KV_TYPES[kv],
                          verbose=False)
    t0 = time.perf_counter()
    llm.eval(ids)
    prefill_s = time.perf_counter() - t0
    times, out = [], []
    for _ in range(steps):
        tok = llm.sample(top_k=1, temp=0.0)
        out.append(int(tok))
        t = time.perf_counter()
        llm.eval([tok])
        times.append(time.perf_counter() - t)
    step = statistics.median(times[1:])
    return {"kv": kv, "prompt_tokens": len(ids), "prefill_s": prefill_s,
            "step_ms": step * 1e3, "decode_tok_s": 1.0 / step, "tokens": out,
            "llama_cpp": llama_cpp.__version__}


if __name__ == "__main__":
    m, p, k, s, t = sys.argv[1:6]
    print(json.dumps(main(m, p, k, int(s), int(t))))
