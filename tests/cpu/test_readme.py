"""The README's claims hold (the front door must not rot).

Convention for the README's ``bash`` code blocks: every command is either run by CI (verbatim
in .ci/run, a nox session of the pipeline CI runs, or exactly what ci/vllm_server.py serves in
``nox -s e2e``) or ends with a ``# GPU host`` comment.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CI_RUN = ROOT / ".ci" / "run"
# The sessions CI runs: the pipeline's steps (ci/pipeline.py PIPELINE), image, the two entries.
CI_SESSIONS = {"lint", "tests", "build", "wheel", "verify", "kernels", "bench", "overlay", "e2e",
               "gsm8k", "image", "pipeline"}  # fmt: skip


def readme() -> str:
    return README.read_text(encoding="utf-8")


def bash_commands() -> list[tuple[str, str]]:
    """(command, trailing comment) of every command line in the README's bash blocks."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", readme(), re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            command, _, comment = line.partition("  #")
            commands.append((command.strip(), comment.strip()))
    return commands


def test_readme_usage_example_runs(capsys):
    match = re.search(r"## Use\n\n```python\n(.*?)```", readme(), re.S)
    assert match, "README.md lost its '## Use' python example"
    exec(compile(match.group(1), "README.md:Use", "exec"), {})
    printed = capsys.readouterr().out
    assert "CPU tensors:" in printed and "CUDA tensors:" in printed


def test_ci_runs_the_readme_set_up_commands_verbatim():
    text = readme()
    ci = CI_RUN.read_text(encoding="utf-8")
    for marker in ("# the tests\n", "# kernels, bench, overlay, e2e, gsm8k), run record in dist/run-record.{json,md}\n"):  # fmt: skip
        match = re.search(re.escape(marker) + r"(.+)\n", text)
        assert match, f"README.md lost the command after {marker.strip()!r}"
        command = match.group(1).strip()
        assert command.startswith("python3 -m pip install nox && python3 -m nox -s ")
        assert f"'{command}'" in ci, f".ci/run does not run the README's command {command!r}"


def _vllm_server():
    spec = importlib.util.spec_from_file_location("qsa_vllm_server", ROOT / "ci" / "vllm_server.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_by_ci(command: str) -> bool:
    if command in CI_RUN.read_text(encoding="utf-8"):
        return True
    argv = shlex.split(command)
    if argv[:4] == ["python3", "-m", "nox", "-s"]:
        sessions = argv[4 : argv.index("--")] if "--" in argv else argv[4:]
        return bool(sessions) and set(sessions) <= CI_SESSIONS
    if argv[:2] == ["python", "ci/make_tiny_qwen4exp.py"]:
        # nox -s e2e makes its checkpoints with the function behind this command line.
        tiny = (ROOT / "ci" / "make_tiny_qwen4exp.py").read_text()
        e2e = "".join(p.read_text() for p in (ROOT / "tests" / "e2e").glob("*.py"))
        return "def make_checkpoint" in tiny and "__main__" in tiny and "make_checkpoint" in e2e
    env = dict(a.split("=", 1) for a in argv if re.fullmatch(r"[A-Z_]+=\S*", a))
    rest = [a for a in argv if not re.fullmatch(r"[A-Z_]+=\S*", a)]
    if rest[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]:
        # What ci/vllm_server.py serves in nox -s e2e: the same settings and flags.
        server = _vllm_server()
        flags = rest[3:]
        del flags[flags.index("--model") : flags.index("--model") + 2]
        same_env = all(server.DEFAULT_ENV.get(k) == v for k, v in env.items())
        return same_env and options(flags) <= options(server.DEFAULT_ARGS)
    return False


def options(argv) -> set[tuple[str, str | None]]:
    """``--flag [value]`` pairs of a command line."""
    argv = list(argv)
    return {
        (a, argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None)
        for i, a in enumerate(argv)
        if a.startswith("--")
    }


def test_every_readme_command_is_run_by_ci_or_marked_gpu_host():
    commands = bash_commands()
    assert len(commands) >= 10, commands
    unchecked = [c for c, comment in commands if "GPU host" not in comment and not run_by_ci(c)]
    assert unchecked == [], (
        f"README commands neither run by CI nor marked '# GPU host': {unchecked}"
    )


def test_the_cpu_serving_command_sets_the_kv_cache_size():
    serve = [c for c, _ in bash_commands() if "vllm.entrypoints.openai.api_server" in c]
    assert serve and all("VLLM_CPU_KVCACHE_SPACE=" in c for c in serve), serve


@pytest.mark.skipif(
    not (ROOT / ".git").exists(),
    reason="needs the checkout's git index (an exported tree, as in the test image, has none)",
)
def test_readme_layout_matches_the_tree():
    match = re.search(r"## Layout\n\n```\n(.*?)```", readme(), re.S)
    assert match, "README.md lost its layout block"
    layout = match.group(1)
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    top = {t.split("/")[0] for t in tracked if not t.startswith(".")}
    expected = {t for t in top if "." not in t or t.endswith(".py")}
    missing = sorted(t for t in expected if not re.search(rf"(^|\s|\{{){re.escape(t)}", layout))
    assert missing == [], f"the README's layout omits {missing}"
    for token in re.findall(r"[\w.{},*-]*/[\w.{},*/-]*|[\w-]+\.(?:py|sh)\b", layout):
        brace = re.search(r"\{(.*?)\}", token)
        names = (
            [token[: brace.start()] + o + token[brace.end() :] for o in brace.group(1).split(",")]
            if brace
            else [token]
        )
        for name in names:
            assert list(ROOT.glob(name.rstrip("/"))), f"the README's layout names {name}: missing"
