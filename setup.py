"""Package build: compiles csrc/ into custom_esimd_kernels_vllm/_C.so when nvcc is on PATH.

``_C.so`` is a LibTorch stable-ABI library (csrc/torch_ops.cpp + the kernels), loaded with
``torch.ops.load_library``: no CPython extension, so the wheel is ``py3-none`` and one binary
serves every Python 3 and torch >= the target version in build_targets.py. It is compiled
against the headers of the torch installed in the build environment and links
``libtorch_cpu`` (for the stable C shim) and the CUDA runtime statically.

Flags come from build_targets.py (target ``cuda-sm90``) and nowhere else (the contract's
constants are csrc/qsa/contract.h);
this file adds only include directories and three build-info strings (arch, version, source
SHA256) that torch_ops.cpp reports through ``qsa_build_info_json()``.

* No nvcc (or ``QSA_SKIP_CUDA_BUILD=1``): the package installs without the compiled library
  and says once that the PyTorch reference backend will be used.
* Reproducible: nvcc runs in the repository root on relative paths, with no timestamps or
  absolute paths in the flags, so two clean builds give the same DSO bytes.
* Source SHA256: ``qsa_ops.provenance.source_sha256`` (the one rule: every input of the DSO,
  ``provenance.SOURCES``), computed from the files so it works without git.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from build_targets import TARGETS  # noqa: E402

TARGET = TARGETS["cuda-sm90"]
EXT_NAME = "custom_esimd_kernels_vllm._C"
LIBRARY = "custom_esimd_kernels_vllm/_C.so"
CSRC = "csrc"
KERNEL_SOURCES = (
    "csrc/qsa/select_paged_tokens.cu",
    "csrc/qsa/sparse_paged_attention.cu",
)
BINDINGS = "csrc/torch_ops.cpp"
SKIP_ENV = "QSA_SKIP_CUDA_BUILD"


def _provenance():
    """qsa_ops/provenance.py, loaded by path (standard library only): the one source-hash rule."""
    path = ROOT / "custom_esimd_kernels_vllm" / "qsa_ops" / "provenance.py"
    spec = importlib.util.spec_from_file_location("_qsa_provenance", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def source_sha256(root: Path = ROOT) -> str:
    return _provenance().source_sha256(root)


def package_version() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'^version\s*=\s*"([^"]+)"', text, re.M)
    return match.group(1) if match else "unknown"


def target_arch() -> str:
    for flag in TARGET.arch_flags:
        match = re.search(r"code=(sm_\w+)", flag)
        if match:
            return match.group(1)
    return "unknown"


def cuda_build_disabled() -> str:
    """Why the CUDA module is not built, or "" when it is."""
    if os.environ.get(SKIP_ENV, "") == "1":
        return f"{SKIP_ENV}=1"
    if shutil.which(TARGET.toolchain) is None:
        return f"{TARGET.toolchain} not found on PATH"
    if importlib.util.find_spec("torch") is None:
        # NOTES: torch is not a build requirement (an isolated build would download a second,
        # multi-GB torch just for its headers): build with the installed one, e.g.
        # `pip install --no-build-isolation .`
        return "torch is not importable in the build environment (pip install --no-build-isolation)"
    return ""


def torch_dirs() -> tuple[str, str]:
    """(include dir, lib dir) of the torch in this build environment (headers + libtorch_cpu)."""
    import torch.utils.cpp_extension as ext

    return ext.include_paths()[0], ext.library_paths()[0]


class BuildQsaCuda(build_ext):
    """Builds the stable-ABI library with nvcc directly (no torch.utils.cpp_extension build)."""

    def get_ext_filename(self, ext_name: str) -> str:
        # NOTES: a plain shared library, not a CPython module: no ABI suffix in its name.
        return ext_name.replace(".", os.sep) + ".so"

    def build_extension(self, ext: Extension) -> None:
        out = Path(self.get_ext_fullpath(ext.name)).resolve()
        tmp = Path(self.build_temp).resolve() / "qsa_cuda"
        tmp.mkdir(parents=True, exist_ok=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        nvcc = TARGET.toolchain
        torch_include, torch_lib = torch_dirs()
        common = [
            *TARGET.arch_flags,
            *TARGET.flags,
            f"-I{CSRC}",
        ]
        torch_flags = [
            f"-isystem={torch_include}",
            # NOTES: torch's headers expand __FILE__ in their checks: map the build
            # environment's path away so that the bytes do not depend on where torch lives.
            f"-Xcompiler=-fmacro-prefix-map={torch_include}=torch/include",
            *TARGET.torch_flags,
        ]
        info = [
            f'-DQSA_ARCH="{target_arch()}"',
            f'-DQSA_VERSION="{package_version()}"',
            f'-DQSA_SOURCE_SHA256="{source_sha256()}"',
        ]
        jobs = []
        for src in (*KERNEL_SOURCES, BINDINGS):
            obj = str(tmp / (Path(src).name + ".o"))
            extra = [*torch_flags, *info] if src == BINDINGS else []
            jobs.append(([nvcc, *common, *extra, "-c", src, "-o", obj], obj))
        # The translation units are independent: compile them in parallel (the commands are
        # printed first, in order: the build's manifest records them).
        for cmd, _ in jobs:
            print(" ".join(cmd), flush=True)
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            list(pool.map(self._compile, [cmd for cmd, _ in jobs]))
        objects = [obj for _, obj in jobs]
        # NOTES: nvcc links the CUDA runtime statically (its default), so the library depends on
        # the driver and libtorch_cpu only (torch has loaded it already when
        # torch.ops.load_library opens this file). libtorch_cpu goes to the host linker only, by
        # file: the binary records its SONAME, while nvcc writes its own -L/-l arguments (and
        # LIBRARY_PATH) into the binary, which would tie the bytes to where torch lives.
        libtorch = Path(torch_lib) / "libtorch_cpu.so"
        link = [nvcc, *TARGET.arch_flags, "-shared", *TARGET.link_flags, *objects]
        self._run([*link, f"-Xlinker={libtorch}", "-o", str(out)])

    @staticmethod
    def _compile(cmd: list[str]) -> None:
        subprocess.run(cmd, cwd=ROOT, check=True)

    @classmethod
    def _run(cls, cmd: list[str]) -> None:
        print(" ".join(cmd), flush=True)
        cls._compile(cmd)


try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # older setuptools
    from wheel.bdist_wheel import bdist_wheel


class BdistWheelPy3(bdist_wheel):
    """Tag py3-none-<platform>: the library holds no CPython symbol, so one wheel serves every
    Python 3 the package supports (it still needs Linux x86-64, the CUDA driver and torch)."""

    def get_tag(self) -> tuple[str, str, str]:
        _, _, plat = super().get_tag()
        return "py3", "none", plat


def main() -> None:
    disabled = cuda_build_disabled()
    if disabled:
        print(
            f"custom_esimd_kernels_vllm: CUDA kernels not built ({disabled}); "
            "the PyTorch reference backend will be used"
        )
        ext_modules = []
    else:
        ext_modules = [Extension(EXT_NAME, sources=[*KERNEL_SOURCES, BINDINGS])]
    setup(
        ext_modules=ext_modules,
        cmdclass={"build_ext": BuildQsaCuda, "bdist_wheel": BdistWheelPy3},
    )


if __name__ == "__main__":  # also true under pip / setuptools.build_meta
    main()
