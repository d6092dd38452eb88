"""Train a Mixtral-style MoE language model with DeepSpeed, with or without LoongForge.

    deepspeed launch/train.py --deepspeed_config ds_configs/cpu.json            # the default job
    python launch/train.py --deepspeed_config ds_configs/cpu.json --steps 20    # one process, no launcher
    deepspeed --num_gpus 8 launch/train.py --deepspeed_config ds_configs/multi_gpu_ep.json \
        --model finegrained --dataset <hf name or path> --seq-len 2048 --steps 100

Default job (expected on a 2-core CPU, no GPU, no download): the "tiny" model (2 layers, hidden 128, 8 experts
top-2, byte vocabulary), CPython's documentation text, 120 steps of 4 x 256 tokens in 1.5-2.5 minutes; the
LM loss (mean over 5 steps) falls from 5.22 to 2.56 and the final eval loss is 2.74 (seed 1234; the same
numbers under `python` and `deepspeed`).

Model: ``--model tiny | mixtral | finegrained`` (presets below; the last two are the issue's H200 benchmark
shapes) or a path to a Hugging Face config.json / model folder. Data: ``--dataset`` (HF dataset name or local
path, ``--text-column``) else ``pydoc_data``; tokenizer: ``--tokenizer`` (HF name or path) else bytes.

LoongForge: on when the config's "loongforge" block says ``enabled: true`` (``--use-loongforge`` forces it on,
``--no-loongforge`` runs stock transformers + DeepSpeed). On: ds_loongforge's injection replaces the MoE blocks
and RMSNorms, the layers' aux losses (load balancing + z-loss) are added to the LM loss, the optimizer follows
the block (FusedAdamWClip) and, with ``loongforge.sampler.expert_aware``, batches come from the expert-aware
sampler. Off: the stock model with transformers' own load-balancing loss (router_aux_loss_coef), torch AdamW
through DeepSpeed, a DistributedSampler.

Checkpoints: ``--save-dir D --save-every N`` writes DeepSpeed checkpoints (tag ``step<N>``, plus one at the
end); ``--resume`` continues from D's latest tag: weights, optimizer, step counter and sampler position.
The last line on stdout (rank 0) is a JSON summary.
"""

from __future__ import annotations

import argparse
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
    p.add_argument("--model", default="tiny", help=f"preset ({', '.join(PRESETS)}) or HF config path")
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
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar (log lines instead)")
    args = p.parse_args(argv)
    if args.resume and not args.save_dir:
        p.error("--resume needs --save-dir (the folder holding the checkpoints)")
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    return args


# --- configuration ---------------------------------------------------------------------------------------------

def load_ds_config(path: str, use_loongforge: bool | None) -> tuple[dict, bool]:
    """The DeepSpeed config with the loongforge block's ``enabled`` set from the flags; --no-loongforge also
    turns a "LoongForgeAdamW" optimizer back into DeepSpeed's AdamW."""
    with open(path) as f:
        config = json.load(f)
    block = dict(config.get("loongforge") or {})
    enabled = bool(block.get("enabled", False)) if use_loongforge is None else use_loongforge
    block["enabled"] = enabled
    config["loongforge"] = block
    optimizer = config.get("optimizer") or {}
    if not enabled and str(optimizer.get("type", "")).lower() == "loongforgeadamw":
        config["optimizer"] = {**optimizer, "type": "AdamW"}
    from ds_loongforge.config import parse_config

    parse_config(config)  # a malformed block fails here, naming the key
    return config, enabled


def build_model(name: str, vocab_size: int, seq_len: int, aux_loss_coef: float, stock: bool) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, MixtralConfig

    if name in PRESETS:
        fields = dict(PRESETS[name])
        fields["vocab_size"] = max(fields["vocab_size"] or 0, vocab_size)
        config = MixtralConfig(**fields, max_position_embeddings=max(seq_len, 4096), tie_word_embeddings=False,
                               router_aux_loss_coef=aux_loss_coef, output_router_logits=stock)
    elif os.path.exists(name):
        config = AutoConfig.from_pretrained(name)
        if getattr(config, "vocab_size", vocab_size) < vocab_size:
            raise ValueError(f"--model {name}: vocab_size {config.vocab_size} is smaller than the tokenizer's "
                             f"{vocab_size}")
        if hasattr(config, "output_router_logits"):
            config.output_router_logits = stock
    else:
        raise ValueError(f"--model {name!r} is neither a preset ({', '.join(PRESETS)}) nor an existing path")
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config)


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

    def state_dict(self) -> dict:
        state = {"epoch": self.epoch, "consumed": self.consumed}
        if self.expert_aware:
            state["sampler"] = self.loader.batch_sampler.state_dict(consumed=self.consumed if self._it else None)
        return state

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.consumed, self._it = state["epoch"], state["consumed"], None
        if self.expert_aware:
            self.loader.batch_sampler.load_state_dict(state["sampler"])

    def close(self) -> None:
        if self.expert_aware:
            self.loader.batch_sampler.close()


def build_train_stream(dataset, ds_config, model, micro_batch, rank, world, expert_aware, pad_id) -> BatchStream:
    from torch.utils.data import DataLoader, DistributedSampler

    from ds_loongforge.data import PadCollator, build_dataloader

    if expert_aware:
        loader = build_dataloader(dataset, ds_config, model, micro_batch, rank, world, pad_token_id=pad_id,
                                  drop_last=True)
    else:
        seed = (ds_config.get("loongforge", {}).get("sampler") or {}).get("seed", 0)
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True)
        loader = DataLoader(dataset, batch_size=micro_batch, sampler=sampler, drop_last=True,
                            collate_fn=PadCollator(pad_id, pad_to_multiple_of=8))
    return BatchStream(loader, expert_aware)


# --- loop --------------------------------------------------------------------------------------------------------

def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)


def forward_losses(engine, batch, layers, stock_aux_coef):
    out = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    loss = lm_loss(out.logits, batch["labels"])
    if layers:
        aux = sum(m.aux_loss for m in layers if m.aux_loss is not None)
    elif getattr(out, "aux_loss", None) is not None:
        aux = stock_aux_coef * out.aux_loss
    else:
        aux = torch.zeros((), device=loss.device)
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

    ds_config, use_lf = load_ds_config(args.deepspeed_config, args.loongforge)
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

    from ds_loongforge.config import parse_config

    block = parse_config(ds_config)
    tokenizer = _corpus.build_tokenizer(args.tokenizer)
    if args.dataset:
        documents = _corpus.dataset_documents(args.dataset, args.text_column, args.dataset_split, args.max_documents)
        source = args.dataset
    else:
        documents = _corpus.pydoc_documents()[:args.max_documents]
        source = "pydoc_data.topics (CPython documentation)"
    corpus = _corpus.pack(documents, tokenizer, args.seq_len, args.eval_fraction, source)
    logger.info("data: %s, %d train + %d eval sequences of %d tokens (%s tokenizer, vocab %d)", corpus.source,
                len(corpus.train), len(corpus.eval), args.seq_len, tokenizer.name, tokenizer.vocab_size)

    torch.manual_seed(args.seed)
    model = build_model(args.model, tokenizer.vocab_size, args.seq_len, block.moe.aux_loss_coef, stock=not use_lf)
    if use_lf:
        from ds_loongforge.integrations.inject import inject

        inject(model, ds_config)  # logs one line per replaced kind and what was not replaced
    layers = moe_layers(model)
    num_params = sum(p.numel() for p in model.parameters())
    logger.info("model: %s (%s), %.2fM parameters, LoongForge %s", args.model, type(model).__name__,
                num_params / 1e6, "on" if use_lf else "off")

    params = [p for p in model.parameters() if p.requires_grad]
    if any(getattr(p, "allreduce", True) is False for p in params):
        from ds_loongforge.modules.moe_deepspeed import moe_param_groups

        params = moe_param_groups(model)  # ZeRO needs the expert parameters in their own groups
    try:
        from ds_loongforge.optim import initialize
    except ImportError:
        initialize = deepspeed.initialize
    engine, _, _, _ = initialize(model=model, model_parameters=params, config=ds_config)
    micro_batch, accumulation = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()

    expert_aware = use_lf and block.sampler.expert_aware and bool(layers)
    stream = build_train_stream(corpus.train, ds_config, engine.module, micro_batch, rank, world, expert_aware,
                                tokenizer.pad_token_id)
    from torch.utils.data import DataLoader

    from ds_loongforge.data import PadCollator

    eval_rows = corpus.eval[rank::world][:args.eval_batches * micro_batch] or corpus.eval[:micro_batch]
    eval_batches = list(DataLoader(eval_rows, batch_size=micro_batch,
                                   collate_fn=PadCollator(tokenizer.pad_token_id, pad_to_multiple_of=8)))

    start_step = 0
    if args.resume:
        path, client = engine.load_checkpoint(args.save_dir)
        if path is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {args.save_dir} (no 'latest' file)")
        start_step = client["step"]
        stream.load_state_dict(client["data"])
        logger.info("resumed from %s at step %d (epoch %d, batch %d)", path, start_step, stream.epoch,
                    stream.consumed)

    def save(step: int) -> None:
        engine.save_checkpoint(args.save_dir, tag=f"step{step}",
                               client_state={"step": step, "data": stream.state_dict()})

    from tqdm import tqdm

    bar = tqdm(total=args.steps, initial=start_step, disable=rank != 0 or args.no_progress, dynamic_ncols=True,
               desc="train", file=sys.stderr)
    bf16 = engine.bfloat16_enabled()
    history, eval_loss, tokens, loop_start = [], None, 0, time.perf_counter()
    steady_start, steady_tokens = None, 0  # from the end of the first step: op loading and warm-up excluded
    window_tokens, window_start = 0, loop_start
    loss_acc = torch.zeros((), device=device)
    step = start_step
    for step in range(start_step + 1, args.steps + 1):
        for _ in range(accumulation):
            batch = {k: v.to(device, non_blocking=True) for k, v in next(stream).items()}
            loss, aux = forward_losses(engine, batch, layers, block.moe.aux_loss_coef)
            engine.backward(loss + aux)
            engine.step()
            loss_acc += loss.detach().float() / accumulation
            real = int(batch["attention_mask"].sum()) * world
            tokens += real
            window_tokens += real
            steady_tokens += real if steady_start is not None else 0
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
        bar.update(1)
        if steady_start is None:
            steady_start = time.perf_counter()
        if args.eval_every and step % args.eval_every == 0 and step != args.steps:
            eval_loss = evaluate(engine, eval_batches, device)
            if rank == 0:
                bar.write(f"step {step}: eval loss {eval_loss:.4f}")
        if args.save_dir and args.save_every and step % args.save_every == 0:
            save(step)
    bar.close()
    loop_end = time.perf_counter()
    elapsed = loop_end - loop_start
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
        "loongforge": use_lf, "expert_aware_sampler": expert_aware, "moe_layers": len(layers),
        "world_size": world, "micro_batch": micro_batch, "seq_len": args.seq_len, "bf16": bf16,
        "zero_stage": engine.zero_optimization_stage(), "optimizer": type(engine.basic_optimizer).__name__,
        "routing": routing_summary(layers),
    }
    if rank == 0:
        print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
