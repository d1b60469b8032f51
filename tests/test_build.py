"""BUILD is generated from the tree; a stale BUILD (new module or test not listed) fails."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_build_file_is_current():
    sys.path.insert(0, str(ROOT / "scripts"))
    import gen_build
    assert (ROOT / "BUILD").read_text() == gen_build.render(ROOT), (
        "BUILD is stale: run `python scripts/gen_build.py`")


def test_library_targets_form_a_dag():
    sys.path.insert(0, str(ROOT / "scripts"))
    import gen_build
    assert gen_build.find_cycle(gen_build.library_graph(ROOT)) is None
    assert gen_build.find_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]


def test_every_package_and_test_has_a_target():
    build = (ROOT / "BUILD").read_text()
    for init in ROOT.glob("research/**/__init__.py"):
        name = "_".join(init.parent.relative_to(ROOT).parts)
        assert f'name = "{name}"' in build
    for t in ROOT.glob("tests/**/test_*.py"):
        assert f'args = ["{t.relative_to(ROOT)}"]' in build


def test_check_mode_exit_code():
    proc = subprocess.run([sys.executable, "scripts/gen_build.py", "--check"], cwd=ROOT)
    assert proc.returncode == 0
