"""The ``"loongforge"`` block of a DeepSpeed config, as a pydantic model (field docs are user docs).

This holds the sections whose features exist; later features add theirs. Unknown keys are errors, so a
typo never silently turns an optimization off.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class FusedKernelsConfig(_Section):
    rmsnorm: bool = Field(True, description="Replace RMSNorm modules with the fused RMSNorm kernel.")
    swiglu: bool = Field(True, description="Replace SwiGLU MLPs with one gate_up GEMM + the fused SwiGLU(+dropout) kernel.")


class LoongForgeConfig(_Section):
    enabled: bool = Field(False, description="Master switch: nothing is changed unless this is true.")
    strict_ops: bool = Field(
        False,
        description="Raise when a fused op cannot be built instead of warning once and running its PyTorch "
        "reference. The environment variable LOONGFORGE_STRICT_OPS=1 does the same.")
    fused_kernels: FusedKernelsConfig = Field(default_factory=FusedKernelsConfig,
                                              description="Which fused kernels to use.")


class LoongForgeConfigError(ValueError):
    """The block is malformed; the message names each offending key, its value and what is allowed."""


def parse_config(ds_config: dict[str, Any] | None) -> LoongForgeConfig:
    """Read the ``"loongforge"`` block of a DeepSpeed config dict (absent block = disabled)."""
    block = (ds_config or {}).get("loongforge", {})
    if not isinstance(block, dict):
        raise LoongForgeConfigError(f'"loongforge" must be a JSON object, got {type(block).__name__}: {block!r}')
    try:
        return LoongForgeConfig.model_validate(block)
    except ValidationError as err:
        problems = []
        for e in err.errors():
            key = "loongforge." + ".".join(str(p) for p in e["loc"])
            problems.append(f"{key} = {e.get('input')!r}: {e['msg']}")
        raise LoongForgeConfigError("invalid \"loongforge\" config:\n  " + "\n  ".join(problems)) from None


def apply_op_settings(config: LoongForgeConfig) -> None:
    """Make the op layer follow the block (strict_ops)."""
    from ds_loongforge.ops._dispatch import set_strict_ops

    set_strict_ops(True if config.strict_ops else None)
