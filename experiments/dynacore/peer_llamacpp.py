r"""llama.cpp peer timing: the same SmolLM2 GGUF in llama.cpp's own Q4_1 and Q8_0 forms.

Runs in the peer venv (llama-cpp-python), never in CI or the servax venv:

    /work/peer-venv/bin/python experiments/dynacore/peer_llamacpp.py \
        --gguf <SmolLM2 GGUF> --workdir /tmp/peer --threads 2 --prompt 256 --decode 32

The embedded GGUF is already Q4_1 (it is used as is); Q8_0 is made from it with
`llama_cpp.llama_model_quantize` (requantizing). Prints one JSON line:
{"Q4_1": {"prefill_tok_s", "decode_tok_s"}, "Q8_0": {...}, "threads": n, ...}; decode is
batch 1, one token per eval (teacher-forced fixed ids), medians over repeats after a
warm-up, like servax's timing.
"""
import argparse
import ctypes
import json
import os
import statistics
import time


def quantize(src: str, dst: str, ftype: int) -> None:
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize failed ({rc}) for {dst}")


def no_extra_buffer_types() -> None:
    """Load models without llama.cpp's extra CPU buffer types (AMX tiles, weight repacking).

    On this machine the AMX matmul faults (general protection fault on `ldtilecfg` in
    ggml_backend_amx_mul_mat: the sandbox does not grant the AMX tile state), so every
    llama_decode segfaults with them on. The plain ggml CPU kernels (AVX-512) remain."""
    import llama_cpp.llama_cpp as lc
    default = lc.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    lc.llama_model_default_params = params


def time_model(path: str, threads: int, prompt: int, decode: int, repeats: int) -> dict:
    from llama_cpp import Llama
    no_extra_buffer_types()
    llm = Llama(model_path=path, n_ctx=prompt + decode + 8, n_threads=threads,
                n_threads_batch=threads, n_batch=prompt, verbose=False)
    ids = [(i * 37 + 11) % 1000 + 100 for i in range(prompt + decode)]
    pre, dec = [], []
    for r in range(repeats + 1):  # round 0 is the warm-up
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids[:prompt])
        t1 = time.perf_counter()
        for t in ids[prompt:prompt + decode]:
            llm.eval([t])
        t2 = time.perf_counter()
        if r:
            pre.append(t1 - t0)
            dec.append(t2 - t1)
    return {"prefill_tok_s": prompt / statistics.median(pre),
            "decode_tok_s": decode / statistics.median(dec),
            "prefill_s": pre, "decode_s": dec, "bytes": os.path.getsize(path)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    import llama_cpp
    os.makedirs(a.workdir, exist_ok=True)
    q8 = os.path.join(a.workdir, "smollm2-q8_0.gguf")
    if not os.path.exists(q8):
        quantize(a.gguf, q8, llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0)
    out = {"threads": a.threads, "prompt": a.prompt, "decode": a.decode,
           "llama_cpp_python": llama_cpp.__version__, "extra_buffer_types": False}
    for name, path in (("Q4_1", a.gguf), ("Q8_0", q8)):
        out[name] = time_model(path, a.threads, a.prompt, a.decode, a.repeats)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
