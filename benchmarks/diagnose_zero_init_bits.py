"""Why a bf16 model loaded under ``deepspeed.zero.Init`` trains to other bits on the GPU than the same checkpoint
loaded whole (tests/integrations/test_config_only.py's zero.Init test, one GPU, Session 23), while fp32 and the
CPU match bit for bit.

The tiny Mixtral of that test (bf16 and fp32, ZeRO-3, the loongforge block, 3 AdamW steps) is trained four ways per
setting: loaded whole twice, and under zero.Init twice. Settings: as the test runs; flash attention off (SDPA's
flash backward accumulates dQ with atomics, and it runs for bf16 only); torch's deterministic algorithms on
(CUBLAS_WORKSPACE_CONFIG=:4096:8 set before CUDA starts). If "whole vs whole" already differs, the difference is
run-to-run nondeterminism of the GPU path, not zero.Init. Each comparison also names what differs in the start
state (every parameter gathered, every buffer, with dtypes) and the first module whose output differs in the first
forward.

Found (H100, b649750): run-to-run bits are equal in every setting; the one start-state difference is the rotary
``inv_freq`` / ``original_inv_freq`` buffers, bf16 under zero.Init on the GPU and fp32 in a whole load (1.2e-4 apart),
and the first output that differs is layer 0's attention (``o_proj``). The CPU keeps them fp32 either way. The test
now gives its whole load zero.Init's buffer dtypes and asserts bits on the GPU too.

    python -m benchmarks.diagnose_zero_init_bits --out diagnose_zero_init_bits.json   (one GPU, or the CPU with DS_ACCELERATOR=cpu;
    MASTER_ADDR etc. set)
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # needed by the deterministic setting, harmless else


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import deepspeed
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    import ds_loongforge

    deepspeed.init_distributed()
    here = tempfile.mkdtemp()
    torch.manual_seed(0)
    MixtralForCausalLM(MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64)).save_pretrained(here)
    torch.manual_seed(1)
    from deepspeed.accelerator import get_accelerator

    batches = torch.randint(0, 64, (3, 2, 16)).to(get_accelerator().current_device_name())

    def train(dtype: str, zero_init: bool) -> tuple[list[float], dict]:
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 2,
                  "loongforge": {"enabled": True}, dtype: {"enabled": True}, "gradient_clipping": 1.0,
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
        hf_config = HfDeepSpeedConfig(config) if zero_init else None
        model = MixtralForCausalLM.from_pretrained(here).train()  # from_pretrained returns eval(); trained as the test
        del hf_config
        engine, *_ = ds_loongforge.initialize(model=model, config=config)  # the config-only path's call
        # what the first step starts from: every parameter (gathered) and buffer, with its dtype
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            start = {f"param {n}": (str(p.dtype), p.detach().float().cpu().clone())
                     for n, p in engine.module.named_parameters()}
        start.update({f"buffer {n}": (str(b.dtype), b.detach().float().cpu().clone())
                      for n, b in engine.module.named_buffers()})
        # every module's first tensor output in the first forward, in call order
        outputs, hooks = [], []
        for n, m in engine.module.named_modules():
            def hook(mod, inp, out, n=n):
                t = out[0] if isinstance(out, (tuple, list)) else getattr(out, "logits", out)
                if torch.is_tensor(t):
                    outputs.append((n or "<model>", str(t.dtype), t.detach().float().cpu().clone()))
            hooks.append(m.register_forward_hook(hook))
        losses = []
        for ids in batches:
            loss = engine(input_ids=ids, labels=ids).loss
            for h in hooks:
                h.remove()
            hooks = []
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            weights = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
        return losses, weights, start, outputs

    def compare(a, b) -> dict:
        (la, wa, sa, oa), (lb, wb, sb, ob) = a, b
        differing = [n for n in wa if not torch.equal(wa[n], wb[n])]
        # the start state: entries only one side has, dtypes that differ, values that differ
        start = {"only_one_side": sorted(set(sa) ^ set(sb)),
                 "dtype_differs": {n: [sa[n][0], sb[n][0]] for n in sa if n in sb and sa[n][0] != sb[n][0]},
                 "value_differs": {n: float((sa[n][1] - sb[n][1]).abs().max()) for n in sa
                                   if n in sb and (sa[n][1].shape != sb[n][1].shape or not torch.equal(sa[n][1], sb[n][1]))}}
        # the first module (in call order) whose output differs, and the dtypes of both sides there
        first = None
        for (na, da, ta), (nb, db, tb) in zip(oa, ob):
            if na != nb or ta.shape != tb.shape or not torch.equal(ta, tb):
                first = {"module": [na, nb], "dtype": [da, db], "max_difference":
                         float((ta - tb).abs().max()) if ta.shape == tb.shape else f"shapes {list(ta.shape)} {list(tb.shape)}"}
                break
        return {"losses_equal": la == lb, "first_loss_equal": la[0] == lb[0], "losses": [la, lb],
                "weights_differing": len(differing), "of": len(wa),
                "max_difference": max(float((wa[n] - wb[n]).abs().max()) for n in wa),
                "start_state": start, "modules_called": [len(oa), len(ob)], "first_output_differing": first}

    settings = {
        "as_tested": lambda: None,
        "flash_off": lambda: torch.backends.cuda.enable_flash_sdp(False),
        "deterministic": lambda: torch.use_deterministic_algorithms(True),
    }
    out = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__}
    for name, apply in settings.items():
        apply()
        for dtype in ("bf16", "fp32"):
            try:
                runs = {(zi, k): train(dtype, zi) for zi in (False, True) for k in (0, 1)}
            except Exception as e:  # a setting that cannot run (an op without a deterministic kernel) says which
                out[f"{name} {dtype}"] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
                continue
            out[f"{name} {dtype}"] = {"whole_vs_whole": compare(runs[False, 0], runs[False, 1]),
                                      "zero_init_vs_zero_init": compare(runs[True, 0], runs[True, 1]),
                                      "whole_vs_zero_init": compare(runs[False, 0], runs[True, 0])}
            print(name, dtype, json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "losses"}
                                           for k, v in out[f"{name} {dtype}"].items()}), flush=True)
    torch.use_deterministic_algorithms(False)
    torch.backends.cuda.enable_flash_sdp(True)
    text = json.dumps(out, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
