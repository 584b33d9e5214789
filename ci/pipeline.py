"""The build-and-validate pipeline's driver: which steps there are, their order, their help,
and the command line; noxfile.py's sessions call it.

    python3 -m nox -s pipeline                      every step in order, dist/run-record.{json,md}
    python3 -m ci.pipeline STEP [ARGS]              one step without nox, in this interpreter
    python3 -m ci.pipeline STEP --help              the step's arguments (runs nothing)
    python3 -m ci.pipeline kernels --wheel dist/X.whl   the GPU host's validation (no nox needed)

The modules point one way, each importing only those listed before it:

    ci/layout.py        paths, pins, pyproject's requirements, the provenance module
    ci/step_env.py      Env (a step's commands, log, artifacts), Skipped, Failed, the pip source
    ci/wheels.py        the wheel: members, install unrebuilt, the loaded DSO's provenance
    ci/native_build.py  the native build of the DSO and its manifest
    ci/records.py       step records and the run record
    ci/check_steps.py   steps lint, tests
    ci/containers.py    step image; the build inside a target's image
    ci/build_steps.py   steps build, wheel, verify
    ci/gpu.py           steps kernels, bench (GPU host)
    ci/nox_vllm.py, ci/nox_gsm8k.py   steps overlay, e2e, gsm8k (no pipeline imports)
    ci/pipeline.py      this driver
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import sys
from collections.abc import Callable, Sequence

import build_targets
from ci import build_steps, check_steps, containers, gpu, nox_gsm8k, nox_vllm, records
from ci.layout import STEPS_DIR, rel
from ci.step_env import Env, Failed, Skipped

# --------------------------------------------------------------------------------------------
# The serving steps (their modules take a session and a record; the step env is both)
# --------------------------------------------------------------------------------------------


def overlay(env: Env) -> None:
    """Apply patches/vllm-0.32.0-qsa.patch to the pinned vLLM's files and verify them."""
    nox_vllm.overlay(env, env)


def e2e(env: Env) -> None:
    """Serve the tiny Qwen4Exp checkpoints with vLLM (the overlay applied) and run tests/e2e."""
    nox_vllm.e2e(env, env)
    run = records.current_run()
    if run is not None and env.bin_dir is not None:
        # NOTES: the gsm8k step of this run serves from this environment (the same recipe,
        # just installed and served through) instead of installing the recipe again (~3 min).
        run["serving_python"] = env.python()


def gsm8k(env: Env) -> None:
    """The GSM8K gate: mechanics check on the tiny checkpoint, or a running server's gate."""
    serving_python = (records.current_run() or {}).get("serving_python")
    nox_gsm8k.gsm8k(env, env, serving_python=serving_python)


# --------------------------------------------------------------------------------------------
# The steps, their arguments and their order
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Step:
    """A step: its function, and its arguments as a parser or as a usage line."""

    func: Callable[[Env], None]
    usage: str = ""
    parser: Callable[[], argparse.ArgumentParser] | None = None

    @property
    def summary(self) -> str:
        """The first paragraph of the function's docstring, on one line."""
        return " ".join((self.func.__doc__ or "").split("\n\n")[0].split())

    def help(self, name: str) -> str:
        """The step's usage and its function's docstring."""
        prog = f"python3 -m ci.pipeline {name}"
        doc = inspect.getdoc(self.func) or ""
        if self.parser is not None:
            parser = self.parser()
            parser.prog = prog
            parser.description = doc
            parser.formatter_class = argparse.RawDescriptionHelpFormatter
            text = parser.format_help()
        else:
            text = f"usage: {prog} {self.usage}".rstrip() + f"\n\n{doc}\n"
        return text + f"\nThe same arguments follow `--` in `nox -s {name} -- ARGS`.\n"


STEPS: dict[str, Step] = {
    "lint": Step(check_steps.lint),
    "tests": Step(check_steps.tests, "[PYTEST ARGS]"),
    "build": Step(build_steps.build, parser=build_steps.build_parser),
    "wheel": Step(build_steps.wheel),
    "verify": Step(build_steps.verify),
    "image": Step(containers.image),
    "kernels": Step(gpu.kernels, parser=gpu.kernels_parser),
    "bench": Step(gpu.bench, parser=gpu.bench_parser),
    "overlay": Step(overlay, "[--tree PATH]"),
    "e2e": Step(e2e, "[PYTEST ARGS]"),
    "gsm8k": Step(gsm8k, "[--base-url URL [GATE ARGS]]  (python3 ci/gsm8k_gate.py --help)"),
}
# The order of `nox -s pipeline` (the design card's order).
PIPELINE = ("lint", "tests", "build", "wheel", "verify", "kernels", "bench", "overlay", "e2e",
            "gsm8k")  # fmt: skip


def wants_help(args: Sequence[str]) -> bool:
    return any(a in ("-h", "--help") for a in args)


def run(name: str, bin_dir=None, posargs: Sequence[str] = ()) -> Env | None:
    """Run step ``name`` and leave its record (re-raising Skipped/Failed); with -h/--help among
    its arguments, print the step's help instead and touch nothing."""
    if wants_help(posargs):
        print(STEPS[name].help(name), end="", flush=True)
        return None
    return records.run_step(name, STEPS[name].func, bin_dir, posargs)


# --------------------------------------------------------------------------------------------
# A pipeline run and its record
# --------------------------------------------------------------------------------------------


def pipeline_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nox -s pipeline --", description="Run the pipeline's steps in order."
    )
    parser.add_argument("--steps", default=",".join(PIPELINE), help="comma-separated steps")
    parser.add_argument("--target", default=build_targets.DEFAULT_TARGET)
    parser.add_argument("--container", action="store_true", help="build step inside the image")
    return parser


def start_pipeline(argv: Sequence[str]) -> list[tuple[str, list[str]]] | None:
    """Begin a pipeline run in this process; the (step, arguments) to run, in order. With
    -h/--help, print the usage and return None (nothing begins)."""
    parser = pipeline_parser()
    if wants_help(argv):
        print(parser.format_help(), end="", flush=True)
        return None
    args = parser.parse_args(argv)
    steps = [s for s in args.steps.split(",") if s]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        raise Failed(f"unknown step(s) {', '.join(unknown)}; the steps are {', '.join(STEPS)}")
    records.begin_run(steps, argv)
    build = ["--target", args.target, *(["--container"] if args.container else [])]
    return [(s, build if s == "build" else []) for s in steps]


def write_run_record() -> dict:
    """dist/run-record.{json,md} from this run's step records (see ci/records.py)."""
    return records.write_run_record(list(STEPS))


# --------------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    listing = "\n".join(f"  {name:<8} {step.summary}" for name, step in STEPS.items())
    parser = argparse.ArgumentParser(
        prog="python3 -m ci.pipeline",
        description="Run one pipeline step in this interpreter (no virtualenv, nothing installed).",
        epilog=f"steps:\n{listing}\n\n`python3 -m ci.pipeline STEP --help` shows a step's "
        "arguments.\nexit codes: 0 passed or skipped (the reason is printed), 1 failed, 2 usage "
        "error",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("step", choices=list(STEPS))
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the step's arguments")
    ns = parser.parse_args(argv)
    try:
        if run(ns.step, None, ns.args) is None:
            return 0  # the step's help
    except Skipped as exc:
        print(f"[{ns.step}] skipped: {exc}", flush=True)
    except Failed as exc:
        print(f"[{ns.step}] FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"[{ns.step}] record: {rel(STEPS_DIR / (ns.step + '.json'))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
