"""The SpecScale experiment's method list: defaults, ablation flips, bad names."""
import pytest

from experiments.specscale import experiment as X
from experiments.specscale import specscale as config_module


@pytest.mark.parametrize("arg", ["small", "full"])
def test_methods_are_the_baselines_then_specscale_and_its_ablations(arg):
    c = config_module.get_config(arg)
    cfgs = {m.label: m for m in X.methods(c)}
    assert list(cfgs)[:5] == ["greedy", "single sample", "best-of-8", "beam 2x4",
                              "specscale 2x4"]
    spec = cfgs["specscale 2x4"]
    assert spec.dedup and spec.defer == 1 and spec.reject_below is None
    assert spec.process and spec.process_prune
    # every verifier-guided method uses the process verifier; the single samples do not
    assert cfgs["beam 2x4"].process and cfgs["best-of-8"].process
    assert not cfgs["greedy"].process and not cfgs["single sample"].process
    if arg == "full":
        assert not cfgs["specscale 2x4 -process_prune"].process_prune
        deferred = cfgs["specscale 2x4 +defer"]  # deferral comes with rollback
        assert deferred.defer == 2 and deferred.reject_below is not None
    assert len(cfgs) == 5 + len(c.ablations)
    assert c.warmup_pass and c.split == "test"
    assert config_module.get_config("dev").split == "dev"
    assert c.limits.max_lines == c.task.n_steps + 1


def test_unknown_ablation_is_an_error():
    c = config_module.get_config("small")
    c.ablations = ("+warp",)
    with pytest.raises(ValueError, match="unknown ablation '\\+warp'"):
        X.methods(c)
    with pytest.raises(ValueError, match="'small', 'full' or 'dev'"):
        config_module.get_config("tiny")
