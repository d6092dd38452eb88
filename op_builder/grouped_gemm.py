"""Builder of the MoE layer's grouped GEMM (csrc/grouped_gemm): CUTLASS 3 ptr-array grouped GEMMs for Hopper.

CUDA only, sm_90a only (wgmma and TMA need the arch-specific target), and it needs CUTLASS's headers: the
``nvidia-cutlass`` wheel (``pip install nvidia-cutlass``, headers under ``cutlass_library/source``) or a CUTLASS
checkout named by ``CUTLASS_PATH``. Elsewhere the MoE layer keeps torch's ``F.grouped_mm``.
"""

from __future__ import annotations

import os
from pathlib import Path

from .builder import LFCUDAOpBuilder

_CONFIGS = 3  # tile configurations per mode (csrc/grouped_gemm/grouped_gemm_api.h)
_ARCH = "9.0a"


def cutlass_include_dirs() -> list[Path] | None:
    """CUTLASS's include/ and tools/util/include/, from CUTLASS_PATH or the nvidia-cutlass wheel; None if absent."""
    roots = []
    if os.environ.get("CUTLASS_PATH"):
        roots.append(Path(os.environ["CUTLASS_PATH"]))
    try:
        import importlib.util

        spec = importlib.util.find_spec("cutlass_library")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin:
        roots.append(Path(spec.origin).parent / "source")
    for root in roots:
        dirs = [root / "include", root / "tools" / "util" / "include"]
        if (dirs[0] / "cutlass" / "cutlass.h").is_file() and (dirs[1] / "cutlass" / "util" / "packed_stride.hpp").is_file():
            return dirs
    return None


class GroupedGemmBuilder(LFCUDAOpBuilder):
    NAME = "lf_grouped_gemm"
    BUILD_VAR = "LF_BUILD_GROUPED_GEMM"
    SOURCES = ("grouped_gemm/grouped_gemm.cu", "grouped_gemm/grouped_gemm_binding.cpp") + tuple(
        f"grouped_gemm/grouped_gemm_{mode}_{c}.cu" for mode in ("rows_bnk", "rows_bkn", "wgrad")
        for c in range(_CONFIGS))

    def compatibility_problem(self) -> str | None:
        problem = super().compatibility_problem()
        if problem is not None:
            return problem
        if cutlass_include_dirs() is None:
            return ("CUTLASS headers not found (pip install nvidia-cutlass, or set CUTLASS_PATH to a CUTLASS "
                    "checkout with include/ and tools/util/include/)")
        return None

    def include_paths(self) -> list[str]:
        return super().include_paths() + [str(d) for d in cutlass_include_dirs() or []]

    def nvcc_args(self):
        # CUTLASS's own recommendations for its sm90 kernels; -O3 and the fast paths of its headers
        return super().nvcc_args() + ["-DNDEBUG",
                                      "-DCUTLASS_ENABLE_TENSOR_CORE_MMA=1", "-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED",
                                      "--expt-extended-lambda", "-Xcompiler=-Wno-psabi",
                                      "-diag-suppress=2908"]  # CUTLASS sm100 headers: implicit this capture (C++20)

    def compute_capability_args(self, cross_compile_archs=None):
        if self.jit_mode:
            return []  # jit_build sets TORCH_CUDA_ARCH_LIST to 9.0a for this op
        return ["-gencode=arch=compute_90a,code=sm_90a"]

    def jit_build(self, verbose: bool = False):
        # the kernels are wgmma/TMA code: sm_90a and nothing else, whatever the other ops are built for
        saved = os.environ.get("TORCH_CUDA_ARCH_LIST")
        os.environ["TORCH_CUDA_ARCH_LIST"] = _ARCH
        try:
            return super().jit_build(verbose=verbose)
        finally:
            if saved is None:
                os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
            else:
                os.environ["TORCH_CUDA_ARCH_LIST"] = saved
