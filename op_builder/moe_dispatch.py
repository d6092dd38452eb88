"""Builders of the fused MoE dispatch op family: permute / unpermute, forward and backward, and the routing
indices, and the router's softmax + top-k (csrc/moe_dispatch)."""

from .builder import LFCPUOpBuilder, LFCUDAOpBuilder


class MoEDispatchBuilder(LFCUDAOpBuilder):
    NAME = "lf_moe_dispatch"
    BUILD_VAR = "LF_BUILD_MOE_DISPATCH"
    SOURCES = ("moe_dispatch/moe_dispatch.cu", "moe_dispatch/moe_routing.cu", "moe_dispatch/moe_router.cu",
               "moe_dispatch/moe_dispatch_binding.cpp")


class MoEDispatchCPUBuilder(LFCPUOpBuilder):
    NAME = "lf_moe_dispatch_cpu"
    BUILD_VAR = "LF_BUILD_MOE_DISPATCH"
    SOURCES = ("moe_dispatch/moe_dispatch_cpu.cpp", "moe_dispatch/moe_routing_cpu.cpp",
               "moe_dispatch/moe_router_cpu.cpp", "moe_dispatch/moe_dispatch_binding.cpp")
