"""The build-and-validate pipeline of custom-esimd-kernels-vllm (driver: ci/pipeline.py).

    nox -s lint tests                                   CPU checks (the README's test command)
    nox -s build -- --target cuda-sm90 [--container]    compile the DSO, write dist/provenance.json
    nox -s wheel verify                                 bdist wheel + SHA256SUMS; clean-venv check
    nox -s image                                        CPU test image; the test suite inside it
    nox -s kernels bench                                GPU host: the wheel through tests/gpu,
                                                        the sanitizers and the benchmark
    nox -s overlay e2e gsm8k                            vLLM overlay, serving E2E, GSM8K gate
    nox -s pipeline [-- --steps a,b]                    the steps in order -> dist/run-record.*

Each session runs one step through ci/pipeline.py, which leaves dist/steps/<step>.json and
dist/logs/<step>.log; the same steps run without nox as ``python3 -m ci.pipeline STEP``, and
``-- --help`` (or ``STEP --help``) prints a step's arguments without running it.
docs/pipeline.md has the details.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nox

sys.path.insert(0, str(Path(__file__).resolve().parent))  # nox does not put it on sys.path
from ci import pipeline, records  # noqa: E402

nox.options.sessions = ["lint", "tests"]
nox.options.default_venv_backend = "venv"


def session(name: str, *, venv: bool = True):
    """A nox session running the pipeline step ``name`` (in a fresh virtualenv, or with the
    host's interpreter where ``venv`` is False); ``-- --help`` prints the step's arguments."""

    def run(session: nox.Session) -> None:
        bin_dir = session.bin_paths[0] if session.bin_paths else None
        try:
            pipeline.run(name, bin_dir, session.posargs)
        except pipeline.Skipped as exc:
            session.skip(str(exc))
        except pipeline.Failed as exc:
            session.error(str(exc))

    run.__doc__ = pipeline.STEPS[name].summary  # nox -l shows the first line: one line
    return nox.session(name=name, python=None if venv else False)(run)


# The design card, one step per line (ci/pipeline.py lists each step's module).
lint = session("lint")  # ruff check + format --check; bash -n
tests = session("tests")  # the test suite from the checkout
build = session("build")  # -- --target cuda-sm90 [--container]: DSO + provenance.json
wheel = session("wheel")  # bdist wheel with provenance.json inside; SHA256SUMS
verify = session("verify")  # the wheel in a clean venv: every DSO SHA256 agrees
image = session("image")  # the CPU test image, the suite inside it (offline)
kernels = session("kernels", venv=False)  # GPU host: -- [--wheel W]; validation record
bench = session("bench", venv=False)  # GPU host: the benchmark
overlay = session("overlay")  # the vLLM source overlay [-- --tree PATH]
e2e = session("e2e")  # serve the tiny Qwen4Exp checkpoints with vLLM, tests/e2e
gsm8k = session("gsm8k")  # GSM8K gate: mechanics on CPU, or -- --base-url URL


@nox.session(name="pipeline", python=False)
def run_pipeline(session: nox.Session) -> None:
    """Queue the steps in order, then `record`; -- [--steps a,b] [--target T] [--container].

    A step after a failed one is recorded as not run; `-- --help` prints the usage only.
    """
    try:
        queue = pipeline.start_pipeline(session.posargs)
    except pipeline.Failed as exc:
        session.error(str(exc))
    if queue is None:  # --help
        return
    for name, posargs in queue:
        session.notify(name, posargs)
    session.notify("record", [])


@nox.session(python=False)
def record(session: nox.Session) -> None:
    """dist/run-record.{json,md} from the step records; fails when a step failed."""
    if pipeline.wants_help(session.posargs):
        print("usage: nox -s record\n\n" + (record.__doc__ or ""), flush=True)
        return
    result = pipeline.write_run_record()
    print(records.markdown(result), flush=True)
    session.log("run record: dist/run-record.md and dist/run-record.json")
    if result["result"] == "failed":
        session.error(records.failure_summary(result))
