"""Container images of the pipeline, driven through the docker Python SDK.

Run by the nox sessions ``image`` and ``build --container`` inside their virtualenv, which holds
the SDK (``python docker/images.py build|run ...``); ``noxfile.py`` also loads this file by path
for :func:`export_tree` (the SDK is imported only when an engine is needed). The SDK speaks to
docker, or to podman's docker-compatible service (``podman system service``), through
``DOCKER_HOST``.

Images (recipes ``docker/<name>.Dockerfile``; every one starts FROM the local base image):

- ``qsa-base:bookworm``   Debian bookworm from debootstrap (``docker/make-base-image.sh``)
- ``qsa-test-cpu``        Python 3.11 venv with the pinned CPU torch and the test dependencies
- ``qsa-build-cuda``      nvcc 13.0 from NVIDIA's PyPI wheels + g++ 12 (target cuda-sm90)
- ``qsa-build-oneapi``    icpx from Intel's oneAPI apt repository (targets bmg-g21, bmg-g31)

Build contexts are assembled offline: the wheels each recipe installs are fetched on the host
with ``pip download`` (pinned torch included) and copied into the context, so that image builds
need no package index and install exactly the versions the native steps use.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BASE_IMAGE = "qsa-base:bookworm"
PODMAN_SOCKETS = ("/run/podman/podman.sock", "/var/run/podman/podman.sock")
ONEAPI_REPO = "https://apt.repos.intel.com/oneapi"
BUILD_OUTPUT_MANIFEST = "custom_esimd_kernels_vllm/provenance.json"

Log = Callable[[str], None]


class ImageError(RuntimeError):
    """An image cannot be built or run here; the message says what is missing."""


def recipe(image: str) -> Path:
    path = HERE / f"{image}.Dockerfile"
    if not path.is_file():
        raise ImageError(f"no recipe for image {image!r}: expected {path.relative_to(ROOT)}")
    return path


# --------------------------------------------------------------------------------------------
# Engine
# --------------------------------------------------------------------------------------------


def connect(log: Log = print):
    """A docker SDK client for docker or podman; raises ImageError naming what is missing."""
    try:
        import docker  # the SDK
    except ImportError as exc:
        raise ImageError("the docker Python SDK is not installed (pip install docker)") from exc
    for name in ("docker", "urllib3"):  # their request-level DEBUG lines are noise here
        logging.getLogger(name).setLevel(logging.WARNING)
    if "DOCKER_HOST" not in os.environ and not Path("/var/run/docker.sock").exists():
        for sock in PODMAN_SOCKETS:
            if Path(sock).exists():
                os.environ["DOCKER_HOST"] = f"unix://{sock}"
                break
    try:
        client = docker.from_env(timeout=600)
        version = client.version()
    except docker.errors.DockerException as exc:
        raise ImageError(
            f"no container engine answers at {os.environ.get('DOCKER_HOST', 'the default socket')}"
            f" ({exc}). Start one: export DOCKER_HOST=$(docker/start-dockerd.sh), or run "
            "`podman system service --time=0 unix:///run/podman/podman.sock` "
            "(with CONTAINERS_CONF=docker/podman-containers.conf)"
        ) from exc
    name = next(
        (c["Name"] for c in version.get("Components", []) if "Engine" in c["Name"]),
        version.get("Platform", {}).get("Name", "engine"),
    )
    log(f"container engine: {name} {version.get('Version')} (API {version.get('ApiVersion')})")
    return client


def has_image(client, tag: str) -> bool:
    import docker

    try:
        client.images.get(tag)
    except docker.errors.ImageNotFound:
        return False
    return True


def ensure_base(client, log: Log = print) -> str:
    """The local base image; made with docker/make-base-image.sh when absent."""
    if has_image(client, BASE_IMAGE):
        log(f"base image {BASE_IMAGE}: present")
        return BASE_IMAGE
    engine = "podman" if "podman" in os.environ.get("DOCKER_HOST", "") else "docker"
    if shutil.which(engine) is None:
        raise ImageError(
            f"base image {BASE_IMAGE} is missing and the {engine} CLI that imports it is not "
            "installed"
        )
    log(f"base image {BASE_IMAGE}: missing, bootstrapping it (docker/make-base-image.sh) ...")
    env = dict(os.environ, QSA_ENGINE=engine)
    subprocess.run([str(HERE / "make-base-image.sh")], check=True, env=env)
    return BASE_IMAGE


# --------------------------------------------------------------------------------------------
# Build contexts and images
# --------------------------------------------------------------------------------------------


# Wheels the images accept: CPython 3.11 on x86-64 with glibc <= 2.36 (Debian bookworm).
WHEEL_PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(36, 16, -1)]
WHEEL_PLATFORMS += ["manylinux2014_x86_64", "linux_x86_64"]


def pip_download(requirements: Sequence[str], dest: Path, log: Log = print) -> None:
    """Fetch wheels (and their dependencies) for the images' CPython 3.11 on x86-64."""
    log(f"fetching {len(requirements)} requirement(s) and their dependencies into the context ...")
    platforms = [arg for p in WHEEL_PLATFORMS for arg in ("--platform", p)]
    subprocess.run(
        [
            sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(dest),
            "--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp",
            *platforms, *requirements,
        ],
        check=True,
    )  # fmt: skip


def make_context(
    image: str,
    ctx: Path,
    requirements: Sequence[str],
    extra_files: Sequence[Path] = (),
    extra_wheels: Sequence[str] = (),
    log: Log = print,
) -> Path:
    """Assemble the build context of ``image``: Dockerfile, requirements.txt, wheels/."""
    if ctx.exists():
        shutil.rmtree(ctx)
    (ctx / "wheels").mkdir(parents=True)
    shutil.copy(recipe(image), ctx / "Dockerfile")
    (ctx / "requirements.txt").write_text("\n".join(requirements) + "\n")
    for f in extra_files:
        shutil.copy(f, ctx / f.name)
    pip_download([*requirements, *extra_wheels], ctx / "wheels", log)
    return ctx


def build_image(client, image: str, ctx: Path, log: Log = print) -> str:
    """Build ``image`` from ``ctx``, streaming the recipe's steps; returns the image id."""
    log(f"building image {image} from docker/{image}.Dockerfile ...")
    start = time.monotonic()
    image_id = None
    tail: list[str] = []
    last = start
    for chunk in client.api.build(
        path=str(ctx),
        tag=image,
        rm=True,
        forcerm=True,
        decode=True,
        buildargs={"BASE": BASE_IMAGE},
    ):
        if "error" in chunk:
            raise ImageError(
                f"building {image} failed: {chunk['error'].strip()}\n" + "".join(tail[-30:])
            )
        line = chunk.get("stream", "").strip()
        now = time.monotonic()
        if line:
            tail.append(line + "\n")
            # Progress: every recipe step, and the step's latest output line every 30 s.
            if line.startswith("Step ") or now - last >= 30:
                last = now
                log(f"  [{now - start:5.0f} s] {line[:150]}")
        if "aux" in chunk and "ID" in chunk["aux"]:
            image_id = chunk["aux"]["ID"]
    log(f"image {image} built in {time.monotonic() - start:.0f} s ({image_id})")
    return image_id or client.images.get(image).id


def run(
    client,
    image: str,
    command: str,
    mounts: dict[str, str],
    workdir: str,
    log_path: Path,
    env: dict[str, str] | None = None,
    log: Log = print,
    heartbeat_s: float = 30.0,
) -> int:
    """Run ``bash -c command`` in a fresh, offline container; stream its output to ``log_path``
    with a progress line every ``heartbeat_s`` seconds; remove the container; return its exit
    code. (Not ``bash -l``: Debian's /etc/profile would reset the image's PATH.)"""
    volumes = {host: {"bind": guest, "mode": "rw"} for host, guest in mounts.items()}
    container = client.containers.run(
        image,
        ["bash", "-c", command],
        volumes=volumes,
        working_dir=workdir,
        environment=env or {},
        detach=True,
        network_mode="none",
    )
    start = last = time.monotonic()
    try:
        with open(log_path, "wb") as out:
            for chunk in container.logs(stream=True, follow=True):
                out.write(chunk)
                now = time.monotonic()
                if now - last >= heartbeat_s:
                    last = now
                    text = chunk.decode(errors="replace").strip().splitlines()
                    log(f"  [{now - start:5.0f} s] {text[-1][:150] if text else '...'}")
        return int(container.wait()["StatusCode"])
    finally:
        container.remove(force=True)


def require_oneapi_repo(timeout: float = 10.0) -> None:
    """Fail fast when Intel's oneAPI apt repository (needed by qsa-build-oneapi) is unreachable."""
    try:
        urllib.request.urlopen(urllib.request.Request(ONEAPI_REPO, method="HEAD"), timeout=timeout)
    except (urllib.error.URLError, OSError) as exc:
        if isinstance(exc, urllib.error.HTTPError) and exc.code < 500:
            return  # the server answered: the repository is reachable
        raise ImageError(
            f"image qsa-build-oneapi installs icpx from Intel's oneAPI apt repository "
            f"{ONEAPI_REPO}, which is not reachable from this host ({exc}); build the bmg-* "
            "targets on a runner that reaches it or that has icpx installed"
        ) from exc


# --------------------------------------------------------------------------------------------
# Source export
# --------------------------------------------------------------------------------------------

_EXPORT_IGNORE = shutil.ignore_patterns(
    ".git",
    ".venv*",
    ".nox",
    "dist",
    "build",
    ".work",
    "__pycache__",
    "*.so",
    "*.egg-info",
    ".pytest_cache",
    ".ruff_cache",
    ".hypothesis",
    "provenance.json",
)


def export_tree(dest: Path, root: Path = ROOT) -> Path:
    """Copy the project's sources (tracked and untracked-but-not-ignored files) to ``dest``:
    what a clean clone of the current working tree holds, without build outputs."""
    if dest.exists():
        shutil.rmtree(dest)
    try:
        listed = (
            subprocess.run(
                ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                cwd=root,
                check=True,
                capture_output=True,
            )
            .stdout.decode()
            .split("\0")
        )
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(root, dest, ignore=_EXPORT_IGNORE, symlinks=True)
        return dest
    for rel in filter(None, listed):
        if rel == BUILD_OUTPUT_MANIFEST:
            continue  # written by the build step, not a source
        src = root / rel
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the working tree
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel, follow_symlinks=False)
    return dest


# --------------------------------------------------------------------------------------------
# Command line (what the nox sessions call)
# --------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python docker/images.py", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="make the base image if needed, then build IMAGE")
    b.add_argument("image")
    b.add_argument("--context", type=Path, required=True, help="scratch directory for the context")
    b.add_argument("--requirement", action="append", default=[], help="installed in the image")
    b.add_argument("--extra-wheel", action="append", default=[], help="fetched, not pip-installed")
    b.add_argument("--extra-file", action="append", default=[], type=Path)
    b.add_argument("--result", type=Path, required=True, help="JSON written here: image, id")
    r = sub.add_parser("run", help="run a command in a fresh container of IMAGE")
    r.add_argument("image")
    r.add_argument("--mount", action="append", default=[], help="HOST:GUEST (read-write)")
    r.add_argument("--workdir", required=True)
    r.add_argument("--log", type=Path, required=True)
    r.add_argument("--env", action="append", default=[], help="KEY=VALUE, set in the container")
    r.add_argument("command")
    args = parser.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, flush=True)

    try:
        if args.cmd == "build":
            if args.image == "qsa-build-oneapi":
                require_oneapi_repo()
            client = connect(log)
            ensure_base(client, log)
            ctx = make_context(
                args.image, args.context, args.requirement, args.extra_file, args.extra_wheel, log
            )
            image_id = build_image(client, args.image, ctx, log)
            args.result.write_text(json.dumps({"image": args.image, "id": image_id}) + "\n")
            return 0
        client = connect(log)
        mounts = dict(m.rsplit(":", 1) for m in args.mount)
        environ = dict(e.split("=", 1) for e in args.env)
        return run(
            client, args.image, args.command, mounts, args.workdir, args.log, environ, log=log
        )
    except ImageError as exc:
        print(f"images: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
