"""DeepSpeed OpBuilder subclasses of the ds_loongforge ops (installed as ``ds_loongforge.op_builder``)."""

from .adamw import FusedAdamWClipBuilder, FusedAdamWClipCPUBuilder
from .builder import OpBuildError, all_builders, build_ops, csrc_root, cuda_builders
from .cross_entropy import FusedCrossEntropyBuilder, FusedCrossEntropyCPUBuilder
from .moe_dispatch import MoEDispatchBuilder, MoEDispatchCPUBuilder
from .rmsnorm import FusedRMSNormBuilder, FusedRMSNormCPUBuilder
from .swiglu import FusedSwiGLUBuilder, FusedSwiGLUCPUBuilder

__all__ = [
    "OpBuildError", "all_builders", "build_ops", "csrc_root", "cuda_builders", "FusedRMSNormBuilder", "FusedRMSNormCPUBuilder",
    "FusedSwiGLUBuilder", "FusedSwiGLUCPUBuilder", "MoEDispatchBuilder", "MoEDispatchCPUBuilder",
    "FusedAdamWClipBuilder", "FusedAdamWClipCPUBuilder", "FusedCrossEntropyBuilder", "FusedCrossEntropyCPUBuilder",
]
