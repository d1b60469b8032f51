r"""Dev check for issue 44's passkey miss: does a codec code the needle's tokens worse than
the filler around them?

    python scripts/dev_passkey_needle_error.py [--codec tasq-1bit] [--length 2048]
        [--prompts 4]

If it did, keeping a codec's worst-coded tokens in bfloat16 (an outlier store beside the
pages) would single out the key's digits cheaply. For each of the first `--prompts` dev
passkey prompts (research/eval/passkey.py on the pydoc *dev* half, the 'plain' template,
seed 0, as experiments/serving/long_context_quality.py builds them), the codec's model runs
the prompt once without a cache; each layer's K and V are coded and rebuilt by the layer's
codec, and every token's relative error ||x - x_hat||^2 / ||x||^2 (summed over KV heads
and channels) is ranked among the prompt's tokens. Printed per prompt and needle token:
the percentile of its error (the fraction of tokens coded better), median over layers,
and in how many layers it is among the worst 1%. Calibration: the calibration half,
16 x 256 tokens (`served_model`). Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json

import jax.numpy as jnp
import numpy as np

from research import data
from research.eval.passkey import passkey_trials
from research.model import forward, load
from research.serving import kv_codecs

DEV_PROMPTS = 10  # the dev passkey runs' prompts (results/dev_passkey_*): their depths


def needle_tokens(tokenizer, ids, key: str) -> list[int]:
    """Indices of the tokens that spell `key`'s first occurrence in the prompt `ids`."""
    pieces = [tokenizer.decode([i], skip_special=False) for i in ids]
    ends = np.cumsum([len(p) for p in pieces])
    start = "".join(pieces).find(key)
    if start < 0:
        raise ValueError(f"key {key!r} is not in the decoded prompt")
    return [i for i, end in enumerate(ends)
            if end > start and end - len(pieces[i]) < start + len(key)]


def error_percentiles(model, ids, needle: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per layer and needle token, the fraction of the prompt's tokens whose K (and V)
    the layer's codec rebuilds with a smaller relative error: ([L, n], [L, n])."""
    tokens = jnp.asarray([list(ids)], jnp.int32)
    positions = jnp.arange(len(ids))[None]
    out = forward(model, tokens, capture=True, logits="none")
    per_layer = []
    for cache, captured in zip(model.caches, out.captures):
        k, v = captured["k"], captured["v"]
        codec = cache.codec
        k_hat, v_hat = codec.decode(codec.encode(k, v, positions), positions)
        ranks = []
        for x, x_hat in ((k, k_hat), (v, v_hat)):
            err = np.asarray(jnp.sum((x - x_hat) ** 2, (2, 3)) / jnp.sum(x ** 2, (2, 3)))[0]
            ranks.append([(err < err[i]).mean() for i in needle])
        per_layer.append(ranks)
    ranks = np.asarray(per_layer)  # [L, 2, n]
    return ranks[:, 0], ranks[:, 1]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--codec", default="tasq-1bit")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--prompts", type=int, default=4)
    args = ap.parse_args(argv)
    if not 1 <= args.prompts <= DEV_PROMPTS:
        ap.error(f"--prompts must be in 1..{DEV_PROMPTS} (the dev prompts the passkey runs "
                 f"score), got {args.prompts}")
    model, tok = load(None)
    served = kv_codecs.served_model(model, tok, args.codec)
    trials = passkey_trials(tok, args.length, DEV_PROMPTS, 0, data.split_text("dev"),
                            template="plain")
    rows = []
    for trial in trials[:args.prompts]:
        needle = needle_tokens(tok, trial.ids, trial.key)
        k_pct, v_pct = error_percentiles(served, trial.ids, needle)
        row = {"depth": round(trial.depth, 3), "key": trial.key,
               "k_percentile_median": np.round(np.median(k_pct, 0), 3).tolist(),
               "k_layers_in_worst_1pct": (k_pct >= 0.99).sum(0).tolist(),
               "v_percentile_median": np.round(np.median(v_pct, 0), 3).tolist(),
               "v_layers_in_worst_1pct": (v_pct >= 0.99).sum(0).tolist()}
        print(row, flush=True)
        rows.append(row)
    print(json.dumps({"codec": args.codec, "length": args.length, "split": "dev",
                      "layers": len(served.caches), "prompts": rows}))


if __name__ == "__main__":
    main()
