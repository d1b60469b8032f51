"""Verifier scores are the model's likelihoods (checked against a cache-free forward);
metrics give honest intervals."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from research.model import forward
from research.specscale.engine import PagedEngine
from research.specscale.metrics import paired_bootstrap_diff, wilson_interval
from research.specscale.verifier import LikelihoodVerifier, step_auroc
from research.specscale.tasks import ArithmeticChains


def test_line_scores_are_mean_log_likelihoods(char_model, char_tokenizer):
    task = ArithmeticChains(verifier_shots=1)
    engine = PagedEngine(char_model, n_blocks=200, block_size=8, max_len=512)
    ver = LikelihoodVerifier(engine, char_tokenizer, task)
    problem = task.problems(1, seed=0)[0]
    seq = ver.start_problems([problem])[0]
    lines = [char_tokenizer.encode("8 - 7 = 1\n"), char_tokenizer.encode("1 + 9 = 10\n")]
    got = ver.score_lines([seq], [lines])[0]
    context = char_tokenizer.encode(task.shared_prompt(verifier=True) + problem.text)
    full = context + lines[0] + lines[1]
    logp = np.asarray(jax.nn.log_softmax(forward(char_model, jnp.asarray([full])).logits))[0]
    per_tok = [logp[i - 1, full[i]] for i in range(len(context), len(full))]
    want = [np.mean(per_tok[:len(lines[0])]), np.mean(per_tok[len(lines[0]):])]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert ver.stats.calls == 2 and ver.stats.forward_calls == 1
    ver.truncate_lines(seq, lines, 1)  # roll back the second line
    again = ver.score_lines([seq], [[lines[1]]])[0]
    np.testing.assert_allclose(again, want[1:], rtol=1e-4, atol=1e-4)


def test_wilson_and_bootstrap():
    lo, hi = wilson_interval(12, 24)
    assert lo < 0.5 < hi and 0.3 < lo and hi < 0.7
    assert wilson_interval(0, 10)[0] == 0.0
    with pytest.raises(ValueError):
        wilson_interval(3, 2)
    d, lo, hi = paired_bootstrap_diff([1, 1, 0, 1], [1, 0, 0, 1])
    assert d == pytest.approx(0.25) and lo <= d <= hi
    with pytest.raises(ValueError):
        paired_bootstrap_diff([1, 0], [1])


def test_step_auroc():
    assert step_auroc([3, 2, 1, 0], [True, True, False, False]) == 1.0
    assert step_auroc([0, 1], [True, False]) == 0.0
    assert np.isnan(step_auroc([1, 2], [True, True]))


def test_process_verifier_checks_each_line_exactly():
    from research.specscale.tasks import ArithmeticChains, Problem
    from research.specscale.verifier import ProcessVerifier
    t = ArithmeticChains()
    v = ProcessVerifier(t)
    p = Problem(uid=0, start=47, ops=(("+", 38), ("-", 29)))
    assert v.check(p, ["47 + 38 = 85\n", "85 - 29 = 56\n", "Answer: 56\n"]) == [True] * 3
    assert v.check(p, ["47 + 38 = 85", "85 - 29 = 56", "Answer: 56"], first=2) == [True]
    assert v.check(p, ["47 + 38 = 75\n", "75 - 29 = 46\n"]) == [False, False]  # carry
    assert v.check(p, ["47 + 39 = 86\n"]) == [False]  # wrong operand
    assert v.check(p, ["47 + 38 = 85\n", "84 - 29 = 55\n"]) == [True, False]  # wrong a
    assert v.check(p, ["47 + 38 = 85\n", "Answer: 85\n"]) == [True, False]  # too early
    assert v.check(p, ["47 + 38 = 85\n", "85 - 29 = 56\n", "Answer: 57\n"])[-1] is False
    assert v.check(p, ["garbage\n"]) == [False]
    assert v.stats.calls == 3 + 1 + 2 + 1 + 2 + 2 + 3 + 1
    assert v.stats.forward_calls == 0 and v.stats.tokens == 0  # no model call
    with pytest.raises(ValueError, match="first must be in"):
        v.check(p, ["x"], first=2)
    # it agrees with the task's ground-truth checker on sampled-looking paths
    for q in ArithmeticChains(n_steps=3, start_range=(10, 99),
                              operand_range=(10, 99)).problems(20, seed=1):
        lines = q.solution().splitlines()
        lines[1] = lines[1].replace("=", "= 1")
        assert v.check(q, lines) == [t.step_is_correct(q, lines, k)
                                     for k in range(len(lines))]
