"""Arithmetic-chain task suite: seeded, checkable, step-structured."""
import pytest

from research.core.splits import check_disjoint
from research.specscale.tasks import ArithmeticChains, Problem, parse_problem, problem_key


def test_problems_are_seeded_and_valid():
    t = ArithmeticChains(n_steps=3, start_range=(2, 20), operand_range=(1, 9))
    a, b = t.problems(50, seed=4), t.problems(50, seed=4)
    assert a == b and a != t.problems(50, seed=5)
    for p in a:
        value = p.start
        for op, x in p.ops:
            assert 1 <= x <= 9
            value = value + x if op == "+" else value - x
            assert value >= 0  # never negative at any step
        assert value == p.answer


def test_reference_solution_checks_and_steps_are_correct():
    t = ArithmeticChains()
    for p in t.problems(20, seed=0):
        sol = p.solution()
        assert t.check(p, sol)
        lines = sol.splitlines(keepends=True)
        assert len(lines) == t.n_steps + 1 and t.is_final_line(lines[-1])
        assert all(t.step_is_correct(p, lines, k) for k in range(len(lines)))


def test_checker_rejects_wrong_answers_and_steps():
    t = ArithmeticChains()
    p = Problem(uid=0, start=9, ops=(("+", 5), ("-", 6)))
    assert p.text == "Problem: Start with 9. Add 5. Subtract 6.\n" and p.answer == 8
    assert not t.check(p, "9 + 5 = 14\n14 - 6 = 8\nAnswer: 9\n")
    assert not t.check(p, "no answer here")
    assert t.parse_answer("blah Answer: -3 and Answer: 4") == -3
    wrong_operand = ["9 + 6 = 15\n", "15 - 6 = 9\n", "Answer: 9\n"]
    assert not t.step_is_correct(p, wrong_operand, 0)
    wrong_sum = ["9 + 5 = 13\n"]
    assert not t.step_is_correct(p, wrong_sum, 0)
    assert not t.step_is_correct(p, ["garbage\n"], 0)
    # a correct step after a wrong one is not a correct path
    assert not t.step_is_correct(p, ["9 + 5 = 13\n", "13 - 6 = 7\n"], 1)


def test_prompts_are_shared_and_examples_are_not_test_problems():
    t = ArithmeticChains()
    shared = t.shared_prompt()
    assert shared.count("Problem:") == t.n_shots
    assert t.shared_prompt(verifier=True).count("Problem:") == t.verifier_shots
    assert shared == ArithmeticChains().shared_prompt()
    assert all(p.uid < 0 for p in t.examples(3))


def test_bad_configuration_is_rejected():
    with pytest.raises(ValueError, match="n_steps"):
        ArithmeticChains(n_steps=0)
    with pytest.raises(ValueError, match="operand_range"):
        ArithmeticChains(operand_range=(5, 2))
    with pytest.raises(ValueError, match="n_shots"):
        ArithmeticChains(n_shots=-1)
    with pytest.raises(ValueError, match="n must be"):
        ArithmeticChains().problems(0, seed=0)


def test_dev_and_test_problems_are_disjoint_by_construction():
    # a small problem space: unsplit, the dev seed and the test seed share problems
    t = ArithmeticChains(n_steps=1, start_range=(2, 6), operand_range=(1, 3))
    raw_dev, raw_test = t.problems(30, seed=1000), t.problems(30, seed=0)
    assert set(map(problem_key, raw_dev)) & set(map(problem_key, raw_test))
    dev, test = t.problems(8, seed=1000, split="dev"), t.problems(8, seed=0, split="test")
    assert not set(map(problem_key, dev)) & set(map(problem_key, test))
    check_disjoint(dev, test, what="problems", key=problem_key)
    assert [p.uid for p in test] == list(range(8))
    assert t.problems(8, seed=0, split="test") == test  # seeded
    with pytest.raises(ValueError, match="requested 'test' items"):
        t.problems(500, seed=0, split="test")  # more than the space holds


def test_problem_text_parses_back():
    t = ArithmeticChains(n_steps=4, start_range=(10, 99), operand_range=(10, 99))
    for p in t.problems(10, seed=3):
        assert parse_problem(p.text) == (p.start, p.ops)
    with pytest.raises(ValueError, match="not an arithmetic-chain problem"):
        parse_problem("Problem: Start with x.")


def test_few_shot_examples_are_dev_problems():
    """Examples come from dev by construction: example 1 used to be test problem 155."""
    from research.core.splits import split_of
    from research.specscale.tasks import SPLIT_SALT
    t = ArithmeticChains()
    shots = t.examples(t.verifier_shots)
    assert all(split_of(problem_key(p), SPLIT_SALT) == "dev" for p in shots)
    assert t.examples(t.n_shots) == shots[:t.n_shots]  # the generator's are the verifier's
    assert len(set(map(problem_key, shots))) == len(shots)
    assert [p.uid for p in shots] == [-1 - i for i in range(len(shots))]
    test = t.problems(200, seed=0, split="test")  # specscale_full's test problems
    assert not set(map(problem_key, shots)) & set(map(problem_key, test))
    assert t.examples(0) == []
