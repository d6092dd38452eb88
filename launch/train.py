"""Train a Mixtral-style MoE language model with DeepSpeed, with or without LoongForge.

    deepspeed launch/train.py --deepspeed_config ds_configs/cpu.json            # the default job
    python launch/train.py --deepspeed_config ds_configs/cpu.json --steps 20    # one process, no launcher
    deepspeed --num_gpus 8 launch/train.py --deepspeed_config ds_configs/multi_gpu_ep.json \
        --model finegrained --dataset <hf name or path> --seq-len 2048 --steps 100

Default job (expected on a 2-core CPU, no GPU, no download): the "tiny" model (2 layers, hidden 128, 8 experts
top-2, byte vocabulary), CPython's documentation text, 120 steps of 4 x 256 tokens in about 3 minutes; the
LM loss (mean over 5 steps) falls from 5.22 to 2.75 and the final eval loss is 2.72 (seed 1234; the same
numbers under `python` and `deepspeed`).

Model: ``--model tiny | mixtral | finegrained`` (presets below; the last two are the issue's H200 benchmark
shapes) or a path to a Hugging Face config.json / model folder (one with weights, such as loongforge_export's,
starts training from them). Data: ``--dataset`` (HF dataset name or local path, ``--text-column``) else
``pydoc_data``; tokenizer: ``--tokenizer`` (HF name or path) else bytes.

Variants: LoongForge is on when the config's "loongforge" block says ``enabled: true`` (``--use-loongforge``
forces it on, ``--no-loongforge`` runs stock transformers + DeepSpeed); ``--autoep`` runs stock + DeepSpeed
AutoEP (adds ``"expert_parallel": {"enabled": true, "autoep_size": 1, "preset_model": "mixtral"}`` to the
config in memory; implies ``--no-loongforge``). On: ds_loongforge's injection replaces the MoE blocks
and RMSNorms, the optimizer follows the block (FusedAdamWClip) and, with ``loongforge.sampler.expert_aware``,
batches come from the expert-aware sampler. Off: the stock model, DeepSpeed's AdamW, a DistributedSampler. Both
train on the same objective: the LM loss + transformers' load-balancing loss (the presets set
output_router_logits and router_aux_loss_coef 0.01), plus ExpertMaskedMoE's own per-layer terms only when the
loongforge block sets moe.aux_loss_coef / z_loss_coef.

Data: real text by default; ``--data random`` trains on uniform random token ids over the model's whole vocabulary
(seeded by ``--seed``, as the e2e anchors in shared/BENCHMARKS.md ran). The presets mixtral/finegrained keep their
32000-entry embedding with the byte tokenizer (ids < 259), so FLOPs and memory match the benchmark shape.

Benchmark mode (``--timing``, used by launch/bench_e2e.py): each step's time is measured on the device's own
timeline, between CUDA events recorded at consecutive step ends (on the CPU: the host clock), and every step's loss
is kept on the device; both are read once, after the loop. The host never waits for the device inside the loop, so
it queues the next step while the current one runs, as a training run does: a step's time is the device time from
the end of the previous step to its own end, idle time included when the host falls behind (``--timing sync``
instead synchronizes at each step's end and takes the host clock: each step then also pays the host's latency to
start it, as in shared/BENCHMARKS.md's anchors). The summary adds the per-step times and losses, the median step
time over the last half of the steps, tokens/s from that median and MFU. Without it the loop itself adds no
per-step host sync either (tokens are counted on the host batch; the loss is read back only at a ``--log-every``
refresh). Peak memory (CUDA) is reported in both modes:
``peak_memory_gib`` is torch.cuda.max_memory_allocated over the whole training loop (the counter is reset when the
loop starts, after the model, engine and sampler are built), ``peak_memory_gib_after_first_step`` resets it after
step 1 (one-time allocations of the first step excluded). MFU = tokens/s x model FLOPs per token / (``--peak-
flops`` x world size); model FLOPs per token = 6 x active parameters per token (input embedding excluded, expert
parameters counted k/E) + 12 x layers x hidden x seq-len for attention scores (causal masking not discounted); None
on CPU.

ZeRO-3: with ``"zero_optimization": {"stage": 3}`` the model is built under ``deepspeed.zero.Init`` (transformers'
``from_config`` / ``from_pretrained`` under an ``HfDeepSpeedConfig``, as the HF Trainer does), so each rank holds
only its shards from the start and LoongForge's injection replaces modules one gathered module at a time;
``--no-zero-init`` builds the whole model on every rank instead and lets ``deepspeed.initialize`` partition it.

Checkpoints: ``--save-dir D --save-every N`` writes DeepSpeed checkpoints (tag ``step<N>``, plus one at the
end) and the model's config.json beside them; ``--resume`` continues from D's latest tag: weights, optimizer, step
counter and sampler position. ``loongforge_export D OUT`` writes the trained model (fp32 masters, transformers'
keys, experts of every expert-parallel rank) to a folder ``from_pretrained`` loads.
The last line on stdout (rank 0) is a JSON summary.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _corpus  # noqa: E402

logger = logging.getLogger("ds_loongforge.train")

# name -> MixtralConfig fields; vocab_size None = the tokenizer's
PRESETS = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, vocab_size=None),
    "mixtral": dict(hidden_size=2048, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=16,
                    num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000),
    "finegrained": dict(hidden_size=2048, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=16,
                        num_key_value_heads=8, num_local_experts=64, num_experts_per_tok=8, vocab_size=32000),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--deepspeed_config", "--deepspeed-config", required=True, help="DeepSpeed JSON config")
    p.add_argument("--deepspeed", action="store_true", help="accepted for DeepSpeed scripts' habit; no effect")
    p.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                   help="set by the deepspeed launcher")
    p.add_argument("--model", default="tiny",
                   help=f"preset ({', '.join(PRESETS)}), HF config path, or model folder (its weights are the start)")
    p.add_argument("--dataset", default=None, help="HF dataset name or local path (default: pydoc_data text)")
    p.add_argument("--dataset-split", default="train")
    p.add_argument("--text-column", default="text")
    p.add_argument("--max-documents", type=int, default=None, help="read at most this many documents")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer name/path (default: byte-level, no download)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=120, help="optimizer steps to reach (a resumed run counts the "
                   "steps already done)")
    p.add_argument("--eval-every", type=int, default=40, help="eval loss every N steps (0: only at the end)")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--eval-fraction", type=float, default=0.05, help="documents held out for eval")
    p.add_argument("--log-every", type=int, default=5, help="progress-bar refresh (loss read back) every N steps")
    p.add_argument("--save-dir", default=None, help="DeepSpeed checkpoint folder")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save-dir")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads per process (default: cores / local processes)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--use-loongforge", dest="loongforge", action="store_true", default=None)
    group.add_argument("--no-loongforge", dest="loongforge", action="store_false")
    zero_init = p.add_mutually_exclusive_group()
    zero_init.add_argument("--zero-init", dest="zero_init", action="store_true", default=None,
                           help="build the model partitioned, under deepspeed.zero.Init: no rank ever holds all of "
                           "its weights (the default when the config's zero_optimization.stage is 3, as in the HF "
                           "Trainer; ZeRO-3 only)")
    zero_init.add_argument("--no-zero-init", dest="zero_init", action="store_false",
                           help="at ZeRO stage 3, build the whole model on every rank and let deepspeed.initialize "
                           "partition it (each rank then needs the whole model's memory once)")
    p.add_argument("--no-expert-aware-sampler", dest="expert_aware_sampler", action="store_false",
                   help="keep the stock data order (DistributedSampler) even when the config's "
                   "loongforge.sampler.expert_aware is on: compares LoongForge's numerics with stock on the same batches")
    p.add_argument("--autoep", action="store_true",
                   help="stock model + DeepSpeed AutoEP (adds the expert_parallel block; implies --no-loongforge)")
    p.add_argument("--data", choices=("text", "random"), default="text",
                   help="text: --dataset or pydoc_data; random: seeded uniform token ids over the model's vocabulary")
    p.add_argument("--timing", nargs="?", const="events", choices=("events", "sync"), default=None,
                   help="benchmark mode: per-step times and losses, median step time over the last half, tokens/s "
                   "and MFU. events (the default): CUDA events at step ends, read after the loop, no sync in it; "
                   "sync: a device synchronize at each step's end and the host clock (the way shared/BENCHMARKS.md's "
                   "anchors were timed)")
    p.add_argument("--memory-phases", action="store_true", help="CUDA: allocated and peak memory of each phase "
                   "(forward, backward, optimizer step) of the second step in the summary (\"memory_phases\"): "
                   "where the peak is; host counters only, no sync")
    p.add_argument("--profile", action="store_true", help="ds_loongforge.profiler from the end of the first step to "
                   "the end of training: time shares of forward, backward, all-to-all, optimizer, data and idle "
                   "in the summary (\"profile\")")
    p.add_argument("--kernel-profile", type=int, default=0, metavar="N",
                   help="CUDA: torch.profiler over N steps (from step 6, or the last N): kernel time by category, "
                   "by phase (forward, loss, backward, step) and the top kernels, in the summary (\"kernels\")")
    p.add_argument("--kernel-profile-device-only", action="store_true",
                   help="with --kernel-profile: record the GPU's activities and the CUDA API calls only, not every "
                   "host op, so the host runs at its unprofiled speed and the gaps between kernels are the "
                   "unprofiled step's (no phase ranges then)")
    p.add_argument("--kernel-trace", default=None, metavar="PATH",
                   help="with --kernel-profile: write its chrome trace to PATH (.json or .json.gz) and report the "
                   "longest GPU idle gaps with the host's side of each (when the work after the gap was launched, "
                   "what the host threads did meanwhile) in the summary (\"kernels\" -> \"trace_gaps\")")
    p.add_argument("--memory-snapshot", action="store_true",
                   help="CUDA: record the allocations of step 2 and report the blocks alive at its peak, grouped by "
                   "the source line that allocated them, in the summary (\"memory_at_peak\")")
    p.add_argument("--sync-debug", action="store_true",
                   help="CUDA: count the host-device synchronizations of step 3 (torch's sync debug mode) by the "
                   "source lines that caused them, in the summary (\"host_syncs\"); a training loop should have "
                   "none but the loss read-back of --log-every steps")
    p.add_argument("--peak-flops", type=float, default=989e12,
                   help="peak dense bf16 FLOP/s per device for MFU (default 989e12: H200 SXM)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar (log lines instead)")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="torch.compile the model through DeepSpeed's engine.compile (BACKEND: inductor, the default, "
                   "or another torch.compile backend such as aot_eager); the first steps then include compiling")
    args = p.parse_args(argv)
    # a path given as --flag=~/x (or quoted) reaches us unexpanded by the shell; hub names never start with "~"
    for name in ("deepspeed_config", "model", "dataset", "tokenizer", "save_dir", "kernel_trace"):
        if getattr(args, name) is not None:
            setattr(args, name, os.path.expanduser(getattr(args, name)))
    if args.autoep:
        if args.loongforge:
            p.error("--autoep runs stock DeepSpeed AutoEP; it cannot be combined with --use-loongforge")
        args.loongforge = False
    if args.data == "random" and args.dataset:
        p.error(f"--data random generates its tokens; drop --dataset {args.dataset!r}")
    if args.peak_flops <= 0:
        p.error(f"--peak-flops must be > 0, got {args.peak_flops}")
    if args.resume and not args.save_dir:
        p.error("--resume needs --save-dir (the folder holding the checkpoints)")
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    for flag, value, least in (("--log-every", args.log_every, 1), ("--save-every", args.save_every, 0),
                               ("--eval-every", args.eval_every, 0)):
        if value < least:
            p.error(f"{flag} must be >= {least}, got {value}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    return args


# --- configuration ---------------------------------------------------------------------------------------------

AUTOEP_BLOCK = {"enabled": True, "autoep_size": 1, "preset_model": "mixtral"}
# --data random: training sequences per epoch (or one step's, if more): fixed, not sized by --steps, so that a
# run resumed with a larger --steps reads the same data (the e2e benchmark's 100 steps of 4 sequences fit in one
# epoch); every rank and variant draws the same rows from --seed
RANDOM_TRAIN_ROWS = 1024


def load_ds_config(path: str, use_loongforge: bool | None, autoep: bool = False) -> tuple[dict, bool]:
    """The DeepSpeed config with the loongforge block's ``enabled`` set from the flags; --no-loongforge also
    turns a "LoongForgeAdamW" optimizer back into DeepSpeed's AdamW; ``autoep`` adds AUTOEP_BLOCK as
    ``expert_parallel`` (stock DeepSpeed's AutoEP replaces the HF MoE blocks inside deepspeed.initialize)."""
    with open(path) as f:
        config = json.load(f)
    if autoep:
        config["expert_parallel"] = {**(config.get("expert_parallel") or {}), **AUTOEP_BLOCK}
    block = dict(config.get("loongforge") or {})
    enabled = bool(block.get("enabled", False)) if use_loongforge is None else use_loongforge
    from ds_loongforge.integrations.deepspeed_hook import ENV_DISABLE, disabled_by_env

    if enabled and disabled_by_env():  # the opt-out holds here as in any DeepSpeed script: a stock run
        logger.warning("%s=%s: LoongForge is off for this run (stock variant), whatever the config and flags say",
                       ENV_DISABLE, os.environ.get(ENV_DISABLE))
        enabled = False
    block["enabled"] = enabled
    config["loongforge"] = block
    optimizer = config.get("optimizer") or {}
    if not enabled and str(optimizer.get("type", "")).lower() == "loongforgeadamw":
        config["optimizer"] = {**optimizer, "type": "AdamW"}
    from ds_loongforge.config import parse_config

    parse_config(config)  # a malformed block fails here, naming the key
    if enabled and (config.get("expert_parallel") or {}).get("enabled"):
        raise ValueError(f"{path}: LoongForge and DeepSpeed AutoEP (expert_parallel.enabled) both replace the MoE "
                         "blocks; enable one of them (--no-loongforge runs AutoEP)")
    return config, enabled


def variant_name(ds_config: dict, use_loongforge: bool) -> str:
    if use_loongforge:
        return "loongforge"
    return "autoep" if (ds_config.get("expert_parallel") or {}).get("enabled") else "stock"


def sequences_per_step(ds_config: dict, world: int) -> int:
    """Sequences one rank consumes per optimizer step (micro-batch x accumulation), from the config alone."""
    micro = ds_config.get("train_micro_batch_size_per_gpu")
    accumulation = ds_config.get("gradient_accumulation_steps")
    if micro is None:
        if "train_batch_size" not in ds_config:
            raise ValueError("DeepSpeed config has neither train_micro_batch_size_per_gpu nor train_batch_size")
        micro = ds_config["train_batch_size"] // ((accumulation or 1) * world)
    return max(1, int(micro) * int(accumulation or 1))


# the presets' router_aux_loss_coef: transformers' load-balancing loss, the same model definition for every variant
PRESET_AUX_LOSS_COEF = 0.01


def build_model(name: str, vocab_size: int, seq_len: int) -> nn.Module:
    """The same model for every variant: the presets turn the family's load-balancing loss on
    (output_router_logits, router_aux_loss_coef 0.01); a config path keeps its own settings. LoongForge's injected
    MoE layers keep that objective (transformers computes it from their router's logits). A model folder that
    holds weights (save_pretrained's, or loongforge_export's) starts from them; a config alone from a random
    initialisation."""
    from transformers import AutoConfig, AutoModelForCausalLM, MixtralConfig
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME

    if name in PRESETS:
        fields = dict(PRESETS[name])
        fields["vocab_size"] = max(fields["vocab_size"] or 0, vocab_size)
        config = MixtralConfig(**fields, max_position_embeddings=max(seq_len, 4096), tie_word_embeddings=False,
                               router_aux_loss_coef=PRESET_AUX_LOSS_COEF, output_router_logits=True)
    elif os.path.exists(name):
        config = AutoConfig.from_pretrained(name)
        if getattr(config, "vocab_size", vocab_size) < vocab_size:
            raise ValueError(f"--model {name}: vocab_size {config.vocab_size} is smaller than the tokenizer's "
                             f"{vocab_size}")
        weights = [f for f in (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)
                   if os.path.isfile(os.path.join(name, f))]
        if weights:
            logger.info("model: weights from %s (%s)", name, weights[0])
            # from_pretrained returns the model in eval(): trained so, its routers' jitter and dropout would be off and
            # the fused loss would leave every call to transformers' full logits, until the first evaluation's train()
            return AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, attn_implementation="sdpa").train()
        logger.info("model: %s holds a config and no weights: random initialisation", name)
    else:
        raise ValueError(f"--model {name!r} is neither a preset ({', '.join(PRESETS)}) nor an existing path")
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config)


def model_flops_per_token(model: nn.Module, seq_len: int) -> tuple[float, float]:
    """(training FLOPs per token, active parameters per token) of the stock HF model: 6 x active parameters
    (input embedding excluded: a lookup, no matmul; parameters under ``.experts.`` counted k/E) + 12 x layers x
    hidden x seq_len for the attention score and value matmuls (fwd + bwd, causal mask not discounted).
    Computed before any module replacement, so every variant is charged the same FLOPs."""
    from ds_loongforge.integrations.zero3 import whole_shape

    config = model.config
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    embedding = model.get_input_embeddings().weight
    active = 0.0
    for name, param in model.named_parameters():
        if param is embedding:
            continue
        numel = whole_shape(param).numel()  # a ZeRO-3 shard's numel is its own, not the parameter's
        if ".experts." in name:
            if not experts or not top_k:
                raise ValueError(f"parameter {name} looks like an expert's but the model config gives "
                                 f"num_local_experts={experts}, num_experts_per_tok={top_k}")
            active += numel * top_k / experts
        else:
            active += numel
    attention = 12 * config.num_hidden_layers * config.hidden_size * seq_len
    return 6 * active + attention, active


def moe_layers(model: nn.Module) -> list[nn.Module]:
    from ds_loongforge.modules import ExpertMaskedMoE

    return [m for m in model.modules() if isinstance(m, ExpertMaskedMoE)]


# --- data --------------------------------------------------------------------------------------------------------

class BatchStream:
    """Endless micro-batches over epochs, with a resumable position (epoch, batches used in the epoch)."""

    def __init__(self, loader, expert_aware: bool):
        self.loader, self.expert_aware = loader, expert_aware
        self.epoch, self.consumed, self._it = 0, 0, None

    def _sampler(self):
        return self.loader.batch_sampler if self.expert_aware else self.loader.sampler

    def __next__(self):
        while True:
            if self._it is None:
                self._sampler().set_epoch(self.epoch)
                self._it = iter(self.loader)
                if not self.expert_aware and self.consumed:
                    self._it = itertools.islice(self._it, self.consumed, None)
            try:
                batch = next(self._it)
            except StopIteration:
                self.epoch, self.consumed, self._it = self.epoch + 1, 0, None
                continue
            self.consumed += 1
            return batch

    def state_dict(self, pending: int = 0) -> dict:
        """The position after the batches used so far: ``pending`` batches drawn ahead (a prefetcher's) are
        not used yet. One drawn ahead across an epoch end is the new epoch's first: the position is then
        (new epoch, 0), the same place as the end of the old one."""
        consumed = self.consumed - pending
        if consumed < 0:
            raise ValueError(f"BatchStream.state_dict: {pending} batches pending but only {self.consumed} drawn in "
                             f"epoch {self.epoch}")
        state = {"epoch": self.epoch, "consumed": consumed, "num_samples": len(self.loader.dataset)}
        if self.expert_aware:
            state["sampler"] = self.loader.batch_sampler.state_dict(consumed=consumed if self._it else None)
        return state

    def load_state_dict(self, state: dict) -> None:
        saved, have = state.get("num_samples"), len(self.loader.dataset)
        if saved is not None and saved != have:
            raise ValueError(f"--resume: the checkpoint's data position is in a training set of {saved} sequences, "
                             f"this run's has {have}; the epoch order would differ. Resume with the data options "
                             "of the run that saved it (--dataset, --max-documents, --seq-len, --eval-fraction)")
        self.epoch, self.consumed, self._it = state["epoch"], state["consumed"], None
        if self.expert_aware:
            self.loader.batch_sampler.load_state_dict(state["sampler"])

    def close(self) -> None:
        if self.expert_aware:
            self.loader.batch_sampler.close()


def data_state_for_world(state: dict, saved_world: int, world: int, warn: bool = True) -> dict:
    """A BatchStream position saved by ``saved_world`` ranks, for ``world`` ranks. Without the expert-aware
    sampler every rank reads every ``world``-th sample of the epoch's one permutation (DistributedSampler), so the
    ranks have used a prefix of it, ``saved_world * consumed`` micro-batches long: the same prefix is
    ``saved_world * consumed / world`` micro-batches a rank at the new size (rounded down when it does not divide:
    those few samples are read again, said in a warning). The expert-aware sampler's state carries its number of
    ranks: its ``load_state_dict`` deals the epoch's unused samples over the new ranks, and the position (steps
    into the epoch) stays as it is."""
    if saved_world == world or "sampler" in state:
        return state
    used = state["consumed"] * saved_world
    consumed, repeat = divmod(used, world)
    if repeat and warn:
        logger.warning("--resume at %d ranks from a checkpoint of %d: the %d micro-batches used of epoch %d do not "
                       "split over %d ranks; the last %d are read again", world, saved_world, used, state["epoch"],
                       world, repeat)
    return {**state, "consumed": consumed}


def build_train_stream(dataset, ds_config, model, micro_batch, rank, world, expert_aware, pad_id,
                       pin_memory: bool = False) -> BatchStream:
    """``pin_memory`` (CUDA runs): page-locked host batches, so the non_blocking device copy is asynchronous."""
    from torch.utils.data import DataLoader, DistributedSampler

    from ds_loongforge.data import PadCollator, build_dataloader

    if expert_aware:
        loader = build_dataloader(dataset, ds_config, model, micro_batch, rank, world, pad_token_id=pad_id,
                                  drop_last=True, pin_memory=pin_memory)
    else:
        seed = (ds_config.get("loongforge", {}).get("sampler") or {}).get("seed", 0)
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True)
        loader = DataLoader(dataset, batch_size=micro_batch, sampler=sampler, drop_last=True,
                            collate_fn=PadCollator(pad_id, pad_to_multiple_of=8), pin_memory=pin_memory)
    return BatchStream(loader, expert_aware)


def device_batches(stream: BatchStream, device: torch.device):
    """THE one place where training batches move to the device: ds_loongforge's DevicePrefetcher copies the
    next (pinned) batch on a side stream while the current step computes. Yields (device batch, real tokens);
    the tokens are counted on the host batch before the copy (summing the device mask would block the host
    on the device every micro-step), and a batch without padding goes without its attention mask (below). The
    prefetcher holds at most one batch ahead (``pending``): the saved data position subtracts it."""
    from ds_loongforge.data import DevicePrefetcher

    def host_batches():
        while True:
            batch = next(stream)
            mask = batch["attention_mask"]
            real = int(mask.sum())
            if real == mask.numel():
                # No padding: to a causal LM an all-ones mask is no mask, and a mask given to transformers is read
                # back to the host (its SDPA mask path checks padding_mask.all() to drop it): one host sync per
                # forward, which empties the GPU's queue and leaves the forward's small kernels launch-bound.
                # The host knows the answer already; the model gets no mask (the same math, the same losses).
                batch = {key: value for key, value in batch.items() if key != "attention_mask"}
            yield batch, real

    return DevicePrefetcher(host_batches(), device)


# --- loop --------------------------------------------------------------------------------------------------------

def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)


def forward_losses(engine, batch, layers, annotate=contextlib.nullcontext, fused_loss=False):
    """(language-model loss, auxiliary loss); training backpropagates their sum.

    The auxiliary loss is the family's load-balancing loss (transformers' ``aux_loss`` x router_aux_loss_coef, when
    the model config's output_router_logits is on) plus the terms LoongForge's MoE layers add (none unless the
    loongforge block sets moe.aux_loss_coef / z_loss_coef). ``fused_loss``: the model computes the loss from the
    labels (LoongForge's fused linear cross-entropy: no logits), the same shifted mean over the non-ignored
    tokens, with the family's aux term already added as transformers adds it; it is taken out again for the
    language-model loss this returns (the sum, and so the gradient, is the model's loss)."""
    with annotate("forward"):
        if fused_loss:
            out = engine(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                         labels=batch["labels"])
        else:
            out = engine(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"))
    with annotate("loss"):
        family_aux = None
        if getattr(out, "aux_loss", None) is not None:
            family_aux = engine.module.config.router_aux_loss_coef * out.aux_loss
        if not fused_loss:
            loss = lm_loss(out.logits, batch["labels"])
        elif family_aux is not None:
            loss = out.loss - family_aux
        else:
            loss = out.loss
        aux = family_aux if family_aux is not None else torch.zeros((), device=loss.device)
        ours = [m.aux_loss for m in layers if m.aux_loss is not None]
        if ours:
            aux = aux + sum(ours)
    return loss, aux


@torch.no_grad()
def evaluate(engine, eval_batches, device) -> float:
    engine.eval()
    total, count = torch.zeros((), device=device), torch.zeros((), device=device)
    for batch in eval_batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        out = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        n = (batch["labels"][:, 1:] != -100).sum()
        total += lm_loss(out.logits, batch["labels"]) * n
        count += n
    if dist.is_initialized():
        stats = torch.stack([total, count])
        dist.all_reduce(stats)
        total, count = stats[0], stats[1]
    engine.train()
    return float(total / count)


def routing_summary(layers) -> dict:
    sums = [m.last_routing.summary() for m in layers if m.last_routing is not None]
    if not sums:
        return {}
    mean = lambda key: sum(s[key] for s in sums) / len(sums)  # noqa: E731
    return {"sparsity": mean("pair_sparsity"), "idle": mean("idle_expert_fraction"),
            "load": mean("max_over_mean_load")}


def annotate_model_parts(model: nn.Module) -> list:
    """Profiler ranges inside the forward for --kernel-profile: "attention" (each decoder layer's self_attn),
    "mlp" (its MLP or MoE block) and, nested in it, "router" (the MoE block's gate), so the profile gives
    each part's kernel time and the host's time to issue it. Returns the hook handles to remove."""
    from ds_loongforge.diagnostics import annotate_modules

    parts: dict[str, list] = {"attention": [], "mlp": [], "router": []}
    for name, module in model.named_modules():
        *parent, leaf = name.split(".")
        if leaf == "self_attn":
            parts["attention"].append(module)
        elif leaf in ("mlp", "block_sparse_moe"):
            parts["mlp"].append(module)
        elif leaf == "gate" and parent and parent[-1] in ("mlp", "block_sparse_moe"):
            parts["router"].append(module)
    return annotate_modules(parts)


def _export_trace_gaps(prof, path: str) -> list:
    """--kernel-trace: the profile's chrome trace at ``path``, and its longest idle gaps (diagnostics.trace_gaps)."""
    import gzip

    from ds_loongforge.diagnostics import format_trace_gaps, trace_gaps

    prof.export_chrome_trace(path)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        gaps = trace_gaps(json.load(f), top=6)
    logger.info("longest GPU idle gaps of the profiled steps (trace in %s):\n%s", path, format_trace_gaps(gaps))
    return gaps


def kernel_profile_window(n: int, start_step: int, steps: int) -> tuple[int, int] | None:
    """First and last step that --kernel-profile N records: from step 6 (op loading, warm-up and the sampler's
    first refresh behind), or the last N steps of a shorter run; never the first step (the step before the
    window is the profiler's warm-up, traced and dropped)."""
    if n <= 0:
        return None
    first = max(start_step + 2, min(start_step + 6, steps - n + 1))
    last = min(steps, first + n - 1)
    return (first, last) if first <= last else None


def _step_mark(cuda: bool):
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _step_times(marks: list, cuda: bool) -> list[float]:
    """Seconds between consecutive step-end marks (the first mark is the loop's start)."""
    if cuda:
        marks[-1].synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
    return [b - a for a, b in zip(marks, marks[1:])]


def step_timing(step_times: list[float], step_tokens: list[int], flops_per_token: float,
                total_peak_flops: float | None) -> dict:
    """Summary fields of --timing: the median step time over the last half of the steps (100 steps -> the
    last 50), tokens/s from it and MFU against ``total_peak_flops`` (None: not a CUDA run). Empty lists (no
    --timing) give None everywhere."""
    import statistics

    fields = {"step_times": [round(t, 6) for t in step_times], "median_step_s_last_half": None,
              "tokens_per_s_median": None, "mfu": None}
    if not step_times:
        return fields
    half = len(step_times) // 2
    median = statistics.median(step_times[half:])
    tokens_per_step = statistics.fmean(step_tokens[half:])
    fields["median_step_s_last_half"] = median
    fields["tokens_per_s_median"] = tokens_per_step / median
    if total_peak_flops:
        fields["mfu"] = fields["tokens_per_s_median"] * flops_per_token / total_peak_flops
    return fields


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    started = time.perf_counter()
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "RANK" not in os.environ:  # `python launch/train.py`: a world of one process
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))

    import deepspeed
    from deepspeed.accelerator import get_accelerator

    ds_config, use_lf = load_ds_config(args.deepspeed_config, args.loongforge, autoep=args.autoep)
    from ds_loongforge.optim.ds_integration import zero_section

    stage = int(zero_section(ds_config).get("stage", 0))  # as deepspeed_hook reads it ("3" is stage 3 too)
    if args.zero_init and stage != 3:  # before any process group or model is made
        raise ValueError(f"--zero-init builds the model partitioned for ZeRO stage 3; {args.deepspeed_config} has "
                         f'"zero_optimization": {{"stage": {stage}}}. Drop --zero-init or set the stage to 3')
    zero_init = stage == 3 if args.zero_init is None else args.zero_init
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", world)))
    if get_accelerator().device_name() == "cpu":
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // max(1, local_world)))
    if rank != 0:  # one copy of the logs (ds_loongforge sets its own logger's level)
        for name in ("", "ds_loongforge"):
            logging.getLogger(name).setLevel(logging.WARNING)
    device = torch.device(get_accelerator().device_name(args.local_rank))
    if device.type != "cpu":
        get_accelerator().set_device(args.local_rank)

    from ds_loongforge import profiler
    from ds_loongforge.config import parse_config
    from ds_loongforge.integrations.fused_loss import uses_fused_loss
    from ds_loongforge.integrations.zero3 import whole_shape

    block = parse_config(ds_config)
    variant = variant_name(ds_config, use_lf)
    tokenizer = _corpus.build_tokenizer(args.tokenizer)
    if zero_init:
        from transformers.integrations import HfDeepSpeedConfig

        # what the HF Trainer does at ZeRO-3: transformers' from_config / from_pretrained then build the model
        # under deepspeed.zero.Init (and load weights into its shards). transformers holds this object only by a
        # weak reference, so this local keeps it alive for the run
        hf_ds_config = HfDeepSpeedConfig(ds_config)  # noqa: F841
    torch.manual_seed(args.seed)
    model = build_model(args.model, tokenizer.vocab_size, args.seq_len)
    if zero_init:
        logger.info("model: built partitioned under deepspeed.zero.Init (ZeRO stage 3; --no-zero-init builds it "
                    "whole on every rank)")
    model_vocab = whole_shape(model.get_input_embeddings().weight)[0]
    flops_per_token, active_params = model_flops_per_token(model, args.seq_len)
    experts_impl = getattr(model.config, "_experts_implementation", None)

    if args.data == "random":
        per_step = sequences_per_step(ds_config, world)
        # a corpus that does not depend on --steps: a run resumed with more steps continues on the same data
        corpus = _corpus.random_tokens(model_vocab, args.seq_len, num_train=max(RANDOM_TRAIN_ROWS, per_step * world),
                                       num_eval=max(1, args.eval_batches) * per_step * world, seed=args.seed)
    else:
        if args.dataset:
            documents = _corpus.dataset_documents(args.dataset, args.text_column, args.dataset_split,
                                                  args.max_documents)
            source = args.dataset
        else:
            documents = _corpus.pydoc_documents()[:args.max_documents]
            source = "pydoc_data.topics (CPython documentation)"
        corpus = _corpus.pack(documents, tokenizer, args.seq_len, args.eval_fraction, source)
    corpus = _corpus.with_tensor_rows(corpus)
    logger.info("data: %s, %d train + %d eval sequences of %d tokens (%s tokenizer, vocab %d; model vocab %d)",
                corpus.source, len(corpus.train), len(corpus.eval), args.seq_len, tokenizer.name,
                tokenizer.vocab_size, model_vocab)
    if use_lf:
        from ds_loongforge.integrations.inject import inject

        inject(model, ds_config)  # logs one line per replaced kind and what was not replaced
    layers = moe_layers(model)
    fused_loss = use_lf and uses_fused_loss(model)
    num_params = sum(whole_shape(p).numel() for p in model.parameters())
    logger.info("model: %s (%s), %.2fM parameters (%.2fM active per token, %.3g training FLOPs per token), "
                "variant %s", args.model, type(model).__name__, num_params / 1e6, active_params / 1e6,
                flops_per_token, variant)

    params = [p for p in model.parameters() if p.requires_grad]
    if any(getattr(p, "allreduce", True) is False for p in params):
        from ds_loongforge.modules.moe_deepspeed import moe_param_groups

        params = moe_param_groups(model)  # ZeRO needs the expert parameters in their own groups
    try:
        from ds_loongforge.optim import initialize
    except ImportError:
        initialize = deepspeed.initialize
    engine, _, _, _ = initialize(model=model, model_parameters=params, config=ds_config)
    if args.compile:
        engine.compile(backend=args.compile)
    micro_batch, accumulation = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()

    expert_aware = use_lf and block.sampler.expert_aware and bool(layers) and args.expert_aware_sampler
    stream = build_train_stream(corpus.train, ds_config, engine.module, micro_batch, rank, world, expert_aware,
                                tokenizer.pad_token_id, pin_memory=device.type == "cuda")
    from torch.utils.data import DataLoader

    from ds_loongforge.data import PadCollator

    # every rank the same number of rows, so the same number of eval forwards: under expert parallelism each
    # forward is a collective of the expert-parallel group, and a rank with one batch more waits in it forever
    per_rank = min(len(corpus.eval) // world, max(1, args.eval_batches) * micro_batch)
    if per_rank == 0:
        raise ValueError(f"the held-out set has {len(corpus.eval)} sequences for {world} ranks (at least one each "
                         "is needed): raise --eval-fraction or --max-documents")
    eval_rows = corpus.eval[rank::world][:per_rank]
    eval_batches = list(DataLoader(eval_rows, batch_size=micro_batch,
                                   collate_fn=PadCollator(tokenizer.pad_token_id, pad_to_multiple_of=8)))

    start_step = 0
    if args.resume:
        path, client = engine.load_checkpoint(args.save_dir)
        if path is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {args.save_dir} (no 'latest' file)")
        start_step = client["step"]
        stream.load_state_dict(data_state_for_world(client["data"], client.get("world", world), world,
                                                    warn=rank == 0))
        logger.info("resumed from %s at step %d (epoch %d, batch %d)", path, start_step, stream.epoch,
                    stream.consumed)

    batches = device_batches(stream, device)

    def save(step: int) -> None:
        engine.save_checkpoint(args.save_dir, tag=f"step{step}",
                               client_state={"step": step, "world": world,
                                             "data": stream.state_dict(pending=batches.pending)})
        if rank == 0:  # beside 'latest': loongforge_export writes a folder from_pretrained loads
            engine.module.config.save_pretrained(args.save_dir)

    from tqdm import tqdm

    bar = tqdm(total=args.steps, initial=start_step, disable=rank != 0 or args.no_progress, dynamic_ncols=True,
               desc="train", file=sys.stderr)
    bf16 = engine.bfloat16_enabled()
    history, eval_loss, tokens, loop_start = [], None, 0, time.perf_counter()
    steady_start, steady_tokens = None, 0  # from the end of the first step: op loading and warm-up excluded
    window_tokens, window_start = 0, loop_start
    loss_acc = torch.zeros((), device=device)
    cuda = device.type == "cuda"
    step_times, step_tokens, peak_first_step = [], [], None
    memory_phases, phase_peak = [], 0

    def memory_mark(phase: str) -> None:
        """Allocated now and the peak since the last mark (then reset); host counters, no device sync."""
        nonlocal phase_peak
        peak = torch.cuda.max_memory_allocated(device)
        phase_peak = max(phase_peak, peak)
        memory_phases.append({"phase": phase, "allocated_gib": torch.cuda.memory_allocated(device) / 2**30,
                              "peak_gib": peak / 2**30})
        torch.cuda.reset_peak_memory_stats(device)

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    step_ends, step_losses = [], []  # --timing: CUDA events (host times on the CPU) at step ends; device losses
    if args.timing:
        if args.timing == "sync":
            get_accelerator().synchronize()
        step_ends.append(_step_mark(cuda and args.timing == "events"))
    kernel_window = kernel_profile_window(args.kernel_profile, start_step, args.steps) if cuda else None
    annotate, kernel_prof, kernels, memory_at_peak = contextlib.nullcontext, None, None, None
    module_ranges: list = []  # --kernel-profile: hooks that put model parts in profiler ranges
    sync_step = min(start_step + 3, args.steps) if cuda and args.sync_debug else None
    sync_recorder, host_syncs = None, None
    step = start_step
    for step in range(start_step + 1, args.steps + 1):
        tokens_this_step, step_loss = 0, 0.0
        probe = cuda and args.memory_phases and step == start_step + 2
        snapshot = cuda and args.memory_snapshot and step == start_step + 2
        if snapshot:
            snapshot_baseline = torch.cuda.memory_allocated(device)
            torch.cuda.memory._record_memory_history(stacks="python", max_entries=4_000_000)
        if step == sync_step:
            from ds_loongforge.diagnostics import HostSyncRecorder

            sync_recorder = HostSyncRecorder().__enter__()
        if kernel_window and step == kernel_window[0] - 1:
            get_accelerator().synchronize()
            activities = [torch.profiler.ProfilerActivity.CUDA]
            if not args.kernel_profile_device_only:
                activities.insert(0, torch.profiler.ProfilerActivity.CPU)
            # this step is the profiler's warm-up (traced, then dropped): it starts after the synchronize with
            # the host no longer ahead of the GPU, and takes the profiler's first buffer requests (~3 ms on the
            # H200 host), so its gaps are not the training loop's; the recorded steps start with the host ahead
            kernel_prof = torch.profiler.profile(activities=activities, schedule=torch.profiler.schedule(
                wait=0, warmup=1, active=kernel_window[1] - kernel_window[0] + 1, repeat=1))
            kernel_prof.__enter__()
            annotate = torch.profiler.record_function
            module_ranges = annotate_model_parts(engine.module)
        for micro in range(accumulation):
            with annotate("data"):
                batch, real = next(batches)
            if probe:
                memory_mark(f"until forward {micro}")
            loss, aux = forward_losses(engine, batch, layers, annotate, fused_loss)
            if probe:
                memory_mark(f"forward {micro}")
            with annotate("backward"):
                engine.backward(loss + aux)
            if probe:
                memory_mark(f"backward {micro}")
            with annotate("step"):
                engine.step()
            if probe:
                memory_mark(f"step {micro}")
            step_loss = step_loss + loss.detach().float() / accumulation
            tokens_this_step += real * world
        loss_acc += step_loss
        if args.timing:  # benchmark mode: an event and the loss stay on the device until the loop ends
            if args.timing == "sync":
                get_accelerator().synchronize()
            step_ends.append(_step_mark(cuda and args.timing == "events"))
            step_losses.append(step_loss)
        if snapshot:
            from ds_loongforge.diagnostics import format_memory_at_peak, memory_at_peak as at_peak

            memory_at_peak = at_peak(torch.cuda.memory._snapshot(), device.index or 0, snapshot_baseline)
            torch.cuda.memory._record_memory_history(enabled=None)
            if rank == 0:
                logger.info("memory at the peak of step %d:\n%s", step, format_memory_at_peak(memory_at_peak))
        if kernel_prof is not None:
            if step == kernel_window[1]:
                get_accelerator().synchronize()  # every recorded kernel finished before the trace stops
            kernel_prof.step()
        if kernel_window and step == kernel_window[1]:
            from ds_loongforge.diagnostics import format_kernel_timeline, kernel_timeline

            kernel_prof.__exit__(None, None, None)
            annotate = contextlib.nullcontext
            for handle in module_ranges:
                handle.remove()
            kernels = kernel_timeline(kernel_prof, iters=kernel_window[1] - kernel_window[0] + 1, top=40)
            kernels["steps"] = list(kernel_window)
            if args.kernel_trace and rank == 0:
                kernels["trace_gaps"] = _export_trace_gaps(kernel_prof, args.kernel_trace)
            kernel_prof = None
            if rank == 0:
                logger.info("kernels of steps %d..%d:\n%s", *kernel_window, format_kernel_timeline(kernels))
        step_tokens.append(tokens_this_step)
        tokens += tokens_this_step
        window_tokens += tokens_this_step
        steady_tokens += tokens_this_step if steady_start is not None else 0
        if cuda and peak_first_step is None:
            peak_first_step = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        if step % args.log_every == 0 or step == args.steps:
            if dist.is_initialized():
                dist.all_reduce(loss_acc)
                loss_acc /= world
            now = time.perf_counter()
            value = float(loss_acc) / (step - (history[-1][0] if history else start_step))
            history.append((step, value))
            postfix = {"loss": f"{value:.3f}", "tok/s": f"{window_tokens / (now - window_start):.0f}"}
            postfix.update({k: f"{v:.2f}" for k, v in routing_summary(layers).items()})
            bar.set_postfix(postfix, refresh=False)
            if args.no_progress and rank == 0:
                logger.info("step %d %s", step, " ".join(f"{k}={v}" for k, v in postfix.items()))
            loss_acc.zero_()
            window_tokens, window_start = 0, now
        if sync_recorder is not None:
            sync_recorder.__exit__(None, None, None)
            host_syncs = {"step": step, **sync_recorder.summary()}
            sync_recorder = None
            if rank == 0:
                logger.info("host syncs in step %d: %d\n%s", step, host_syncs["count"],
                            "\n".join(f"  {s['count']:4d}  {s['where']}" for s in host_syncs["sites"]))
        bar.update(1)
        if steady_start is None:
            steady_start = time.perf_counter()
            if args.profile and step < args.steps:  # op loading and warm-up excluded, like the steady tokens/s
                profiler.start(engine)
        if args.profile and step > start_step + 1:
            profiler.record_tokens(tokens_this_step // world)
        if args.eval_every and step % args.eval_every == 0 and step != args.steps:
            eval_loss = evaluate(engine, eval_batches, device)
            if rank == 0:
                bar.write(f"step {step}: eval loss {eval_loss:.4f}")
        if args.save_dir and args.save_every and step % args.save_every == 0:
            save(step)
    bar.close()
    if args.timing:
        step_times = _step_times(step_ends, cuda and args.timing == "events")
        step_losses = torch.stack(step_losses).tolist() if step_losses else []
    profile = None
    if args.profile:
        if profiler.is_active():
            report = profiler.stop()
            profile = report.as_dict()
            if rank == 0:
                logger.info("profile (steps 2..%d):\n%s", step, report.format())
    loop_end = time.perf_counter()
    elapsed = loop_end - loop_start
    peak_after_first = (max(torch.cuda.max_memory_allocated(device), phase_peak)
                        if cuda and step > start_step + 1 else None)
    timing = step_timing(step_times, step_tokens, flops_per_token, args.peak_flops * world if cuda else None)
    steady_seconds = loop_end - steady_start if steady_start is not None else 0.0
    eval_loss = evaluate(engine, eval_batches, device)
    if args.save_dir and (not args.save_every or step % args.save_every):
        save(step)
    stream.close()
    summary = {
        "steps": step, "start_step": start_step, "final_loss": history[-1][1] if history else None,
        "eval_loss": eval_loss, "tokens_per_s": tokens / elapsed if elapsed > 0 else None,
        "tokens_per_s_after_first_step": steady_tokens / steady_seconds if steady_tokens else None,
        "loss_history": history, "tokens": tokens, "train_seconds": round(elapsed, 2),
        "total_seconds": round(time.perf_counter() - started, 2), "model": args.model, "params": num_params,
        "loongforge": use_lf, "expert_aware_sampler": expert_aware, "expert_masked_layers": len(layers),
        "fused_loss": fused_loss,
        "world_size": world, "micro_batch": micro_batch, "seq_len": args.seq_len, "bf16": bf16,
        "zero_stage": engine.zero_optimization_stage(), "zero_init": zero_init,
        "optimizer": type(engine.basic_optimizer).__name__,
        "routing": routing_summary(layers), "profile": profile,
        "variant": variant, "data": args.data, "dataset": args.dataset, "device": device.type, "experts_implementation": experts_impl,
        "vocab_size": model_vocab, "active_params_per_token": active_params, "model_flops_per_token": flops_per_token,
        "peak_flops": args.peak_flops if cuda else None, "timing": args.timing, **timing,
        "peak_memory_gib": (max(peak_first_step, peak_after_first or 0) / 2**30) if peak_first_step is not None
        else None,
        "peak_memory_gib_after_first_step": peak_after_first / 2**30 if peak_after_first is not None else None,
        "memory_phases": memory_phases, "kernels": kernels, "memory_at_peak": memory_at_peak,
        "host_syncs": host_syncs,
        "step_losses": [round(v, 6) for v in step_losses],
    }
    if rank == 0:
        print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    from ds_loongforge.op_builder.builder import environment_ninja

    # DeepSpeed JIT-builds ops of its own on the way (its CPU all-reduce, its FusedAdam): with the environment's
    # ninja for those too, an activated run and an unactivated one share their cache (README "Install")
    with environment_ninja():
        main()
