"""The README's quickstart runs as written: its curl call and its OpenAI-client snippet,
parsed out of README.md, against a real uvicorn server on 127.0.0.1.

The server is the real one (`research/serving/server.py`: `build_engine`, `create_app`,
uvicorn) serving under the README's model name, the README's port replaced by the test
server's. By default it serves a tiny random-weight Llama with SmolLM2's real tokenizer
and chat template, so the test takes seconds; the slow variant serves SmolLM2 itself and
checks that the answer names Paris. Also checked: the flags the README passes to the
CLI and the server exist, and the model name it tells clients to send is the server's.
"""
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import pytest

openai = pytest.importorskip("openai")

from research.model import init_params, make_model, tiny_config  # noqa: E402
from research.serving.engine_loop import EngineLoop  # noqa: E402
from research.serving.server import ServerThread, build_engine, create_app  # noqa: E402
from research.serving.state import ServerConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
README_URL = "http://127.0.0.1:8000"


def code_blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README, re.S | re.M)


def shell_commands() -> list[list[str]]:
    """Every command of the README's bash blocks as argv: continuation lines joined, a
    quoted argument may span lines, comments cut."""
    out = []
    for block in code_blocks("bash"):
        buf = ""
        for line in re.sub(r"\\\n\s*", " ", block).splitlines(keepends=True):
            buf += line
            try:
                argv = shlex.split(buf, comments=True)
            except ValueError:  # an open quote: the command goes on
                continue
            if argv:
                out.append(argv)
            buf = ""
        assert not buf.strip(), f"unbalanced quotes in README.md: {buf!r}"
    return out


def readme_curl() -> list[str]:
    curls = [argv for argv in shell_commands() if argv and argv[0] == "curl"]
    assert len(curls) == 1, f"expected one curl command in README.md, found {len(curls)}"
    return curls[0]


def readme_client_snippet() -> str:
    snippets = [b for b in code_blocks("python") if "OpenAI(" in b]
    assert len(snippets) == 1, "expected one OpenAI-client snippet in README.md"
    return snippets[0]


def module_flags(module: str) -> list[list[str]]:
    """The --flags of each README command that runs `python -m <module>`."""
    runs = [argv for argv in shell_commands() if argv[:3] == ["python", "-m", module]]
    assert runs, f"README.md shows no `python -m {module}` command"
    return [[a[2:].split("=", 1)[0] for a in argv[3:] if a.startswith("--")] for argv in runs]


def defined_flags(path: str) -> set[str]:
    return set(re.findall(r"DEFINE_\w+\(\s*\"(\w+)\"", (ROOT / path).read_text()))


def test_readme_flags_exist():
    for module, path in (("research.serving.cli", "research/serving/cli.py"),
                         ("research.serving.server", "research/serving/server.py")):
        names = defined_flags(path)
        assert {"prompt", "port"} & names, path
        for used in module_flags(module):
            for name in used:
                base = name[2:] if name.startswith("no") and name[2:] in names else name
                assert base in names, f"README passes --{name} to {module}, which lacks it"
    # every flag the "Try it" section names belongs to the CLI or the server
    both = defined_flags("research/serving/cli.py") | defined_flags("research/serving/server.py")
    section = README[README.index("## Try it"):README.index("## Results")]
    harness = [b for b in code_blocks("bash") if "lm_eval" in b]
    for block in harness:  # lm-eval's own flags: checked against its `run --help` below
        section = section.replace(block, "")
    for name in set(re.findall(r"--(\w+)", section)):
        assert name in both or name.startswith("no") and name[2:] in both, f"--{name}"
    assert len(harness) == 1, "expected one lm_eval command in README.md"
    lm_eval = shutil.which("lm_eval") or str(Path(sys.executable).parent / "lm_eval")
    help_text = subprocess.run([lm_eval, "run", "--help"], capture_output=True, text=True,
                               timeout=300).stdout
    for name in set(re.findall(r"--(\w+)", harness[0])):
        assert f"--{name}" in help_text, f"README passes --{name} to lm_eval, which lacks it"
    name = ServerConfig().model_name
    assert name == "SmolLM2-135M-Instruct"
    assert f'"model": "{name}"' in " ".join(readme_curl())
    assert f'model="{name}"' in readme_client_snippet()


@pytest.fixture(scope="module", params=["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def server(request, smollm2):
    """The real server on 127.0.0.1 under the default model name. "tiny": a random-weight
    Llama with SmolLM2's tokenizer (seconds); "smollm2": the real model (slow: its warm-up
    alone takes 10-20 s on a loaded 2-core machine), whose answer is checked too."""
    model, tok = smollm2
    if request.param == "tiny":
        config = tiny_config(vocab_size=tok.vocab_size, max_position=512, dim=64, ffn_dim=128)
        model = make_model(config, init_params(config, jax.random.key(0)))
    engine = build_engine(model, tok, kv_codec="f32", n_blocks=16, block_size=16,
                          max_batch=1, max_len=96, max_queue=4, token_budget=32,
                          prefill_chunk=32)
    loop = EngineLoop(engine).start()
    app = create_app(loop, tok, ServerConfig(max_context=96))  # the default model name
    with ServerThread(app) as srv:
        srv.real = request.param == "smollm2"
        yield srv
    loop.stop()


def _check_chat_completion(srv, body: dict) -> None:
    assert body["object"] == "chat.completion" and body["model"] == "SmolLM2-135M-Instruct"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] >= 1 and body["usage"]["prompt_tokens"] > 0
    if srv.real:  # the README asks for the capital of France
        assert "Paris" in choice["message"]["content"], choice


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_readme_curl_call(server):
    argv = [a.replace(README_URL, server.url) for a in readme_curl()]
    assert any(server.url in a for a in argv), "the README's curl call is not to " + README_URL
    proc = subprocess.run([*argv, "-w", "\n%{http_code}"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    body, status = proc.stdout.rsplit("\n", 1)
    assert status == "200", proc.stdout
    _check_chat_completion(server, json.loads(body))


def test_readme_openai_client_snippet(server, capsys):
    code = readme_client_snippet()
    assert README_URL in code
    namespace: dict = {}
    exec(compile(code.replace(README_URL, server.url), "README.md", "exec"), namespace)
    reply = namespace["reply"]
    _check_chat_completion(server, reply.model_dump())
    assert capsys.readouterr().out == reply.choices[0].message.content + "\n"


def test_other_model_names_are_404(server):  # what the README warns of
    import httpx
    body = {"model": "gpt-4", "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 404, r.text
