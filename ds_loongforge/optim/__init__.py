"""Optimizers: FusedAdamWClip (AdamW + global-norm clip + non-finite skip in two device passes) and its
DeepSpeed integration (``initialize``: ``"optimizer": {"type": "LoongForgeAdamW"}`` or
``"loongforge": {"optimizer": {"fused_adamw_clip": true}}``)."""

from ds_loongforge.optim.ds_integration import (OPTIMIZER_TYPE, attach, deepspeed_config_for, deepspeed_optimizer,
                                           initialize, uses_fused_adamw_clip)
from ds_loongforge.optim.fused_adamw_clip import FusedAdamWClip

__all__ = ["FusedAdamWClip", "OPTIMIZER_TYPE", "attach", "deepspeed_config_for", "deepspeed_optimizer", "initialize",
           "uses_fused_adamw_clip"]
