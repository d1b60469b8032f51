"""End to end: greedy == plain greedy token for token; sampled output has the target's
distribution (exact enumeration on a small-vocabulary model); batching, stops, budget."""
import jax
import pytest

from research.decode.generate import generate
from research.decode.sampling import SamplingConfig
from research.specdecode import (DraftLengthPolicy, early_exit, model_drafter, prompt_lookup,
                                 speculative_generate)
from research.specdecode.distribution import chisquare_pvalue, exact_sequence_law
from tests.specdecode.specdecode_helpers import chaotic_model, perturbed

# few branches keep compile time down; 3 exercises a draft longer than some rows' lookups
SMALL = DraftLengthPolicy(draft_lengths=(0, 1, 3))
FIXED = DraftLengthPolicy(draft_lengths=(0, 3), adaptive=False)


@pytest.fixture(scope="module")
def close_drafter(chaotic):
    return model_drafter(perturbed(chaotic, 0.03), name="perturbed")


@pytest.mark.parametrize("which,policy", [pytest.param("lookup", SMALL, marks=pytest.mark.slow),
                                          ("lookup", FIXED),
                                          ("early_exit", FIXED),
                                          pytest.param("close", SMALL, marks=pytest.mark.slow)])
def test_greedy_equals_plain_greedy(chaotic, prompts, close_drafter, which, policy):
    drafter = {"lookup": prompt_lookup(), "early_exit": early_exit(1),
               "close": close_drafter}[which]
    ref = generate(chaotic, prompts, max_new_tokens=40)
    out = speculative_generate(chaotic, prompts, drafter=drafter, max_new_tokens=40,
                               policy=policy)
    assert out.tokens == ref.tokens
    assert out.finish_reasons == ref.finish_reasons
    st = out.stats
    assert sum(st.drafted) > 0
    if which == "close":  # a close draft: accepted often, rejected sometimes
        assert 0.3 < st.acceptance_rate < 1.0
        assert out.tokens_per_forward() > 1.3
    assert sum(st.branch_counts.values()) == st.steps
    assert max(st.active_steps) == st.steps


@pytest.mark.slow  # ~20 s; greedy equality and stop tokens are checked elsewhere
def test_greedy_with_stop_tokens_and_sliding_window(prompts):
    """Stops inside an accepted run end the row there; ring caches get rollback slack."""
    config_model = chaotic_model(n_layers=2, layer_kinds=("sliding", "global"),
                                 sliding_window=8)
    ref = generate(config_model, prompts, max_new_tokens=20)
    # stop on a token that the first row emits mid-way
    stop = ref.tokens[0][10]
    ref = generate(config_model, prompts, max_new_tokens=20, stop_tokens=(stop,))
    out = speculative_generate(config_model, prompts, drafter=model_drafter(
        perturbed(config_model, 0.1)), max_new_tokens=20, stop_tokens=(stop,), policy=FIXED)
    assert out.tokens == ref.tokens and out.finish_reasons == ref.finish_reasons
    assert "stop" in out.finish_reasons


def test_budget_of_one_token_and_input_errors(chaotic, prompts):
    out = speculative_generate(chaotic, prompts, drafter=prompt_lookup(), max_new_tokens=1,
                               policy=FIXED)
    assert out.tokens == generate(chaotic, prompts, max_new_tokens=1).tokens
    assert out.stats.steps == 0
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_generate(chaotic, prompts, drafter=prompt_lookup(), max_new_tokens=0)
    with pytest.raises(ValueError, match="key"):
        speculative_generate(chaotic, prompts, drafter=prompt_lookup(), max_new_tokens=4,
                             sampling=SamplingConfig(temperature=1.0))
    with pytest.raises(TypeError, match="drafter"):
        speculative_generate(chaotic, prompts, drafter="lookup", max_new_tokens=4)
    with pytest.raises(ValueError, match="max_len"):
        speculative_generate(chaotic, prompts, drafter=prompt_lookup(), max_new_tokens=30,
                             max_len=32)
    with pytest.raises(ValueError, match="draft_lengths"):
        DraftLengthPolicy(draft_lengths=(1, 2))
    with pytest.raises(ValueError, match="costs"):
        DraftLengthPolicy(draft_lengths=(0, 2), costs=(1.0,))


# ------------------------------------------------------------ exact sampling distribution
VOCAB = 6


@pytest.mark.parametrize("which,sampling,n_samples", [
    # slow: a separate draft model compiles more; test_verify covers non-one-hot q fast
    pytest.param("close", SamplingConfig(temperature=1.0), 40_000, marks=pytest.mark.slow),
    ("lookup", SamplingConfig(temperature=1.0, top_k=4, top_p=0.95), 20_000),
])
def test_sampling_distribution_is_the_targets(which, sampling, n_samples):
    """Joint law of the first 3 tokens == exact target law (chi-square); the second and
    third come from one verify step with 2 drafts (accept / resample / bonus paths)."""
    model = chaotic_model(scale=1.5, embed_scale=0.1, vocab_size=VOCAB)  # spread-out p
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]  # repetitive: prompt lookup drafts 3, 4, ...
    draft_model = perturbed(model, 0.4)
    drafter = model_drafter(draft_model, name="noisy") if which == "close" else prompt_lookup()
    out = speculative_generate(model, [prompt] * n_samples, drafter=drafter,
                               max_new_tokens=5, key=jax.random.key(7), sampling=sampling,
                               policy=DraftLengthPolicy(draft_lengths=(0, 2), adaptive=False))
    st = out.stats
    assert st.branch_counts[2] >= 1 and 0.05 < st.acceptance_rate < 0.95
    samples = [t[:3] for t in out.tokens]
    assert chisquare_pvalue(samples, exact_sequence_law(model, prompt, sampling, 3)) > 1e-3
    # power check: the same test flags the draft model's own law (which == "close")
    if which == "close":
        draft_law = exact_sequence_law(draft_model, prompt, sampling, 3)
        assert chisquare_pvalue(samples, draft_law) < 1e-6
