"""Qwen3-MoE: softmax top-k router (renormalised if norm_topk_prob); no shared expert. The q/k norms over
the head dimension are the same RMSNorm class."""

from ds_loongforge.integrations.presets import FamilyPreset, MoESpec

PRESET = FamilyPreset(
    name="qwen3_moe",
    modeling_module="transformers.models.qwen3_moe.modeling_qwen3_moe",
    rmsnorm=("Qwen3MoeRMSNorm",),
    attention=("Qwen3MoeAttention",),
    mlp=("Qwen3MoeMLP",),
    moe=MoESpec(block="Qwen3MoeSparseMoeBlock", router="softmax_topk", weights_in_input_dtype=True),
    rope="apply_rotary_pos_emb",
    decoder_layer="Qwen3MoeDecoderLayer",
)
