"""Pipeline steps with container images (docker/images.py): the CPU test image (step
``image``) and the build inside a target's image (``build -- --container``, called by
ci/build_steps.py), compared with the native build (ci/native_build.py)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import build_targets
from ci.layout import (
    BUILD_REQUIREMENTS,
    CUDA_TOOLKIT,
    DIST,
    IMAGES,
    LOGS_DIR,
    PACKAGE,
    PROVENANCE_JSON,
    ROOT,
    TEST_EXTRAS,
    TORCH_PIN,
    WORK,
    extras,
    provenance,
    rel,
    requirements_file,
    sha256_file,
)
from ci.native_build import build_native, diff_keys, source_date_epoch
from ci.step_env import Env, Failed, error_line


def images():
    """docker/images.py, by path (a `docker` package would shadow the docker SDK it uses)."""
    spec = importlib.util.spec_from_file_location("_qsa_images", IMAGES)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_image(env: Env, image: str, requirements: list[str], wheels=(), files=()) -> str:
    """Build ``image`` (and the base image when absent) through docker/images.py; its id."""
    env.install("docker")
    result = WORK / f"{image}.json"
    result.unlink(missing_ok=True)
    cmd = ["python", IMAGES, "build", image, "--context", WORK / "ctx" / image]
    cmd += [f"--requirement={r}" for r in requirements]
    cmd += [f"--extra-wheel={w}" for w in wheels] + [f"--extra-file={f}" for f in files]
    env.run(*cmd, "--result", result)
    return json.loads(result.read_text())["id"]


def run_in_image(
    env: Env,
    image: str,
    command: str,
    mounts: dict[Path, str],
    workdir: str,
    log: Path,
    environ: dict[str, str] | None = None,
) -> None:
    """Run ``command`` in a fresh, offline container of ``image`` (with ``environ`` set), its
    output in ``log``."""
    cmd = ["python", IMAGES, "run", image, "--workdir", workdir, "--log", log]
    cmd += [f"--mount={host}:{guest}" for host, guest in mounts.items()]
    cmd += [f"--env={key}={value}" for key, value in (environ or {}).items()]
    try:
        env.run(*cmd, command)
    except Failed:
        tail = log.read_text(errors="replace").splitlines()[-200:] if log.is_file() else []
        raise Failed(f"`{command}` failed inside {image}: {error_line(tail)}") from None
    finally:
        if log.is_file():
            env.artifact(log)


def image(env: Env) -> None:
    """Build the CPU test image and run the test suite inside it, offline."""
    requirements = [TORCH_PIN, *extras(*TEST_EXTRAS), "nox", *requirements_file(BUILD_REQUIREMENTS)]
    build_image(env, "qsa-test-cpu", requirements)
    src = images().export_tree(WORK / "image-src")
    log = LOGS_DIR / "image-tests.log"
    try:
        run_in_image(
            env, "qsa-test-cpu", "python3 -m ci.pipeline tests", {src: "/src"}, "/src", log
        )
    finally:
        inner = src / "dist" / "steps" / "tests.json"
        if inner.is_file():
            env.details["tests_in_image"] = json.loads(inner.read_text())
    summary = [ln for ln in log.read_text(errors="replace").splitlines() if " passed" in ln]
    env.log("inside qsa-test-cpu: " + (summary[-1].strip("= ") if summary else "done"))


def build_in_container(env: Env, target: build_targets.Target) -> None:
    """Build the DSO and the wheel inside the target's image (``python3 -m ci.pipeline build``
    and ``wheel`` there), then compare them with the native build's (made first when absent).
    The comparison goes to dist/container/<target>/comparison.json and the step record, not
    into the shipped manifest: the wheel must not depend on whether the comparison ran."""
    cuda = target.toolchain == "nvcc"
    image_id = build_image(
        env,
        target.container_image,
        requirements_file(BUILD_REQUIREMENTS),
        wheels=requirements_file(CUDA_TOOLKIT) if cuda else (),
        files=[CUDA_TOOLKIT] if cuda else (),
    )
    native = json.loads(PROVENANCE_JSON.read_text()) if PROVENANCE_JSON.is_file() else {}
    if native.get("target", {}).get("name") != target.name or native.get(
        "sources"
    ) != provenance.source_digests(ROOT):
        env.log("no native build of these sources for this target: building it first")
        env.install("-r", BUILD_REQUIREMENTS)
        build_native(env, target)
        native = json.loads(PROVENANCE_JSON.read_text())

    # NOTES: the container builds at the same absolute path as this checkout, because nvcc
    # derives the mangled names of anonymous namespaces from the source file's absolute path.
    src = images().export_tree(WORK / "container-src")
    out = DIST / "container" / target.name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    log = LOGS_DIR / f"build-container-{target.name}.log"
    dso_name = Path(native["dso"]["path"]).name
    command = (
        f"python3 -m ci.pipeline build --target {target.name} && python3 -m ci.pipeline wheel"
        f" && cp dist/provenance.json dist/*.whl {PACKAGE}/{dso_name} /out/"
    )
    # The export has no git metadata: the checkout's commit and dirty state (for the manifest)
    # and the commit's time (for the wheel's zip entries) go in through the environment.
    exported = {
        provenance.GIT_STATE_ENV: json.dumps(provenance.git_state(ROOT)),
        "SOURCE_DATE_EPOCH": source_date_epoch(),
    }
    run_in_image(
        env,
        target.container_image,
        command,
        {src: str(ROOT), out: "/out"},
        str(ROOT),
        log,
        exported,
    )
    inside_dso = out / dso_name
    wheels = sorted(out.glob("*.whl"))
    if len(wheels) != 1:
        raise Failed(f"the container build left {len(wheels)} wheels in {rel(out)}, not one")
    inside = json.loads((out / "provenance.json").read_text())
    inside["build"]["container"] = {"image": target.container_image, "image_id": image_id}
    (out / "provenance.json").write_text(json.dumps(inside, indent=2) + "\n")
    comparison = compare_builds(native, inside, inside_dso, wheels[0])
    (out / "comparison.json").write_text(json.dumps(comparison, indent=2) + "\n")
    for path in (out / "provenance.json", inside_dso, wheels[0], out / "comparison.json"):
        env.artifact(path)
    env.details.update(target=target.name, container=comparison)
    verdict = "IDENTICAL to" if comparison["identical"] else "DIFFERENT from"
    env.log(
        f"container DSO {comparison['sha256']} is {verdict} the native DSO {native['dso']['sha256']}"
    )
    env.log(f"container wheel {wheels[0].name}  sha256 {comparison['wheel']['sha256']}")
    for diff in comparison["input_differences"]:
        env.log(f"  input difference: {diff}")


def compare_builds(native: dict, inside: dict, inside_dso: Path, inside_wheel: Path) -> dict:
    """Native vs container DSO: equal SHA256 or not, and every input that differs between the
    two manifests (toolchain versions, target flags, source digests, git state)."""
    differences = []
    for key in ("toolchain", "target", "sources", "git"):
        a, b = native.get(key, {}), inside.get(key, {})
        differences += [
            f"{key}.{name}: native {a.get(name)!r} vs container {b.get(name)!r}"
            for name in diff_keys(a, b)
        ]
    return {
        "sources_sha256": inside["sources_sha256"],
        "image_dso": rel(inside_dso),
        "sha256": inside["dso"]["sha256"],
        "identical": inside["dso"]["sha256"] == native["dso"]["sha256"],
        "wheel": {"path": rel(inside_wheel), "sha256": sha256_file(inside_wheel)},
        "input_differences": differences,
    }
