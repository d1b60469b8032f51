"""scripts/dev_passkey_needle_error.py: the needle's tokens are found in a real passkey
prompt, and the error ranks are fractions of the prompt's tokens, per layer."""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import dev_passkey_needle_error as needle_error  # noqa: E402
from experiments import common  # noqa: E402
from research import data  # noqa: E402
from research.eval.passkey import passkey_trials  # noqa: E402
from research.serving import kv_codecs  # noqa: E402


def test_needle_tokens_spell_the_key():
    tok = common.tokenizer_only(None)
    for trial in passkey_trials(tok, 300, 3, 0, data.split_text("dev"), template="plain"):
        needle = needle_error.needle_tokens(tok, trial.ids, trial.key)
        assert needle == list(range(needle[0], needle[-1] + 1))  # one contiguous run
        assert trial.key in tok.decode([trial.ids[i] for i in needle])
    with pytest.raises(ValueError, match="is not in the decoded prompt"):
        needle_error.needle_tokens(tok, trial.ids, "x9x9x")


def test_error_percentiles_rank_each_layers_tokens(tiny):
    int8 = kv_codecs.codec_model(tiny, "int8")
    ids = list(np.random.default_rng(0).integers(0, tiny.config.vocab_size, 24))
    k_pct, v_pct = needle_error.error_percentiles(int8, ids, [3, 10])
    assert k_pct.shape == v_pct.shape == (tiny.config.n_layers, 2)
    assert np.all((k_pct >= 0) & (k_pct < 1)) and np.all((v_pct >= 0) & (v_pct < 1))
    # a lossless codec ranks nobody worse: every error is 0
    exact, _ = needle_error.error_percentiles(kv_codecs.codec_model(tiny, "f32"), ids, [3])
    assert np.all(exact == 0)


def test_prompts_out_of_range_is_refused_by_name():
    with pytest.raises(SystemExit):
        needle_error.main(["--prompts", "11"])
