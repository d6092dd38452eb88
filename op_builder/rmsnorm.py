"""Builders of the fused RMSNorm op family (csrc/rmsnorm)."""

from .builder import LFCPUOpBuilder, LFCUDAOpBuilder


class FusedRMSNormBuilder(LFCUDAOpBuilder):
    NAME = "lf_fused_rmsnorm"
    BUILD_VAR = "LF_BUILD_RMSNORM"
    SOURCES = ("rmsnorm/rmsnorm.cu", "rmsnorm/rmsnorm_bwd.cu", "rmsnorm/rmsnorm_binding.cpp")


class FusedRMSNormCPUBuilder(LFCPUOpBuilder):
    NAME = "lf_fused_rmsnorm_cpu"
    BUILD_VAR = "LF_BUILD_RMSNORM"
    SOURCES = ("rmsnorm/rmsnorm_cpu.cpp", "rmsnorm/rmsnorm_binding.cpp")
