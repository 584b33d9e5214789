"""The build-and-validate pipeline of custom-esimd-kernels-vllm (the steps live in ci/pipeline.py).

    nox -s lint tests                                   CPU checks (the README's test command)
    nox -s build -- --target cuda-sm90 [--container]    compile the DSO, write dist/provenance.json
    nox -s wheel verify                                 bdist wheel + SHA256SUMS; clean-venv check
    nox -s image                                        CPU test image; the test suite inside it
    nox -s kernels bench                                GPU host: the wheel through tests/gpu,
                                                        the sanitizers and the benchmark
    nox -s overlay e2e gsm8k                            vLLM overlay, serving E2E, GSM8K gate
    nox -s pipeline [-- --steps a,b]                    the steps in order -> dist/run-record.*

Each session runs one step of ci/pipeline.py, which leaves dist/steps/<step>.json and
dist/logs/<step>.log; the same steps run without nox as ``python3 -m ci.pipeline STEP``.
docs/pipeline.md has the details.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nox

sys.path.insert(0, str(Path(__file__).resolve().parent))  # nox does not put it on sys.path
from ci import pipeline  # noqa: E402

nox.options.sessions = ["lint", "tests"]
nox.options.default_venv_backend = "venv"


def step(session: nox.Session) -> None:
    """Run the pipeline step named like the session in the session's environment."""
    bin_dir = session.bin_paths[0] if session.bin_paths else None
    try:
        pipeline.run_step(session.name, pipeline.STEPS[session.name], bin_dir, session.posargs)
    except pipeline.Skipped as exc:
        session.skip(str(exc))
    except pipeline.Failed as exc:
        session.error(str(exc))


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check + ruff format --check; bash -n over the shell scripts."""
    step(session)


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite, run from the checkout (GPU tests skip with their reason on a CPU host)."""
    step(session)


@nox.session
def build(session: nox.Session) -> None:
    """Compile the DSO for one target: nox -s build -- --target cuda-sm90 [--container]."""
    step(session)


@nox.session
def wheel(session: nox.Session) -> None:
    """bdist wheel of the built DSO, provenance.json inside; dist/SHA256SUMS."""
    step(session)


@nox.session
def verify(session: nox.Session) -> None:
    """The wheel in a clean venv: every SHA256 of its DSO agrees; the CPU suite against it."""
    step(session)


@nox.session
def image(session: nox.Session) -> None:
    """The CPU test image, and the test suite inside it (offline)."""
    step(session)


@nox.session(python=False)
def kernels(session: nox.Session) -> None:
    """GPU host: nox -s kernels -- [--wheel dist/X.whl]; results/gpu-validation.json."""
    step(session)


@nox.session(python=False)
def bench(session: nox.Session) -> None:
    """GPU host: python -m custom_esimd_kernels_vllm.bench [ARGS]."""
    step(session)


@nox.session
def overlay(session: nox.Session) -> None:
    """The vLLM source overlay: nox -s overlay [-- --tree PATH]."""
    step(session)


@nox.session
def e2e(session: nox.Session) -> None:
    """Serve the tiny QSA checkpoint with vLLM and check it (tests/e2e)."""
    step(session)


@nox.session
def gsm8k(session: nox.Session) -> None:
    """The GSM8K gate: mechanics check on CPU, or nox -s gsm8k -- --base-url URL [GATE ARGS]."""
    step(session)


@nox.session(name="pipeline", python=False)
def run_pipeline(session: nox.Session) -> None:
    """Queue the steps in order (a step after a failed one is recorded as not run), then
    `record`: nox -s pipeline -- [--steps lint,tests,...] [--target T] [--container]."""
    try:
        queue = pipeline.start_pipeline(session.posargs)
    except pipeline.Failed as exc:
        session.error(str(exc))
    for name, posargs in queue:
        session.notify(name, posargs)
    session.notify("record", [])


@nox.session(python=False)
def record(session: nox.Session) -> None:
    """dist/run-record.{json,md} from the step records; fails when a step failed."""
    result = pipeline.write_run_record()
    print(pipeline.markdown(result), flush=True)
    session.log("run record: dist/run-record.md and dist/run-record.json")
    if result["result"] == "failed":
        session.error(pipeline.failure_summary(result))
