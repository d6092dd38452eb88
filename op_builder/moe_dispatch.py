"""Builders of the fused MoE dispatch op family: permute / unpermute, forward and backward, the routing
indices, the router's softmax + top-k, and the experts' per-expert backward GEMMs (csrc/moe_dispatch)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

from .builder import LFCPUOpBuilder, LFCUDAOpBuilder


@functools.lru_cache(maxsize=1)
def cublaslt_location() -> tuple[str | None, str, str] | None:
    """Where cuBLASLt's header and library are: (an include dir to add, or None where CUDA_HOME's include has the
    header; the library's dir; its file name), or None. torch's own pip copy comes first (nvidia/cu13 for CUDA 13,
    nvidia/cublas for CUDA 12: the library torch loads, so the one the op runs against), then CUDA_HOME (a
    toolkit with cuBLAS; a bare nvcc install has none)."""
    from torch.utils.cpp_extension import CUDA_HOME

    candidates = []
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec is not None else []:
        for sub in ("cu13", "cublas"):
            root = Path(base) / sub
            candidates.append((root / "include", [root / "lib"], True))
    if CUDA_HOME:
        root = Path(CUDA_HOME)
        candidates.append((root / "include", [root / "lib64", root / "lib", root / "targets/x86_64-linux/lib"],
                           False))
    for include, lib_dirs, add_include in candidates:
        if not (include / "cublasLt.h").is_file():
            continue
        for lib_dir in lib_dirs:
            libs = sorted(lib_dir.glob("libcublasLt.so*"))
            if libs:
                return (str(include) if add_include else None), str(lib_dir), libs[0].name
    return None


class MoEDispatchBuilder(LFCUDAOpBuilder):
    NAME = "lf_moe_dispatch"
    BUILD_VAR = "LF_BUILD_MOE_DISPATCH"
    SOURCES = ("moe_dispatch/moe_dispatch.cu", "moe_dispatch/moe_routing.cu", "moe_dispatch/moe_router.cu",
               "moe_dispatch/moe_expert_gemm.cpp", "moe_dispatch/moe_dispatch_binding.cpp")

    # Without cuBLASLt the op still builds: its per-expert GEMMs then take torch's cuBLAS path (the layer does not
    # use them there: a heuristic query per new shape costs more host time than they save).
    def cxx_args(self):
        where = cublaslt_location()
        if where is None:
            return super().cxx_args()
        include = where[0]
        # -idirafter: only what the toolkit's own include dirs lack (cublasLt.h) comes from the wheel's copy
        return super().cxx_args() + ["-DLF_WITH_CUBLASLT"] + (["-idirafter", include] if include else [])

    def extra_ldflags(self):
        where = cublaslt_location()
        if where is None:
            return super().extra_ldflags()
        _, lib_dir, lib = where
        return super().extra_ldflags() + [f"-L{lib_dir}", f"-l:{lib}", f"-Wl,-rpath,{lib_dir}"]


class MoEDispatchCPUBuilder(LFCPUOpBuilder):
    NAME = "lf_moe_dispatch_cpu"
    BUILD_VAR = "LF_BUILD_MOE_DISPATCH"
    SOURCES = ("moe_dispatch/moe_dispatch_cpu.cpp", "moe_dispatch/moe_routing_cpu.cpp",
               "moe_dispatch/moe_router_cpu.cpp", "moe_dispatch/moe_expert_gemm_cpu.cpp",
               "moe_dispatch/moe_dispatch_binding.cpp")

    # -march=native and GCC's default -ffp-contract=fast would fuse the combine's products and sums into FMAs: the
    # unpermute forward's "stock" rounding rounds each on its own, as torch's separate CPU mul and sum kernels do
    # (tests/ops/test_moe_dispatch.py checks the bits against them)
    def cxx_args(self):
        return super().cxx_args() + ["-ffp-contract=off"]
