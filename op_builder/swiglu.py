"""Builders of the fused SwiGLU + dropout op family (csrc/swiglu)."""

from .builder import LFCPUOpBuilder, LFCUDAOpBuilder


class FusedSwiGLUBuilder(LFCUDAOpBuilder):
    NAME = "lf_fused_swiglu"
    BUILD_VAR = "LF_BUILD_SWIGLU"
    SOURCES = ("swiglu/swiglu.cu", "swiglu/swiglu_bwd.cu", "swiglu/swiglu_binding.cpp")


class FusedSwiGLUCPUBuilder(LFCPUOpBuilder):
    NAME = "lf_fused_swiglu_cpu"
    BUILD_VAR = "LF_BUILD_SWIGLU"
    SOURCES = ("swiglu/swiglu_cpu.cpp", "swiglu/swiglu_binding.cpp")
