r"""Dev check for issue 44 item 1: does fitting post-RoPE codebooks over the served
positions repair TaSQ 1-bit post-RoPE at long context?

    python scripts/dev_tasq_calibration_positions.py [--length 4096] [--scored 1024]

Continuation perplexity of SmolLM2-135M-Instruct with each KV codec on windows of the
pydoc *dev* half (no test text: the dev half holds ~6.7k tokens, so one 4,096-token window
by default; the last `--scored` tokens scored given the rest). Rows: bf16, int8, fp8, TaSQ
1-bit pre-RoPE (the default), TaSQ 1-bit post-RoPE with codebooks fitted at the calibration
text's positions (0-255) and over the served range (TaSQConfig.calibration_positions),
TaSQ 1-bit pre-RoPE through the rotated table (pair-aligned groups), and low-bit codecs
with a bfloat16 sink + recent window (research/kv/windowed.py; issue 44 item 3: the
window's size is chosen here, on dev). `--rows` picks rows by number (0-based). Calibration:
the calibration half, 4 x 256 tokens. Prints one line per codec and a JSON object.
"""
import argparse
import json
import time

import numpy as np

from research import data
from research.eval.perplexity import continuation_perplexity
from research.kv.layouts import kv_window
from research.model import load
from research.serving import kv_codecs
from research.transforms import CalibrationData

# (label, registered codec, factory options, full-precision window (sink, recent) or None)
ROWS = [("bf16", "bf16", None, None), ("int8", "int8", None, None), ("fp8", "fp8", None, None),
        ("tasq-1bit (pre-RoPE)", "tasq-1bit", None, None),
        ("tasq-1bit-post, text positions", "tasq-1bit-post", {"calibration_positions": "text"},
         None),
        ("tasq-1bit-post, served positions", "tasq-1bit-post",
         {"calibration_positions": "served"}, None),
        ("tasq-1bit-rot (rotated table)", "tasq-1bit-rot", None, None),
        ("tasq-1bit + sink 4 + w32", "tasq-1bit", None, (4, 32)),
        ("tasq-1bit + sink 4 + w128", "tasq-1bit", None, (4, 128)),
        ("tasq-2bit + sink 4 + w128", "tasq-2bit", None, (4, 128)),
        ("int4 + sink 4 + w128", "int4", None, (4, 128)),
        ("tasq-1bit-post, served positions + sink 4 + w128", "tasq-1bit-post",
         {"calibration_positions": "served"}, (4, 128))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=4096, help="tokens per window")
    parser.add_argument("--scored", type=int, default=1024, help="scored tail per window")
    parser.add_argument("--windows", type=int, default=1)
    parser.add_argument("--rows", default="", help="comma-separated row numbers (all: empty)")
    args = parser.parse_args()
    model, tok = load(None)
    ids = np.asarray(tok.encode(data.corpus_text("dev")), np.int32)
    need = args.windows * args.length
    if len(ids) < need:
        raise SystemExit(f"--windows x --length = {need} tokens, the dev half has {len(ids)}")
    windows = ids[:need].reshape(args.windows, args.length)
    calib = CalibrationData.from_corpus(tok, 256, 4)
    out = {}
    rows = [ROWS[int(i)] for i in args.rows.split(",")] if args.rows else ROWS
    for label, codec, options, window in rows:
        start = time.perf_counter()
        calibration = calib if kv_codecs.get(codec).calibrated else None
        m = kv_codecs.codec_model(model, codec, calibration=calibration, options=options)
        if window is not None:
            m = kv_window(*window).apply(m, ())
        ppl = continuation_perplexity(m, windows, args.length - args.scored, batch_size=1,
                                      chunk=512).ppl
        out[label] = round(float(ppl), 3)
        print(f"{label}: ppl {out[label]} ({time.perf_counter() - start:.0f} s)", flush=True)
    print(json.dumps({"length": args.length, "scored": args.scored, "windows": args.windows,
                      "split": "dev", "ppl": out}))


if __name__ == "__main__":
    main()
