"""SmolLM2 end to end on the paged engine (slow: real model, several compiles)."""
import pytest

from research.decode.generate import generate
from research.specscale import search as S
from research.specscale.engine import PagedEngine
from research.specscale.tasks import ArithmeticChains


# slow: real 135M model; ~1-2 minutes of compiles and forwards on CPU
@pytest.mark.slow
def test_smollm2_engine_and_search(smollm2):
    model, tok = smollm2
    task = ArithmeticChains()
    problem = task.problems(1, seed=0, split="dev")[0]  # never a test problem (issue 45)
    prompt = tok.encode(task.shared_prompt() + task.problem_prompt(problem))
    want = generate(model, [prompt], max_new_tokens=8).tokens[0]
    engine = PagedEngine(model, n_blocks=256, block_size=16, max_len=512, temperature=0.0)
    seq = engine.new_sequence(prompt)
    engine.prefill([seq])
    assert [int(engine.sample([seq])[0][0]) for _ in range(8)] == want
    engine.free(seq)
    ctx = S.SearchContext(engine, tok, task)
    res = S.run_search(ctx, [problem], S.specscale(1, 2, max_lines=4), group_size=1)
    assert task.parse_answer(res.problems[0].text) is not None  # a well-formed answer
    ctx.close()
    assert engine.blocks_in_use == 0
