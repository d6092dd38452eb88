"""Builders of the fused softmax cross-entropy op family (csrc/cross_entropy)."""

from .builder import LFCPUOpBuilder, LFCUDAOpBuilder


class FusedCrossEntropyBuilder(LFCUDAOpBuilder):
    NAME = "lf_cross_entropy"
    BUILD_VAR = "LF_BUILD_CROSS_ENTROPY"
    SOURCES = ("cross_entropy/cross_entropy.cu", "cross_entropy/cross_entropy_binding.cpp")

    def nvcc_args(self):
        # exp and log rounded as on the CPU and in torch: DeepSpeed's --use_fast_math would make the row's
        # log-sum-exp a few ulp worse, for no time the memory-bound kernel could save
        return [a for a in super().nvcc_args() if a != "--use_fast_math"]


class FusedCrossEntropyCPUBuilder(LFCPUOpBuilder):
    NAME = "lf_cross_entropy_cpu"
    BUILD_VAR = "LF_BUILD_CROSS_ENTROPY"
    SOURCES = ("cross_entropy/cross_entropy_cpu.cpp", "cross_entropy/cross_entropy_binding.cpp")
