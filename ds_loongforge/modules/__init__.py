"""nn.Modules built on the ops."""

from ds_loongforge.modules.norm_mlp import FusedRMSNorm, FusedSwiGLUMLP

__all__ = ["FusedRMSNorm", "FusedSwiGLUMLP"]
