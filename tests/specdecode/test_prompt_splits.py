"""Spec decoding's prompts: disjoint dev/test splits, every prompt run by a config."""
import pytest

from experiments.specdecode import prompts as P
from experiments.specdecode import specdecode as config_module
from research.core.splits import SplitOverlapError, Splits


def test_dev_and_test_prompts_are_disjoint_and_all_are_run():
    assert not set(P.SPLITS.dev) & set(P.SPLITS.test)
    every = {v for name, v in vars(P).items() if name.isupper() and isinstance(v, tuple)
             and v and isinstance(v[0], tuple) and isinstance(v[0][0], str)}
    listed = {p for group in every for p in group}
    run = set()
    for arg in ("dev", "small", "full"):
        c = config_module.get_config(arg)
        sets = [c.test_prompts] if c.split == "dev" else list(P.TEST_PROMPTS)
        for test_prompts in sets:  # each config with each --config.test_prompts
            for group in P.split_prompts(c.split, test_prompts):
                run |= set(group)
    assert listed == run  # no prompt in prompts.py is left unrun (the code edit included)
    assert any("docstring" in text for text, _ in P.SPLITS.test)
    with pytest.raises(SplitOverlapError):
        Splits("prompts", dev=P.REPETITIVE[:1], test=P.REPETITIVE)


def test_policy_is_a_grid_entry_chosen_on_dev():
    dev = config_module.get_config("dev")
    assert dev.split == "dev" and len(dev.policy_grid) >= 2
    assert config_module.POLICY in [dict(g) for g in config_module.POLICY_GRID]
    assert config_module.get_config("small").policy.to_dict() == config_module.POLICY
