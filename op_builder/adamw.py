"""Builders of the fused AdamW + global-norm clip + non-finite skip op family (csrc/adamw)."""

from .builder import LFCPUOpBuilder, LFCUDAOpBuilder


class FusedAdamWClipBuilder(LFCUDAOpBuilder):
    NAME = "lf_fused_adamw_clip"
    BUILD_VAR = "LF_BUILD_ADAMW"
    SOURCES = ("adamw/adamw.cu", "adamw/adamw_binding.cpp")

    def nvcc_args(self):
        # The update divides and takes square roots like torch.optim.AdamW and the CPU kernel, rounded
        # correctly: DeepSpeed's --use_fast_math would approximate both (and flush denormal moments to zero).
        # The kernel is bound by memory, so the exact instructions cost nothing measurable.
        return [a for a in super().nvcc_args() if a != "--use_fast_math"]


class FusedAdamWClipCPUBuilder(LFCPUOpBuilder):
    NAME = "lf_fused_adamw_clip_cpu"
    BUILD_VAR = "LF_BUILD_ADAMW"
    SOURCES = ("adamw/adamw_cpu.cpp", "adamw/adamw_binding.cpp")
