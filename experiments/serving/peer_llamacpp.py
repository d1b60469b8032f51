r"""Peer comparison: servax's server vs llama.cpp's own batching server (`llama-server`
with parallel slots and continuous batching) and llama-cpp-python's OpenAI server.

Command:   flock /work/bench.lock python -m experiments.run \
               --config=experiments/serving/peer_llamacpp.py:small   (or :saturation)
Needs:     (not servax dependencies, so this script is not part of CI or `make test`)
           - `llama-server` (config.llama_server), built from the llama.cpp source that
             llama-cpp-python vendors (its sdist's vendor/llama.cpp):
               cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
                 -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON
               cmake --build build --target llama-server -j2
           - a Python with `llama-cpp-python[server]` (config.peer_python). It may be
             installed with CMAKE_ARGS=-DLLAMA_BUILD=OFF and pointed at the libllama of
             the build above (config.peer_lib_path -> LLAMA_CPP_LIB_PATH): the same
             source and compiler flags for both llama.cpp peers, and one build, not two.
Hardware:  CPU, the same machine for all servers, one server running at a time.
Expected:  the same seeded streaming load (experiments/serving/loadgen.py) at each rate
           against every server, same GGUF (SmolLM2-135M-Instruct Q4_1), greedy; a table
           and latency/throughput-vs-rate plots. llama-server decodes its `peer_slots`
           slots in one batch (continuous batching, the way its users serve concurrency);
           llama-cpp-python's server handles one request at a time; both use ggml's
           quantized-weight kernels. servax dequantizes to f32 and batches continuously
           in XLA.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import ml_collections

from experiments import common
from experiments.serving import loadgen as lg

MODEL_NAME = "SmolLM2-135M-Instruct"
SERVERS = ("servax", "llama-server", "llama.cpp")  # llama.cpp: llama-cpp-python's server
# dev/test protocol declarations (experiments/protocol.py where it exists): nothing here
# is tuned; engine sizes and SLOs were set a priori for a 2-core CPU
TECHNIQUE = "serving_peer_llamacpp"
DEFAULTS_CHOSEN_ON = "none: engine sizes and SLOs set a priori for a 2-core CPU, not tuned"


def defaults(config) -> dict:
    return {"engine": config.servax.to_dict(), "slo": config.slo.to_dict()}


ROOT = Path(__file__).resolve().parents[2]
COLUMNS = ["server", "rate", "ok", "mean_out_tokens", "out_tok_s", "req_s", "goodput_req_s",
           "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p50_ms", "itl_p99_ms",
           "load_1min"]


def get_config(arg: str = "small") -> ml_collections.ConfigDict:
    """small / full: a rate sweep; saturation: offered loads far above either server's
    capacity (4 to 16 req/s), 32 requests each, so output tok/s is each server's ceiling."""
    small = arg == "small"
    c = common.new_config(arg, "experiments.serving.peer_llamacpp",
                          args=("small", "full", "saturation"),
                          run_name=f"serving_peer_llamacpp_{arg}")
    c.peer_python = "/work/peer-venv/bin/python"
    c.peer_lib_path = ""  # LLAMA_CPP_LIB_PATH for peer_python's llama_cpp ("": its own)
    c.llama_server = ("/work/peer/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/"
                      "llama-server")
    c.servers = ("servax", "llama-server", "llama.cpp")
    c.threads = os.cpu_count() or 1
    c.rates = (0.5, 1.0, 2.0) if small else (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
    c.n_requests = 8 if small else 48
    if arg == "saturation":
        c.rates, c.n_requests = (4.0, 8.0, 16.0), 32
    c.peer_slots = 8  # llama-server -np: as many sequences decoded together as servax's max_batch
    c.servax = ml_collections.ConfigDict(dict(
        kv_codec="bf16", n_blocks=128, block_size=16, max_batch=8, max_len=384,
        token_budget=64, prefill_chunk=32, max_queue=1024))
    c.workload = ml_collections.ConfigDict(dict(
        prompt_median=48, prompt_sigma=0.7, output_median=16, output_sigma=0.5,
        max_prompt=192, max_output=48, split="heldout"))
    c.slo = ml_collections.ConfigDict(dict(ttft_s=2.0, tpot_s=0.25))
    c.start_timeout_s = 900
    # ggml's weight repacking (its default): "auto" turns it off only where the CPU lists
    # AMX, whose repacked Q4_1 matmul segfaulted in an earlier VM (see PEER_LAUNCHER)
    c.repack = "auto"
    return c


def repack_on(setting, cpu_flags: str | None = None) -> bool:
    """Whether the llama.cpp peers keep ggml's weight repacking (the default their users
    get): `setting` "on" / "off", or "auto" = on unless the CPU lists AMX."""
    if setting in ("on", "off"):
        return setting == "on"
    if setting != "auto":
        raise ValueError(f"config.repack must be 'on', 'off' or 'auto', got {setting!r}")
    if cpu_flags is None:
        try:
            cpu_flags = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpu_flags = ""
    return "amx_tile" not in cpu_flags.split()


# llama-cpp-python's server, with ggml's weight repacking ("extra buffer types") off, for
# CPUs where it crashes: a VM that listed AMX in /proc/cpuinfo segfaulted in ggml's AMX
# Q4_1 matmul (ggml_backend_amx_mul_mat, SIGSEGV in llama_decode); without repacking ggml
# uses its plain Q4_1 kernels. Arguments after the code are the server's own.
PEER_LAUNCHER = """
import runpy, sys
import llama_cpp.llama_cpp as C
_default = C.llama_model_default_params
def _no_repack():
    p = _default()
    p.use_extra_bufts = False
    return p
C.llama_model_default_params = _no_repack
sys.argv = ["llama_cpp.server"] + sys.argv[1:]
runpy.run_module("llama_cpp.server", run_name="__main__")
"""


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; log {log}:\n"
                               + log.read_text()[-3000:])
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url} not ready after {timeout_s} s; log {log}")


def _command(name: str, config, port: int, gguf: str) -> list[str]:
    if name == "servax":
        s = config.servax
        return [sys.executable, "-m", "research.serving.server", "--host=127.0.0.1",
                f"--port={port}", f"--gguf={config.gguf_path}", f"--kv_codec={s.kv_codec}",
                f"--n_blocks={s.n_blocks}", f"--block_size={s.block_size}",
                f"--max_batch={s.max_batch}", f"--max_len={s.max_len}",
                f"--token_budget={s.token_budget}", f"--prefill_chunk={s.prefill_chunk}",
                f"--max_queue={s.max_queue}",
                "--log_level=warning"]
    if name == "llama-server":
        slots = config.peer_slots
        # -c is the whole KV cache, split over the slots: each slot holds servax's max_len
        return [config.llama_server, "--model", gguf, "--alias", MODEL_NAME,
                "--host", "127.0.0.1", "--port", str(port), "--threads", str(config.threads),
                "--threads-batch", str(config.threads), "--parallel", str(slots),
                "--cont-batching", "--ctx-size", str(slots * config.servax.max_len),
                "--no-webui"] + ([] if repack_on(config.repack) else ["--no-repack"])
    if name == "llama.cpp":
        launch = (["-m", "llama_cpp.server"] if repack_on(config.repack)
                  else ["-c", PEER_LAUNCHER])
        return [config.peer_python, *launch, "--model", gguf,
                "--model_alias", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
                "--n_ctx", str(config.servax.max_len), "--n_threads", str(config.threads),
                "--interrupt_requests", "False", "--verbose", "False"]
    raise ValueError(f"unknown server {name!r}; expected one of {SERVERS}")


def _peer_env(config, env: dict) -> dict:
    if config.peer_lib_path:
        return dict(env, LLAMA_CPP_LIB_PATH=config.peer_lib_path)
    return env


def _peer_version(config, env: dict) -> str:
    out = subprocess.run([config.peer_python, "-c",
                          "import llama_cpp; print(llama_cpp.__version__)"],
                         capture_output=True, text=True, timeout=120,
                         env=_peer_env(config, env))
    return out.stdout.strip() or f"unknown ({out.stderr.strip()[-200:]})"


def _llama_server_version(config) -> str:
    out = subprocess.run([config.llama_server, "--version"], capture_output=True, text=True,
                         timeout=60)
    text = (out.stdout + out.stderr).strip().splitlines()
    return next((line for line in text if line.startswith("version")), "unknown")


def run(config, out_dir) -> common.Report:
    from research.model import default_gguf_path, load
    unknown = set(config.servers) - set(SERVERS)
    if unknown:
        raise ValueError(f"config.servers has unknown names {sorted(unknown)}; "
                         f"expected names from {SERVERS}")
    if "llama.cpp" in config.servers and not Path(config.peer_python).is_file():
        raise FileNotFoundError(f"config.peer_python={config.peer_python!r} does not exist; "
                                "point it at a Python with llama-cpp-python[server]")
    if "llama-server" in config.servers and not Path(config.llama_server).is_file():
        raise FileNotFoundError(f"config.llama_server={config.llama_server!r} does not "
                                "exist; build llama.cpp's llama-server (see the docstring)")
    gguf = config.gguf_path or str(default_gguf_path())
    _, tok = load(gguf)
    w = config.workload
    workloads = [lg.sharegpt_like(tok, config.n_requests, rate, config.seed + k, split=w.split,
                                  prompt_median=w.prompt_median, prompt_sigma=w.prompt_sigma,
                                  output_median=w.output_median, output_sigma=w.output_sigma,
                                  max_prompt=w.max_prompt, max_output=w.max_output)
                 for k, rate in enumerate(config.rates)]
    warm = lg.sharegpt_like(tok, 2, math.inf, config.seed + 999, split=w.split)
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    rows, extra = [], {"gguf": Path(gguf).name, "threads": config.threads}
    if "llama.cpp" in config.servers:
        extra["llama_cpp_python"] = _peer_version(config, env)
        extra["llama_cpp_python_lib"] = config.peer_lib_path or "its own build"
    if "llama-server" in config.servers:
        extra["llama_server"] = _llama_server_version(config)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in config.servers:
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        log = out_dir / f"{name}.log"
        with open(log, "w") as logf:
            t0 = time.perf_counter()
            proc = subprocess.Popen(_command(name, config, port, gguf), cwd=ROOT,
                                    env=_peer_env(config, env) if name == "llama.cpp" else env,
                                    stdout=logf, stderr=subprocess.STDOUT)
            try:
                _wait_ready(url, proc, config.start_timeout_s, log)
                extra[f"{name} start_s"] = time.perf_counter() - t0
                lg.run_http(url, MODEL_NAME, warm, usage=False)
                for rate, specs in zip(config.rates, workloads):
                    # usage=False: llama-cpp-python may not know stream_options; tokens are
                    # counted as SSE chunks with text for both servers
                    results, wall = lg.run_http(url, MODEL_NAME, specs, usage=False)
                    s = lg.summarize(results, wall, ttft_slo_s=config.slo.ttft_s,
                                     tpot_slo_s=config.slo.tpot_s)
                    errors = sorted({r.error for r in results if not r.ok})[:3]
                    print(f"{name} rate={rate}: {s['ok']}/{s['requests']} ok, "
                          f"{s['out_tok_s']:.1f} tok/s, ttft p50 {s['ttft_p50_ms']:.0f} ms "
                          f"p99 {s['ttft_p99_ms']:.0f} ms {errors}", flush=True)
                    rows.append({"server": name, "rate": rate, **s,
                                 "load_1min": round(os.getloadavg()[0], 2)})
                    if errors:
                        extra[f"{name} rate {rate} errors"] = errors
            finally:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    repack = ("ggml weight repacking on (its default)" if repack_on(config.repack) else
              "ggml weight repacking off (the CPU lists AMX, whose repacked path crashed)")
    notes = [f"same seeded workloads for every server ({config.n_requests} requests per "
             f"rate, Poisson arrivals, greedy, streaming /v1/completions); GGUF "
             f"{extra['gguf']}; {config.threads} threads each; servax {dict(config.servax)}"]
    if "llama-server" in config.servers:
        notes.append(f"llama-server ({extra['llama_server']}, llama.cpp vendored by "
                     f"llama-cpp-python 0.3.36): --parallel {config.peer_slots} "
                     f"--cont-batching, --ctx-size {config.peer_slots} x "
                     f"{config.servax.max_len}, {repack}")
    if "llama.cpp" in config.servers:
        notes.append(f"llama.cpp = llama-cpp-python {extra['llama_cpp_python']}'s server "
                     f"(library: {extra['llama_cpp_python_lib']}), one request at a time, "
                     f"interrupt_requests=False, {repack}")
    notes += ["output tokens are counted as SSE chunks carrying text (every server sends one "
              "token per chunk); each server stops at its own EOS, so mean_out_tokens can "
              "differ",
              f"SLOs: TTFT <= {config.slo.ttft_s} s, TPOT <= {config.slo.tpot_s} s",
              "load_1min: the machine's 1-minute load average after each rate (2 cores; "
              "above ~2 other processes shared the CPU with the server under test)"]
    ratio_notes, claims = peer_ratios(rows, config.rates)
    notes += ratio_notes
    return common.Report(columns=COLUMNS, rows=rows, extra=extra, notes=notes, claims=claims,
                         title="servax vs llama.cpp's servers, same load, same machine",
                         plot=_plot(rows, config.servers))


def peer_ratios(rows: list[dict], rates) -> tuple[list[str], list[dict]]:
    """servax / each peer's output tok/s per rate (notes), and the saturation claim: at the
    highest offered rate, servax >= 1.5x the batching peer (llama-server)."""
    by = {(r["server"], r["rate"]): r["out_tok_s"] for r in rows}
    notes, claims = [], []
    for rate in rates:
        for peer in ("llama-server", "llama.cpp"):
            if ("servax", rate) in by and by.get((peer, rate)):
                ratio = by[("servax", rate)] / by[(peer, rate)]
                notes.append(f"rate {rate}: servax / {peer} output tok/s = {ratio:.2f}x")
                if peer == "llama-server" and rate == max(rates):
                    claims.append({"claim": f"servax / llama-server (batching peer) output "
                                            f"tok/s at saturation ({rate} req/s offered)",
                                   "target": ">= 1.5", "measured": ratio,
                                   "met": ratio >= 1.5})
    return notes, claims


def _plot(rows, servers):
    def draw(fig):
        a, b = fig.subplots(1, 2)
        for name, style in zip(servers, ("o-", "s-", "^-")):
            rs = [r for r in rows if r["server"] == name]
            rates = [r["rate"] for r in rs]
            a.plot(rates, [r["ttft_p50_ms"] for r in rs], style, label=f"{name} TTFT p50")
            a.plot(rates, [r["ttft_p99_ms"] for r in rs], style.replace("-", "--"),
                   label=f"{name} TTFT p99")
            b.plot(rates, [r["out_tok_s"] for r in rs], style, label=name)
        for ax in (a, b):
            ax.set_xscale("log")
            ax.set_xlabel("offered load (req/s)")
            ax.legend(fontsize=7)
        a.set_yscale("log")
        a.set_ylabel("TTFT (ms)")
        b.set_ylabel("output tokens/s")
    return draw


if __name__ == "__main__":
    print(json.dumps(get_config().to_dict(), indent=2, default=str))
