"""The real model: speculative greedy output == plain greedy output token for token."""
import pytest

from research.decode.generate import default_stop_tokens, generate
from research.specdecode import DraftLengthPolicy, early_exit, prompt_lookup, speculative_generate

TEXT = ("The cat sat on the warm windowsill every afternoon, watching the birds in the "
        "garden. When the sun moved behind the old oak tree, the cat would stretch.")


def _ids(tok, texts):
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]))
            for t in texts]


@pytest.mark.slow  # ~30 s on SmolLM2; test_generate checks greedy equality on the tiny model
def test_prompt_lookup_greedy_matches_plain_on_smollm2(smollm2):
    """A batch of a repetitive and a free-form prompt; rows accept different amounts."""
    model, tok = smollm2
    ids = _ids(tok, ["Repeat the following text exactly:\n\n" + TEXT, "Why is the sky blue?"])
    stops = default_stop_tokens(tok)
    ref = generate(model, ids, max_new_tokens=16, stop_tokens=stops)
    out = speculative_generate(model, ids, drafter=prompt_lookup(), max_new_tokens=16,
                               stop_tokens=stops, policy=DraftLengthPolicy(draft_lengths=(0, 4)))
    assert out.tokens == ref.tokens and out.finish_reasons == ref.finish_reasons
    accepted = out.stats.accepted
    assert accepted[0] > 8  # the repeating row copies from its prompt
    assert accepted[0] > accepted[1]


@pytest.mark.slow  # several prompts, 96 tokens, two drafters: a few minutes on 2 cores
def test_greedy_matches_plain_on_smollm2_more_prompts(smollm2):
    model, tok = smollm2
    ids = _ids(tok, ["Repeat the following text exactly:\n\n" + TEXT,
                     "Write a short story about a robot who learns to paint.",
                     "Explain how a rainbow forms.",
                     "Copy this sentence and add one more: " + TEXT])
    stops = default_stop_tokens(tok)
    ref = generate(model, ids, max_new_tokens=96, stop_tokens=stops)
    for drafter in [prompt_lookup(), early_exit(12)]:
        out = speculative_generate(model, ids, drafter=drafter, max_new_tokens=96,
                                   stop_tokens=stops)
        assert out.tokens == ref.tokens, drafter.name
