"""Build targets of the QSA extension: the one authoritative place for toolchains, flags and macros.

Read by ``setup.py`` (the package build), ``noxfile.py`` (the pipeline) and the provenance
manifest. Nothing here imports torch: the compiled module depends on the CUDA runtime only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# NOTES: the macros are the validated contract of the kernels (one rank of TP8). They are
# compiled into the DSO and reported by its build_info(); the Python contract module holds
# the same numbers and a test checks that the two agree.
CONTRACT_MACROS: dict[str, int] = {
    "QSA_TOKEN_TOPK": 2048,
    "QSA_COMPRESS_RATIO": 4,
    "QSA_BLOCK_TOPK": 512,
    "QSA_TAIL": 3,
    "QSA_WIDTH": 2051,
    "QSA_KV_PAGE": 512,
    "QSA_CK_PAGE": 128,
    "QSA_ATTN_HEADS": 3,
    "QSA_HEAD_DIM": 256,
    "QSA_INDEX_HEADS": 4,
    "QSA_INDEX_DIM": 128,
}


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
    macros: dict[str, int] = field(default_factory=lambda: dict(CONTRACT_MACROS))
    container_image: str = ""  # docker/ recipe that builds this target
    description: str = ""

    def macro_flags(self) -> list[str]:
        return [f"-D{k}={v}" for k, v in sorted(self.macros.items())]


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
            # NOTES: release build, as CPython's own extension flags are; without it the
            # assert()s of pybind11 and Python embed absolute header paths in the DSO.
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
    "bmg-g21": Target(
        name="bmg-g21",
        toolchain="icpx",
        arch_flags=("-fsycl", "-fsycl-targets=spir64_gen", "-Xs", "-device bmg-g21"),
        flags=("-O3", "-std=c++17", "-fPIC"),
        container_image="qsa-build-oneapi",
        description="Intel Arc B-series (BMG-G21), SYCL ahead-of-time",
    ),
    "bmg-g31": Target(
        name="bmg-g31",
        toolchain="icpx",
        arch_flags=("-fsycl", "-fsycl-targets=spir64_gen", "-Xs", "-device bmg-g31"),
        flags=("-O3", "-std=c++17", "-fPIC"),
        container_image="qsa-build-oneapi",
        description="Intel Arc B-series (BMG-G31), SYCL ahead-of-time",
    ),
}

DEFAULT_TARGET = "cuda-sm90"
