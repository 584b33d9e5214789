"""Build targets of the QSA ops: the one authoritative place for toolchains and flags (the
contract's constants live in csrc/qsa/contract.h and qsa_ops/contract.py).

Read by ``setup.py`` (the package build), ``ci/pipeline.py`` (the pipeline) and the provenance
manifest. Standard library only.

``cuda-sm90`` is built. ``bmg-g21`` and ``bmg-g31`` (Intel Arc B-series, SYCL) are *planned*
targets without kernel sources yet: their toolchain and flags are declared so that the oneAPI
image and the pipeline's refusal are real, and ``nox -s build -- --target bmg-g21`` refuses
with that reason before it looks for a compiler.
"""

from __future__ import annotations

from dataclasses import dataclass

# The oldest torch the compiled library loads into: 2.11 (major << 56 | minor << 48).
TORCH_TARGET_VERSION = (2 << 56) | (11 << 48)


@dataclass(frozen=True)
class Target:
    name: str
    toolchain: str  # the compiler driver that must be on PATH
    arch_flags: tuple[str, ...]
    flags: tuple[str, ...]
    link_flags: tuple[str, ...] = ()
    torch_flags: tuple[str, ...] = ()  # for the op-layer source that includes torch's headers
    container_image: str = ""  # docker/ recipe that builds this target
    description: str = ""
    planned: bool = False  # declared, but csrc/ has no kernel sources for it yet


def _planned_bmg(name: str) -> Target:
    """An Intel Arc B-series target (SYCL ahead-of-time): planned, no kernel sources yet."""
    chip = name.split("-")[1].upper()
    return Target(
        name=name,
        toolchain="icpx",
        arch_flags=("-fsycl", "-fsycl-targets=spir64_gen", "-Xs", f"-device {name}"),
        flags=("-O3", "-std=c++17", "-fPIC"),
        container_image="qsa-build-oneapi",
        description=f"Intel Arc B-series (BMG-{chip}), SYCL ahead-of-time",
        planned=True,
    )


TARGETS: dict[str, Target] = {
    "cuda-sm90": Target(
        name="cuda-sm90",
        toolchain="nvcc",
        arch_flags=("-gencode=arch=compute_90a,code=sm_90a",),
        flags=(
            "-O3",
            "-std=c++17",
            "--expt-relaxed-constexpr",
            "-Xcompiler=-fPIC",
            "-Xcompiler=-fvisibility=hidden",
            # NOTES: release build; without it assert()s embed absolute header paths in the DSO.
            "-DNDEBUG",
        ),
        # NOTES: nvcc compiles host code from temporary files named after its process id
        # (tmpxft_<pid>_...cudafe1.cpp) and the host compiler records that name as a local
        # file symbol; dropping the static symbol table (.dynsym stays) makes builds
        # byte-identical.
        link_flags=("-Xlinker=--strip-all",),
        # NOTES: the op layer uses the LibTorch stable ABI as of torch 2.11: built against any
        # newer torch's headers, the one binary loads into torch 2.11 (the GPU hosts) and 2.13.
        torch_flags=("-DUSE_CUDA", f"-DTORCH_TARGET_VERSION={TORCH_TARGET_VERSION:#018x}"),
        container_image="qsa-build-cuda",
        description="NVIDIA Hopper (H100/H200), CUDA C++ kernels",
    ),
    **{name: _planned_bmg(name) for name in ("bmg-g21", "bmg-g31")},
}

DEFAULT_TARGET = "cuda-sm90"
