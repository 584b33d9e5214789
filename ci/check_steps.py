"""The checks of the checkout itself: ``lint`` (ruff, bash -n) and ``tests`` (the test suite
from the checkout; nothing is installed from it and nothing is compiled)."""

from __future__ import annotations

from ci.layout import BUILD_REQUIREMENTS, DIST, ROOT, TEST_EXTRAS, TORCH_PIN, extras
from ci.step_env import Env


def lint(env: Env) -> None:
    """ruff check and ruff format --check over the repository; bash -n over the shell scripts."""
    env.install("ruff")
    env.run("ruff", "check", ".")
    env.run("ruff", "format", "--check", ".")
    for script in [
        *sorted(ROOT.glob("docker/*.sh")),
        *sorted(ROOT.glob("scripts/*.sh")),
        ROOT / ".ci" / "run",
    ]:
        env.run("bash", "-n", script)


def tests(env: Env) -> None:
    """The test suite from the checkout (GPU tests skip with their reason on a CPU host)."""
    env.install(TORCH_PIN, *extras(*TEST_EXTRAS), "nox", "-r", BUILD_REQUIREMENTS)
    junit = DIST / "junit-tests.xml"
    junit.parent.mkdir(parents=True, exist_ok=True)
    # NOTES: pytest exits 5 when it collects nothing: an empty or mis-pointed suite fails.
    env.run(
        "python",
        "-m",
        "pytest",
        "tests",
        "-ra",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        *env.posargs,
    )
    env.artifact(junit)
