"""KV handoff between two processes: a prefill process sends a prompt's cache to a decode
process over a TCP socket (loopback on one machine), which decodes from it.

    python -m research.dynacore.handoff --port 0 [--gguf PATH] [--tiny]   # decode server

Wire format (one message = 8-byte big-endian length + a pickle, protocol 5): the prefix is
{"length": P, "max_len", "first_logits": [B, V] f32, "records": [per layer {name: array
[B, P, ...]}]} -- only the first P slots of each dense-layout record (f32 K/V, or TaSQ's
1-bit codes). The decode side writes them into its own cache, decodes greedily with
`generate.decode_loop` and answers {"tokens": [B, n]} (max_new_tokens 0: no decoding).
It acknowledges each prefix the moment it is deserialized and on its device ("ack"), so
the sender's send-to-ack time is the transfer (serialize + socket + deserialize +
device_put); decoding is not in it.
A TaSQ model's codebooks are sent once ("setup": the transform state), not per request.
"""
from __future__ import annotations

import argparse
import pickle
import socket
import struct as _struct
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from research.model.llama import Model

_LEN = _struct.Struct(">Q")


def send_msg(sock: socket.socket, obj) -> int:
    """Send one message; returns the bytes put on the wire (length prefix included)."""
    data = pickle.dumps(obj, protocol=5)
    sock.sendall(_LEN.pack(len(data)) + data)
    return len(data) + _LEN.size


def recv_msg(sock: socket.socket):
    head = _recv_exact(sock, _LEN.size)
    return pickle.loads(_recv_exact(sock, _LEN.unpack(head)[0]))


def _recv_exact(sock, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
        got += k
    return bytes(buf)


def prefix_records(cache_states: tuple, length: int) -> list[dict]:
    """The first `length` slots of every dense-layout record, as host arrays."""
    out = []
    for i, state in enumerate(cache_states):
        if not isinstance(state, dict):
            raise TypeError(f"layer {i}: KV handoff needs dense-layout cache states (a dict "
                            f"of [B, max_len, ...] records), got {type(state).__name__}")
        out.append({name: np.asarray(buf[:, :length]) for name, buf in state.items()})
    return out


def insert_records(model: Model, records: list[dict], batch: int, max_len: int) -> tuple:
    """A fresh cache of `model` with `records` written into its first slots."""
    states = model.init_cache(batch, max_len)
    if len(records) != len(states):
        raise ValueError(f"prefix has {len(records)} layers, the model {len(states)}")
    out = []
    for i, (state, rec) in enumerate(zip(states, records)):
        if set(rec) != set(state):
            raise ValueError(f"layer {i}: prefix records {sorted(rec)} do not match the "
                             f"cache's {sorted(state)} (a different codec?)")
        new = {}
        for name, buf in state.items():
            r = jnp.asarray(rec[name], buf.dtype)
            if r.shape[0] != buf.shape[0] or r.shape[2:] != buf.shape[2:]:
                raise ValueError(f"layer {i} record {name}: {r.shape} does not fit the "
                                 f"cache's {buf.shape}")
            new[name] = buf.at[:, :r.shape[1]].set(r)
        out.append(new)
    return tuple(out)


def prefix_nbytes(records: list[dict]) -> int:
    return sum(int(a.nbytes) for rec in records for a in rec.values())


def serve(model: Model, sock: socket.socket) -> None:
    """The decode side: answer requests until "bye" (one connection)."""
    from research.decode.generate import decode_loop
    from research.decode.sampling import SamplingConfig
    while True:
        msg = recv_msg(sock)
        kind = msg["kind"]
        if kind == "bye":
            return
        if kind == "setup":  # e.g. TaSQ's codebooks: a transform applied once per model
            import importlib
            module, name = msg["factory"].split(":")
            transform = getattr(importlib.import_module(module), name)(*msg["args"])
            model = transform.apply(model, msg["state"])
            send_msg(sock, {"kind": "ok"})
            continue
        lengths = jnp.asarray(msg["lengths"], jnp.int32)
        states = insert_records(model, msg["records"], len(msg["lengths"]), msg["max_len"])
        logits = jnp.asarray(msg["first_logits"])
        jax.block_until_ready((states, logits))
        send_msg(sock, {"kind": "ack"})
        if msg["max_new_tokens"] == 0:  # transfer only
            send_msg(sock, {"kind": "tokens", "tokens": None})
            continue
        out = decode_loop(model.decode_model, logits, lengths, states, jax.random.key(0),
                          max_new_tokens=msg["max_new_tokens"], sampling=SamplingConfig(),
                          stop_tokens=())
        send_msg(sock, {"kind": "tokens", "tokens": np.asarray(out.tokens)})


class DecodeProcess:
    """A decode server in a child process (`python -m research.dynacore.handoff`)."""

    def __init__(self, gguf: str | None = None, tiny_seed: int | None = None,
                 timeout_s: float = 600):
        args = [sys.executable, "-m", "research.dynacore.handoff"]
        if gguf:
            args += ["--gguf", gguf]
        if tiny_seed is not None:
            args += ["--tiny", str(tiny_seed)]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            self.proc.kill()
            raise RuntimeError(f"decode process did not start (said {line!r})")
        self.sock = socket.create_connection(("127.0.0.1", int(line.split()[1])),
                                             timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def setup(self, factory: str, args: tuple, state) -> None:
        """Apply `module:function(*args)`'s transform with `state` on the decode side (sent
        once: transforms are closures, so the factory and its arguments travel)."""
        send_msg(self.sock, {"kind": "setup", "factory": factory, "args": args,
                             "state": jax.tree.map(np.asarray, state)})
        if recv_msg(self.sock)["kind"] != "ok":
            raise RuntimeError("decode process refused the setup")

    def handoff(self, first_logits, lengths, cache_states, max_len: int,
                max_new_tokens: int) -> dict:
        """Send a prefilled prompt; returns {"tokens", "wire_bytes", "kv_bytes",
        "transfer_s"} (transfer = serialize + send + receive + device_put, to the ack).
        max_new_tokens=0: transfer only, no decoding (tokens None)."""
        length = int(np.max(np.asarray(lengths)))
        records = prefix_records(cache_states, length)
        t0 = time.perf_counter()
        wire = send_msg(self.sock, {"kind": "prefix", "lengths": np.asarray(lengths),
                                    "max_len": max_len,
                                    "first_logits": np.asarray(first_logits),
                                    "records": records, "max_new_tokens": max_new_tokens})
        if recv_msg(self.sock)["kind"] != "ack":
            raise RuntimeError("decode process did not acknowledge the prefix")
        transfer = time.perf_counter() - t0
        tokens = recv_msg(self.sock)["tokens"]
        return {"tokens": tokens, "wire_bytes": wire, "kv_bytes": prefix_nbytes(records),
                "transfer_s": transfer}

    def close(self) -> None:
        try:
            send_msg(self.sock, {"kind": "bye"})
            self.sock.close()
            self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--tiny", type=int, default=None, help="random tiny model (tests)")
    a = ap.parse_args()
    if a.tiny is not None:
        from research.model import init_params, make_model, tiny_config
        config = tiny_config()
        model = make_model(config, init_params(config, jax.random.key(a.tiny)))
    else:
        from research.model import load
        model, _ = load(a.gguf or None)
    srv = socket.create_server(("127.0.0.1", 0))
    print(f"PORT {srv.getsockname()[1]}", flush=True)
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        serve(model, conn)


if __name__ == "__main__":
    _main()
