"""nn.Modules built on the ops."""

from ds_loongforge.modules.moe import ExpertMaskedMoE, RoutingStats, TopKRouter
from ds_loongforge.modules.norm_mlp import FusedRMSNorm, FusedSwiGLUMLP

__all__ = ["ExpertMaskedMoE", "FusedRMSNorm", "FusedSwiGLUMLP", "RoutingStats", "TopKRouter"]
