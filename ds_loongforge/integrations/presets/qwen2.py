"""Qwen2 (dense): RMSNorm and SwiGLU MLP."""

from ds_loongforge.integrations.presets import FamilyPreset

PRESET = FamilyPreset(
    name="qwen2",
    modeling_module="transformers.models.qwen2.modeling_qwen2",
    rmsnorm=("Qwen2RMSNorm",),
    attention=("Qwen2Attention",),
    mlp=("Qwen2MLP",),
    rope="apply_rotary_pos_emb",
    decoder_layer="Qwen2DecoderLayer",
)
