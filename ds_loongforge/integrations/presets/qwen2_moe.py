"""Qwen2-MoE: softmax top-k router (renormalised if norm_topk_prob), plus a shared expert whose output is
scaled by sigmoid(shared_expert_gate(x)). Dense layers (mlp_only_layers) use Qwen2MoeMLP."""

from ds_loongforge.integrations.presets import FamilyPreset, MoESpec

PRESET = FamilyPreset(
    name="qwen2_moe",
    modeling_module="transformers.models.qwen2_moe.modeling_qwen2_moe",
    rmsnorm=("Qwen2MoeRMSNorm",),
    attention=("Qwen2MoeAttention",),
    mlp=("Qwen2MoeMLP",),
    moe=MoESpec(block="Qwen2MoeSparseMoeBlock", router="softmax_topk", shared_expert="shared_expert",
                shared_expert_gate="shared_expert_gate", weights_in_input_dtype=True),
    rope="apply_rotary_pos_emb",
    decoder_layer="Qwen2MoeDecoderLayer",
)
