"""The ``"loongforge"`` block of a DeepSpeed config, as a pydantic model (field docs are user docs).

This holds the sections whose features exist; later features add theirs. Unknown keys are errors, so a
typo never silently turns an optimization off.
"""

from __future__ import annotations

import difflib
import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class _Section(BaseModel):
    # strict: a JSON config gives true/false, numbers and strings as they are meant; "no", 0 or "2" are errors (in
    # lax mode "no" would pass as false and "yes" as true); floats also take integers. No inf or nan anywhere.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)


class FusedKernelsConfig(_Section):
    rmsnorm: bool = Field(True, description="Replace RMSNorm modules with the fused RMSNorm kernel.")
    swiglu: bool = Field(True, description="Replace SwiGLU MLPs with one gate_up GEMM + the fused SwiGLU(+dropout) kernel.")
    qkv: bool = Field(True, strict=True, description="Compute each attention's q_proj, k_proj and v_proj with one "
                      "GEMM over their concatenated weights (ds_loongforge.modules.qkv; the three Linears, their "
                      "Parameters and state-dict keys stay). Any call the fused product cannot serve runs the "
                      "Linear alone.")
    residual_add: bool = Field(True, strict=True, description="Fuse each decoder layer's residual adds: the one "
                               "after the attention into its post-attention RMSNorm, the MLP's into "
                               "ExpertMaskedMoE's combine (a dense MLP keeps its add), and the residual stream's "
                               "gradient sums into the norms' backward kernels (ds_loongforge.integrations.residual; "
                               "needs fused_kernels.rmsnorm). The layer is re-classed; its forward is the family's "
                               "own with three steps rewritten, or left alone if it differs.")
    rope: bool = Field(True, strict=True, description="Replace the family's rotary embedding function with "
                       "Liger-Kernel's fused RoPE on CUDA (process-wide patch of "
                       "modeling_<family>.apply_rotary_pos_emb; needs liger-kernel). CPU tensors and inputs Liger "
                       "cannot take still run transformers' function.")
    rounding: Literal["stock", "once"] = Field("stock", description="Where the fused RMSNorm, SwiGLU and MoE "
                                               "combine kernels round to a 16-bit activation dtype. stock: where "
                                               "transformers' modules and their autograd round (RMSNorm rounds "
                                               "x * rstd before the weight, SwiGLU silu(gate) before up, an MoE "
                                               "block its fp32 k-sum before the decoder layer's residual add), so "
                                               "these modules compute stock's numbers up to fp32 summation order; "
                                               "once: fp32 to each output, rounded once (closer to exact, different "
                                               "from stock). Both cost the same on the H200 (SwiGLU at p = 0, RMSNorm, "
                                               "the MoE combine; SwiGLU with dropout ~4% more under stock). fp32 "
                                               "models compute the same under both.")
    linear_cross_entropy: bool = Field(True, strict=True, description="Compute a causal LM's training loss with the "
                                       "fused LM head + cross-entropy (ds_loongforge.ops.linear_cross_entropy: "
                                       "chunked, no full logits or fp32 copy of them). Training forwards with "
                                       "labels then return logits=None (the loss, and the MoE aux loss, are as "
                                       "transformers computes them); forwards without labels, in eval mode or "
                                       "without grad are unchanged.")


# a standalone ExpertMaskedMoE built from the section (layer_kwargs) when the block leaves the coefficients unset
STANDALONE_AUX_LOSS_COEF = 0.01
STANDALONE_Z_LOSS_COEF = 0.001


class MoEConfig(_Section):
    expert_masked: bool = Field(True, description="Replace MoE blocks with ExpertMaskedMoE (only experts that got "
                                "tokens compute; dropless).")
    router: Literal["topk", "sampled"] = Field("topk", description="topk: the K most probable experts. sampled: "
                                               "K experts drawn without replacement from the softmax in training, "
                                               "top-k in eval.")
    aux_loss_coef: float | None = Field(
        None, ge=0, description="Coefficient of ExpertMaskedMoE's own Switch/GShard load-balancing loss (per layer). "
        "None (the default): a transformers model given to inject keeps its family's own balancing loss "
        "(transformers computes it from the router logits when the model config's output_router_logits is on, "
        "scaled by router_aux_loss_coef), exactly as the stock model trains, and ExpertMaskedMoE adds none; a "
        "standalone layer built from this section uses 0.01. A number: ExpertMaskedMoE adds its "
        "per-layer loss with this coefficient (on top of the family's, if the model config has that on).")
    z_loss_coef: float | None = Field(
        None, ge=0, description="Coefficient of the router z-loss. None (the default): none for an injected "
        "transformers model (the supported families have no z-loss), 0.001 for a standalone layer.")
    sync_free_balancing_loss: bool = Field(
        True, strict=True, description="Replace the family's load_balancing_loss_func (transformers computes it "
        "when output_router_logits is on) with LoongForge's: the same value with no host-device sync "
        "(transformers' makes the host wait for the GPU in every forward; ds_loongforge.integrations."
        "balancing_loss). Process-wide patch of modeling_<family>.load_balancing_loss_func, installed only where "
        "the family's function passes a value check.")
    ep_size: int = Field(1, ge=1, description="Expert-parallel group size; must divide the world size and the "
                         "number of experts.")
    all_to_all_buffer_factor: float = Field(1.2, gt=0, description="Receive buffers start at ceil(factor * tokens "
                                            "* k / ep_size) rows.")
    buffer_warmup_steps: int = Field(500, ge=0, description="Forwards over which buffers calibrate to the observed "
                                     "peak; later growth warns once. Every forward of an MoE layer counts: eval "
                                     "batches, and the backward's recompute under activation checkpointing (which "
                                     "then ends warm-up after about half as many training steps).")
    buffer_growth: float = Field(0.2, gt=0, description="Fraction by which a buffer grows when a step would "
                                 "overflow it (never a dropped token).")
    overlap_chunks: int = Field(2, ge=1, description="Expert parallel: local experts are split into this many "
                                "groups, each sent by its own async all-to-all, so experts start on chunk 0 "
                                "while chunk 1 is in flight (capped at the number of local experts; 1 = no "
                                "overlap).")

    def layer_kwargs(self) -> dict[str, Any]:
        """The ExpertMaskedMoE keyword arguments this section sets."""
        return {"router_mode": self.router,
                "aux_loss_coef": STANDALONE_AUX_LOSS_COEF if self.aux_loss_coef is None else self.aux_loss_coef,
                "z_loss_coef": STANDALONE_Z_LOSS_COEF if self.z_loss_coef is None else self.z_loss_coef,
                "all_to_all_buffer_factor": self.all_to_all_buffer_factor,
                "buffer_warmup_steps": self.buffer_warmup_steps, "buffer_growth": self.buffer_growth,
                "overlap_chunks": self.overlap_chunks}


class SamplerConfig(_Section):
    expert_aware: bool = Field(True, description="Draw training batches with ExpertAwareSampler (expert load kept "
                               "near uniform from batch to batch) instead of a random DistributedSampler.")
    n_clusters: int = Field(16, ge=1, description="Buckets (MiniBatchKMeans clusters) of routing signatures; at most "
                            "the number of samples.")
    refresh_every: int = Field(1000, ge=0, description="Recompute signatures from the current router weights every "
                               "this many batches, in a background thread on CPU copies of the weights (0 = never).")
    signature: Literal["router", "router_topk", "probe", "forward"] = Field(
        "router", description="router: mean over a sample's tokens of softmax(embedding @ router.T) per MoE layer. "
        "router_topk: expected top-k counts from the same logits. probe: a small MLP fitted on routing observed "
        "in forwards of a few batches. forward: each sample's actual top-k routing in a no-grad forward of the "
        "model over the whole dataset (most accurate; costs one forward pass over the dataset per refresh, which "
        "on the GPU competes with training: use a larger refresh_every).")
    pad_to_multiple_of: int = Field(128, ge=1, description="The collator pads each batch's length up to a multiple "
                                    "of this.")
    seed: int = Field(0, ge=0, le=2**32 - 1,
                      description="Shuffling and clustering seed (the same on every rank), in [0, 2**32 - 1] as "
                                  "scikit-learn's k-means takes it.")
    cache_dir: str | None = Field(None, description="Where signatures are cached (default "
                                  "$LOONGFORGE_CACHE/signatures or ~/.cache/ds_loongforge/signatures).")


class OptimizerConfig(_Section):
    fused_adamw_clip: bool = Field(False, description="Build the optimizer as ds_loongforge.optim.FusedAdamWClip "
                                   "(AdamW + global-norm clip + inf/nan skip in two device passes) from DeepSpeed's "
                                   "\"optimizer\" params and \"gradient_clipping\"; see "
                                   "ds_loongforge.optim.deepspeed_optimizer. \"optimizer\": {\"type\": "
                                   "\"LoongForgeAdamW\"} selects it too.")


class ProfilerConfig(_Section):
    enabled: bool = Field(False, description="Start ds_loongforge.profiler on the engine that initialize builds: "
                          "time shares of forward, backward, all_to_all, optimizer, data and idle (CUDA events, "
                          "read lazily) and tokens/s; profiler.stop() returns the report. Off, nothing is wrapped "
                          "and nothing is measured.")
    report_every: int = Field(0, ge=0, description="Log the report of every this many optimizer steps through the "
                              "ds_loongforge logger (waits for the device once per report; 0 = only on demand: "
                              "profiler.stop() / profiler.get_training_stats()).")

    @model_validator(mode="after")
    def _report_needs_the_profiler(self):
        if self.report_every and not self.enabled:
            raise ValueError(f"report_every={self.report_every} reports nothing while enabled is false: set "
                             "\"enabled\": true to profile, or drop report_every")
        return self


class LoongForgeConfig(_Section):
    enabled: bool = Field(False, description="Master switch: nothing is changed unless this is true.")
    strict_ops: bool = Field(
        False,
        description="Raise when a fused op cannot be built instead of warning once and running its PyTorch "
        "reference. The environment variable LOONGFORGE_STRICT_OPS=1 does the same.")
    async_throughput_timer: bool = Field(
        True, strict=True, description="DeepSpeed's throughput timer (on by default) synchronizes the device at the "
        "start of every forward and the end of every step (timers.throughput.synchronized, default true): two "
        "host waits per step, each emptying the GPU's queue, after which the host must launch the next kernels "
        "ahead of the GPU again. True: when the DeepSpeed config does not set timers.throughput.synchronized "
        "itself, initialize sets it to false (the timer keeps its samples/s log, from host time). A value the "
        "DeepSpeed config sets is kept either way.")
    fused_kernels: FusedKernelsConfig = Field(default_factory=FusedKernelsConfig,
                                              description="Which fused kernels to use.")
    moe: MoEConfig = Field(default_factory=MoEConfig, description="The expert-masked MoE layer.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="The fused optimizer step.")
    sampler: SamplerConfig = Field(default_factory=SamplerConfig, description="The expert-aware batch sampler "
                                   "(ds_loongforge.data.build_dataloader).")
    profiler: ProfilerConfig = Field(default_factory=ProfilerConfig, description="The training-loop profiler "
                                     "(ds_loongforge.profiler).")


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
            message = e["msg"]
            if e["type"] == "extra_forbidden":
                message = _unknown_key_message(e["loc"])
            problems.append(f"{key} = {e.get('input')!r}: {message}")
        raise LoongForgeConfigError("invalid \"loongforge\" config:\n  " + "\n  ".join(problems)) from None


def _unknown_key_message(loc: tuple) -> str:
    """What to say about an unknown key at ``loc``: the keys its section allows, and the closest one."""
    section: type[BaseModel] = LoongForgeConfig
    for part in loc[:-1]:
        field = section.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return "unknown key"
        section = annotation
    allowed = list(section.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    where = "loongforge." + ".".join(str(p) for p in loc[:-1]) if len(loc) > 1 else "loongforge"
    return f"unknown key; {hint}{where} allows {', '.join(allowed)}"


def apply_op_settings(config: LoongForgeConfig) -> None:
    """Make the op layer follow the block (strict_ops)."""
    from ds_loongforge.ops._dispatch import set_strict_ops

    set_strict_ops(True if config.strict_ops else None)


def throughput_timer_setting(ds_config: dict[str, Any], config: LoongForgeConfig | None = None) -> dict[str, Any]:
    """The DeepSpeed config to pass on: when the block is enabled with ``async_throughput_timer`` (the default)
    and the DeepSpeed config leaves ``timers.throughput.synchronized`` unset, a copy with it set to false
    (DeepSpeed's default, true, synchronizes the device twice per step: LoongForgeConfig.async_throughput_timer);
    otherwise ``ds_config`` itself. The caller's dict is never modified, and a config that went through it once
    passes unchanged (initialize applies it, then ds_loongforge.optim.initialize again). ``config``: the parsed
    block (parsed from ``ds_config`` when not given)."""
    config = parse_config(ds_config) if config is None else config
    timers = ds_config.get("timers") or {}
    throughput = timers.get("throughput") or {}
    if (not config.enabled or not config.async_throughput_timer or throughput.get("enabled") is False
            or "synchronized" in throughput):  # set: the user's choice, or ours from an earlier call (one log)
        return ds_config
    logging.getLogger("ds_loongforge").info("[LoongForge] DeepSpeed throughput timer: no device synchronize at each forward and step "
             "(timers.throughput.synchronized=false; set it in the DeepSpeed config to choose)")
    return {**ds_config, "timers": {**timers, "throughput": {**throughput, "synchronized": False}}}
