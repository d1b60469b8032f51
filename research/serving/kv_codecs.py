"""The KV codec registry: every servable KV codec, registered once by name.

    from research.serving import kv_codecs as registry
    registry.names()                      # ("f32", "bf16", "int8", "tasq-1bit", ...)
    served = kv_codecs.codec_model(model, "int8")
    served = kv_codecs.codec_model(model, "tasq-1bit", calibration=calib)   # calibrated

A codec registers its name, the Transform that installs it in every layer (keeping each
layer's layout: `research.kv.layouts.replace_codecs`), whether that transform needs
calibration data, and whether it pages: a codec with per-sequence state beside its pages
(KIVI's full-precision ring) cannot be served by the engine, whose rows change sequences
every pass. The server's `--kv_codec` choices, the CLI, the codec x layout matrix test,
the README's codec list and every experiment read this table by the same names, so a new
codec is one file (its `KVCodec` and transform) plus one row in `BUILTIN` below
(docs/extending.md walks through one end to end; tests/kv/test_registry.py follows it).
`register(...)` adds a row at run time (tests); a codec registered from a module the
server does not import is not a `--kv_codec` choice, so real codecs are rows of `BUILTIN`.

It lives in research/serving (above research/kv, research/model and the technique
packages, which it names); transforms are built lazily (`make(seed)`), so importing it
imports no technique package.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from research.transforms import CalibrationData, Transform, calibrate_and_apply, identity


@dataclasses.dataclass(frozen=True)
class CodecSpec:
    """name: the `--kv_codec` value. make(seed) -> the Transform installing the codec (a
    codec with knobs an experiment may pin also takes them as keywords: `codec_model`'s
    `options`).
    calibrated: `make(seed)` needs CalibrationData. pages: servable from a shared paged
    pool (no per-sequence state). summary: one line for `--help` and docs.
    window_over: for a codec that is another registered codec under a bfloat16 window,
    (that codec's name, sink, recent): `make` is then that chain, and `served_models`
    reuses the inner codec's calibration when both are built."""

    name: str
    make: Callable[..., Transform]
    calibrated: bool
    pages: bool
    summary: str
    window_over: tuple[str, int, int] | None = None

    def __post_init__(self):
        if not self.name or any(c.isspace() for c in self.name):
            raise ValueError(f"a codec name must be a non-empty word, got {self.name!r}")


_REGISTRY: dict[str, CodecSpec] = {}


def register(spec: CodecSpec, *, replace: bool = False) -> CodecSpec:
    """Add `spec` (a ValueError if its name is taken, unless `replace`)."""
    if not isinstance(spec, CodecSpec):
        raise TypeError(f"register takes a CodecSpec, got {type(spec).__name__}")
    if spec.name in _REGISTRY and not replace:
        raise ValueError(f"KV codec {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    get(name)
    del _REGISTRY[name]


def get(name: str) -> CodecSpec:
    if name not in _REGISTRY:
        raise ValueError(f"unknown KV codec {name!r}; registered: {names()}")
    return _REGISTRY[name]


def names(*, pages: bool | None = None) -> tuple[str, ...]:
    """Registered codec names, in registration order (`pages=True`: the servable ones)."""
    return tuple(n for n, s in _REGISTRY.items() if pages is None or s.pages == pages)


def codec_model(model, name: str, *, calibration: CalibrationData | None = None,
                seed: int = 0, options: dict | None = None):
    """`model` with every layer's KV codec replaced by the registered `name`'s (layouts
    kept). A calibrated codec needs `calibration` (never the text it is scored on).
    `options`: keyword arguments for the codec's factory, for an experiment that pins a
    knob (TaSQ: TaSQConfig fields such as kmeans_iters, max_points); the served codec takes
    none."""
    spec = get(name)
    if spec.calibrated and calibration is None:
        raise ValueError(f"KV codec {name!r} is calibrated: pass calibration= "
                         "(research.transforms.CalibrationData)")
    try:
        transform = spec.make(seed, **(options or {}))
    except TypeError as e:
        raise ValueError(f"KV codec {name!r} does not take options {sorted(options or {})}: "
                         f"{e}") from None
    return calibrate_and_apply(transform, model, calibration if spec.calibrated else None)[0]


def served_models(model, tokenizer, names, *, seed: int = 0, calibration_seqs: int = 16,
                  calibration_len: int = 256) -> dict:
    """{name: served_model(...)} for several codecs, each calibrated once: a windowed codec
    whose inner codec is also named wraps that served model in its window instead of
    calibrating the inner codec again (the same state: same seed, same data)."""
    names = list(dict.fromkeys(names))
    specs = [get(n) for n in names]
    calibration = None
    if any(s.calibrated for s in specs):
        calibration = CalibrationData.from_corpus(tokenizer, calibration_len, calibration_seqs)
    out = {}
    for spec in sorted(specs, key=lambda s: s.window_over is not None):  # inner codecs first
        inner = spec.window_over and out.get(spec.window_over[0])
        if inner is not None:
            from research.kv.layouts import kv_window
            out[spec.name] = kv_window(*spec.window_over[1:]).apply(inner, None)
        else:
            out[spec.name] = codec_model(model, spec.name, seed=seed,
                                         calibration=calibration if spec.calibrated else None)
    return {n: out[n] for n in names}


def served_model(model, tokenizer, name: str, *, seed: int = 0, calibration_seqs: int = 16,
                 calibration_len: int = 256):
    """`codec_model` with a calibrated codec calibrated on the calibration split of the
    embedded corpus (research/data.py), never on text anything is evaluated on: what the
    server, the CLI and the serving benchmarks serve."""
    return served_models(model, tokenizer, [name], seed=seed, calibration_seqs=calibration_seqs,
                         calibration_len=calibration_len)[name]


# -- the built-in codecs: one row each (a new codec is a new row) --------------------------
def _bf16(seed):
    from research.model.precision import kv_cache_dtype
    return kv_cache_dtype("bfloat16")


def _int8(seed):
    from research.kv.quantized import int8_kv
    return int8_kv()


def _int4(seed):
    from research.kv.quantized import int4_kv
    return int4_kv()


def _fp8(per_head):
    def make(seed):
        from research.tasq.baselines import fp8_kv
        return fp8_kv(per_head=per_head)
    return make


def _tasq(key_space, bits=1, key_read="rebuild"):
    # post-RoPE codebooks are fitted at positions drawn over the whole served range
    # (TaSQConfig.calibration_positions), not only the calibration text's 0-255
    positions = "served" if key_space == "post_rope" else "text"

    def make(seed, **options):  # options: TaSQConfig fields (kmeans_iters, max_points, ...)
        from research.tasq import TaSQConfig, tasq
        return tasq(TaSQConfig(**{"bits": bits, "seed": seed, "key_space": key_space,
                                  "calibration_positions": positions, "key_read": key_read,
                                  **options}))
    return make


def _windowed(make_inner, sink: int, recent: int):
    """A codec with a bfloat16 sink + recent window over it (windowed.py)."""
    def make(seed, **options):
        from research.kv.layouts import kv_window
        from research.transforms import chain
        return chain(make_inner(seed, **options), kv_window(sink, recent))
    return make


def _windowed_row(name: str, inner: str, sink: int, recent: int, calibrated: bool,
                  summary: str) -> CodecSpec:
    """The row of registered codec `inner` under a bfloat16 sink + recent window (`inner`
    is looked up when the codec is made, so rows may come in any order)."""
    def make(seed, **options):
        return _windowed(get(inner).make, sink, recent)(seed, **options)
    return CodecSpec(name, make, calibrated, True, summary, window_over=(inner, sink, recent))


def _kivi2(seed, key_group=32):
    from research.tasq.baselines import kivi_kv
    return kivi_kv(bits=2, key_group=key_group)


def _sign(seed):
    from research.tasq.baselines import sign_kv
    return sign_kv(seed=seed)


BUILTIN = (
    CodecSpec("f32", lambda seed: identity(), False, True,
              "float32 K/V as the model computes them"),
    CodecSpec("bf16", _bf16, False, True, "bfloat16 K/V (half the bytes)"),
    CodecSpec("int8", _int8, False, True,
              "int8 per (token, KV head) with a float16 scale (8.25 bits/channel)"),
    CodecSpec("fp8", _fp8(False), True, True,
              "float8 e4m3 with a static scale per layer (vLLM's kv_cache_dtype=fp8; "
              "calibrated amax)"),
    CodecSpec("fp8-head", _fp8(True), True, True,
              "float8 e4m3 with a static scale per KV head (calibrated amax)"),
    CodecSpec("int4", _int4, False, True,
              "4-bit per 32-channel group with a float16 scale (llama.cpp q4_0, "
              "4.5 bits/channel)"),
    CodecSpec("tasq-1bit", _tasq("pre_rope"), True, True,
              "TaSQ 1-bit VQ codes, keys before RoPE (the default; calibrated)"),
    CodecSpec("tasq-1bit-post", _tasq("post_rope"), True, True,
              "TaSQ 1-bit VQ codes, keys after RoPE, codebooks fitted over the served "
              "positions (lookup-table read; calibrated)"),
    CodecSpec("tasq-1bit-rot", _tasq("pre_rope", key_read="rotated_table"), True, True,
              "TaSQ 1-bit VQ codes, keys before RoPE in groups of whole RoPE pairs, scored "
              "through one rotated lookup table per query (no key rebuild; calibrated)"),
    CodecSpec("tasq-2bit", _tasq("pre_rope", bits=2), True, True,
              "TaSQ 2-bit VQ codes, keys before RoPE (calibrated)"),
    _windowed_row("tasq-1bit+w128", "tasq-1bit", 4, 128, True,
                  "tasq-1bit with the first 4 and each query's last 128 tokens read from "
                  "bfloat16 window pages (sink + recent window; calibrated)"),
    _windowed_row("tasq-1bit-post+w128", "tasq-1bit-post", 4, 128, True,
                  "tasq-1bit-post with the same bfloat16 sink + recent window (calibrated)"),
    # KIVI's residual is the window itself (its ring unused); key groups of 16 positions,
    # the serving block (paged blocks hold whole groups; KIVI's paper groups 32)
    CodecSpec("kivi-2bit+w128", _windowed(lambda seed: _kivi2(seed, key_group=16), 4, 128),
              False, True,
              "KIVI 2-bit (keys per channel over 16-position groups, values per token) "
              "with the same bfloat16 sink + recent window, in pages"),
    CodecSpec("sign-1bit", _sign, False, True,
              "QJL-style sign bits of projected keys and of values"),
    CodecSpec("kivi-2bit", _kivi2, False, False,
              "KIVI 2-bit with a full-precision recent ring (per-sequence state: "
              "not servable from shared pages; kivi-2bit+w128 is)"),
)
for _spec in BUILTIN:
    register(_spec)
