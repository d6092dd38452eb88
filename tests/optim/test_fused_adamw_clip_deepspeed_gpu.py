"""FusedAdamWClip inside DeepSpeed on one GPU (gpu marker): fp16 with the device-side dynamic loss scale
(ZeRO-2, ZeRO-3, and ZeRO-0 which runs as ZeRO-1) against stock DeepSpeed fp16 at the same stage (torch AdamW,
its host loss scaler and clip) with a nan step in the middle, under an LR schedule that a skipped step must not
advance, and no host synchronisation inside engine.step() (bf16 and fp16, ZeRO-2 and ZeRO-3).
DeepSpeed has no fp16 on the CPU accelerator here, so these run only on the GPU."""

import logging
import os
import warnings

import pytest
import torch
from torch import nn

import deepspeed  # noqa: E402

from tests._dist import spawn_with_deadline

pytestmark = pytest.mark.gpu

IN, HID, OUT, ROWS, STEPS, NAN_STEP, CLIP, LR = 64, 256, 32, 16, 12, 5, 0.5, 1e-3
RUNS = [(2, "fp16", True), (2, "fp16", False), (0, "fp16", True), (2, "bf16", True),
        (3, "fp16", True), (3, "fp16", False), (3, "bf16", True)]  # (ZeRO stage, precision, FusedAdamWClip)


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, OUT))


def _config(stage, precision, ours):
    config = {"train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": 1, "gradient_clipping": CLIP,
              "zero_optimization": {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})},
              "steps_per_print": 10**9,
              "optimizer": {"type": "LoongForgeAdamW" if ours else "AdamW",
                            "params": {"lr": LR, "weight_decay": 0.01, "betas": [0.9, 0.95]}}}
    if not ours:
        config["optimizer"]["params"]["torch_adam"] = True  # no FusedAdam JIT build in a test
    # a schedule that moves every step: DeepSpeed steps it only after a step it did not skip
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR,
                                                          "warmup_num_steps": 2 * STEPS, "warmup_type": "linear"}}
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 3, "hysteresis": 1}
    else:
        config["bf16"] = {"enabled": True}
    return config


def _worker(rank, world, port, seed, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="nccl", verbose=False)
    from ds_loongforge.optim import initialize
    from ds_loongforge.optim.ds_integration import DeviceLossScaler

    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(ROWS, IN, generator=g), torch.randn(ROWS, OUT, generator=g)) for _ in range(STEPS)]
    data[NAN_STEP][0][0, 0] = float("nan")
    results = {}
    for stage, precision, ours in RUNS:
        model = _model(seed)
        engine, *_ = initialize(model=model, model_parameters=model.parameters(),
                                config=_config(stage, precision, ours))
        dtype = torch.float16 if precision == "fp16" else torch.bfloat16
        scales, syncs, lrs = [], [], []
        if ours:  # the lr each update takes (a skipped step's schedule step is undone inside the next step())
            from tests.optim.test_fused_adamw_clip_deepspeed import record_update_lrs

            lrs = record_update_lrs(engine.basic_optimizer)
        for step, (x, y) in enumerate(data):
            loss = (engine(x.cuda().to(dtype)).float() - y.cuda()).pow(2).mean()
            engine.backward(loss)
            if not ours:  # DeepSpeed's step takes the lr the groups hold now
                lrs.append([group["lr"] for group in engine.basic_optimizer.param_groups])
            if ours and step > 0:  # the first step builds the optimizer's tensor tables
                torch.cuda.synchronize()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        engine.step()
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                syncs += [f"{w.filename}:{w.lineno} {str(w.message)[:120]}" for w in caught
                          if "called a synchronizing" in str(w.message)]  # not the mode's own prototype notice
            else:
                engine.step()
            scales.append(float(engine.optimizer.loss_scale) if precision == "fp16" else 1.0)
        if ours:
            assert engine.zero_optimization_stage() == (1 if stage == 0 else stage)
            if precision == "fp16":
                assert isinstance(engine.optimizer.loss_scaler, DeviceLossScaler)
        with deepspeed.zero.GatheredParameters(list(model.parameters())):  # ZeRO-3: gathered; else a no-op
            params = [p.detach().float().cpu() for p in model.parameters()]
        results[(stage, precision, ours)] = {"scales": scales, "syncs": syncs, "skipped": engine.skipped_steps,
                                             "lrs": lrs, "params": params}
        del engine
    torch.save(results, f"{out_dir}/gpu.pt")


def test_fp16_device_loss_scale_and_no_host_sync_in_step(tmp_path):
    seed = int(torch.randint(0, 2**31, ()))
    spawn_with_deadline(_worker, 1, seed, str(tmp_path), timeout_s=300)
    results = torch.load(tmp_path / "gpu.pt", weights_only=False)
    for key in [(2, "fp16", True), (0, "fp16", True), (3, "fp16", True)]:
        ours, stock = results[key], results[(3 if key[0] == 3 else 2, "fp16", False)]
        # the same loss-scale history as DeepSpeed's host scaler: halved at the nan step, doubled every 3 clean
        assert ours["scales"] == stock["scales"], (key, ours["scales"], stock["scales"])
        assert stock["scales"][NAN_STEP] == stock["scales"][NAN_STEP - 1] / 2
        assert ours["skipped"] == stock["skipped"] == 1
        # the LR schedule of the skipped step is undone before the next update takes its lr: DeepSpeed's lrs
        assert ours["lrs"] == stock["lrs"], (key, ours["lrs"], stock["lrs"])
        assert stock["lrs"][NAN_STEP + 1] == stock["lrs"][NAN_STEP]
        diff = torch.cat([(a - b).flatten() for a, b in zip(ours["params"], stock["params"])])
        # fp16 params: both step fp32 masters; the updates agree to fp16 rounding
        assert (diff.abs() <= 2e-3).float().mean() >= 0.95, (key, diff.abs().max())
    for key in [k for k in RUNS if k[2]]:
        assert results[key]["syncs"] == [], (key, results[key]["syncs"])
    assert results[(2, "bf16", True)]["skipped"] == results[(3, "bf16", True)]["skipped"] == 1
