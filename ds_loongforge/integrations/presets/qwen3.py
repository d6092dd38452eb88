"""Qwen3 (dense): RMSNorm (also the q/k norms over the head dimension) and SwiGLU MLP."""

from ds_loongforge.integrations.presets import FamilyPreset

PRESET = FamilyPreset(
    name="qwen3",
    modeling_module="transformers.models.qwen3.modeling_qwen3",
    rmsnorm=("Qwen3RMSNorm",),
    attention=("Qwen3Attention",),
    mlp=("Qwen3MLP",),
    rope="apply_rotary_pos_emb",
    decoder_layer="Qwen3DecoderLayer",
)
