"""Config-only enablement: unmodified scripts that call ``deepspeed.initialize`` (directly, through the HF
Trainer, or through a plain accelerate script) get LoongForge's modules from the config's ``"loongforge"`` block
alone, via the installed ``loongforge_autoload.pth``. Each script runs in its own process (the hook acts at
interpreter start), on DeepSpeed's CPU accelerator, as one rank or two; the single-rank DeepSpeed runs go in
parallel to keep the file short.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from tests._params import adam_first_step_excess

TIMEOUT_S = 600  # generous: on a loaded CI machine DeepSpeed JIT-builds its CPU comm op on first use

MODEL_SNIPPET = """
import json, sys
import torch
from transformers import MixtralConfig, MixtralForCausalLM

torch.manual_seed(0)
model = MixtralForCausalLM(MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                         num_experts_per_tok=2, max_position_embeddings=64))


def report(module, optimizer, engine=None):
    model_params = {id(p) for p in module.parameters()}
    opt_params = [p for g in optimizer.param_groups for p in g["params"]]
    timer_sync = engine.tput_timer.config.synchronized if engine is not None else None
    print("RESULT " + json.dumps({"types": sorted({type(m).__name__ for m in module.modules()}),
                                  "optimizer_params_in_model": all(id(p) in model_params for p in opt_params),
                                  "timer_synchronized": timer_sync}))


def leave():
    # DeepSpeed leaves its gloo process group up; tearing it down at interpreter exit aborted in CI ("terminate
    # called without an active exception", exit -6) after RESULT was printed: the Trainer script in about one run
    # in four on a 2-core machine, and the plain DeepSpeed script once at d084b73 (a C++ thread of the CPU comm
    # stack still joinable at exit). Everything these tests check is printed by then, so leave without the teardown
    import os
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
"""

# a plain DeepSpeed script: its own optimizer, one training step
DEEPSPEED_SCRIPT = MODEL_SNIPPET + """
import deepspeed

optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=sys.argv[1])
ids = torch.randint(0, 64, (2, 16))
engine.backward(engine(input_ids=ids, labels=ids).loss)
engine.step()
report(engine.module, engine.optimizer, engine)
leave()
"""

# a script launched as `deepspeed script.py --deepspeed --deepspeed_config cfg.json`: the config comes from args,
# DeepSpeed builds the optimizer from the config and the loader from training_data
DEEPSPEED_CLI_SCRIPT = MODEL_SNIPPET + """
import argparse
import deepspeed

parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
parser.add_argument("--local_rank", type=int, default=0)
args = parser.parse_args()
data = [{"input_ids": ids} for ids in torch.randint(0, 64, (32, 16))]
engine, optimizer, loader, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                                    training_data=data)
batch = next(iter(loader))
engine.backward(engine(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss)
engine.step()
print("LOADER", type(loader.batch_sampler).__name__, "OPTIMIZER", type(optimizer).__name__)
report(engine.module, optimizer, engine)
leave()
"""

# the HF Trainer with --deepspeed: it builds its optimizer before calling deepspeed.initialize (via accelerate);
# two steps, saving as SAVE_ARGS says
TRAINER_RUN = MODEL_SNIPPET + """
from transformers import Trainer, TrainingArguments

data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (8, 16))]
args = TrainingArguments(output_dir=sys.argv[2], deepspeed=sys.argv[1], max_steps=2, per_device_train_batch_size=2,
                         learning_rate=1e-3, report_to=[], use_cpu=True, SAVE_ARGS)
trainer = Trainer(model=model, args=args, train_dataset=data)
trainer.train()
engine = trainer.model_wrapped
"""

TRAINER_SCRIPT = TRAINER_RUN.replace("SAVE_ARGS", 'save_strategy="no"') + """
print("OPTIMIZER " + json.dumps({"type": type(engine.basic_optimizer).__name__,
                                 "lrs": [g["lr"] for g in engine.basic_optimizer.param_groups],
                                 "weight_decays": [g["weight_decay"] for g in engine.basic_optimizer.param_groups],
                                 "scheduler_lrs": trainer.lr_scheduler.get_last_lr()}))
report(engine.module, trainer.optimizer, engine)
leave()
"""

# the HF Trainer with its torch_compile argument (argv[3] == "1"): the engine compiles the injected model
TRAINER_COMPILE_SCRIPT = TRAINER_RUN.replace(
    "SAVE_ARGS", 'save_strategy="no", logging_steps=1, torch_compile=sys.argv[3] == "1"') + """
print("TRAINED " + json.dumps({"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                               "compiled": bool(getattr(engine, "is_compiled", False))}))
report(engine.module, trainer.optimizer, engine)
leave()
"""

# the HF Trainer on 2 ranks with expert parallelism, saving a checkpoint; each rank also saves DeepSpeed's own
# assembly of its fp32 masters, which the exported checkpoint must equal
TRAINER_EP_SCRIPT = TRAINER_RUN.replace("SAVE_ARGS", 'save_strategy="steps", save_steps=2') + """
from deepspeed.utils import safe_get_full_fp32_param

masters = {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}
ep_rank = next(m.ep_rank for m in engine.module.modules() if type(m).__name__ == "DeepSpeedExpertMaskedMoE")
torch.save({"masters": masters, "ep_rank": ep_rank}, f"{sys.argv[2]}/masters{torch.distributed.get_rank()}.pt")
print("OPTIMIZER " + json.dumps({"type": type(engine.basic_optimizer).__name__,
                                 "moe": [bool(g.get("moe")) for g in engine.basic_optimizer.param_groups],
                                 "lrs": [g["lr"] for g in engine.basic_optimizer.param_groups],
                                 "scheduler_lrs": trainer.lr_scheduler.get_last_lr()}))
report(engine.module, trainer.optimizer, engine)
leave()
"""

# the HF Trainer resuming TRAINER_EP_SCRIPT's checkpoint-2 on 4 ranks at another ep_size: each rank saves its fp32
# masters as the first resumed step begins (after the Trainer's load, before any update)
TRAINER_RESUME_SCRIPT = TRAINER_RUN.replace("max_steps=2", "max_steps=3").replace(
    "SAVE_ARGS", 'save_strategy="no"').replace("trainer.train()", """
from transformers import TrainerCallback
from deepspeed.utils import safe_get_full_fp32_param


class FirstStep(TrainerCallback):
    done = False

    def on_step_begin(self, args, state, control, **kwargs):
        if not self.done:
            self.done = True
            module = trainer.model_wrapped.module
            ep_rank = next(m.ep_rank for m in module.modules() if type(m).__name__ == "DeepSpeedExpertMaskedMoE")
            torch.save({"masters": {n: safe_get_full_fp32_param(p) for n, p in module.named_parameters()},
                        "ep_rank": ep_rank, "step": state.global_step},
                       f"{sys.argv[2]}/resumed{torch.distributed.get_rank()}.pt")


trainer.add_callback(FirstStep())
trainer.train(resume_from_checkpoint=sys.argv[3])""") + """
print("RESUMED " + json.dumps({"step": trainer.state.global_step}))
leave()
"""

# the HF Trainer over a linear schedule of 6 steps, resuming argv[4] when given, stopping (and saving) after step
# argv[3]; each rank records its fp32 masters, expert-parallel rank, LR scheduler state and group lrs as the first
# step begins (after the Trainer's load) and as training ends
TRAINER_CHAIN_SCRIPT = MODEL_SNIPPET + """
from transformers import Trainer, TrainerCallback, TrainingArguments
from deepspeed.utils import safe_get_full_fp32_param

stop, resume = int(sys.argv[3]), (sys.argv[4] if len(sys.argv) > 4 else None)
data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (24, 16))]
args = TrainingArguments(output_dir=sys.argv[2], deepspeed=sys.argv[1], max_steps=6, per_device_train_batch_size=2,
                         learning_rate=1e-3, report_to=[], use_cpu=True, save_strategy="no")
trainer = Trainer(model=model, args=args, train_dataset=data)


def record(name, step):
    module = trainer.model_wrapped.module
    ep = next(((m.ep_rank, m.ep_size) for m in module.modules() if type(m).__name__ == "DeepSpeedExpertMaskedMoE"),
              (0, 1))
    torch.save({"masters": {n: safe_get_full_fp32_param(p) for n, p in module.named_parameters()}, "ep": ep,
                "step": step, "scheduler": trainer.lr_scheduler.state_dict(),
                "lrs": [g["lr"] for g in trainer.optimizer.param_groups]},
               f"{sys.argv[2]}/{name}{torch.distributed.get_rank()}.pt")


class Record(TrainerCallback):
    begun = False

    def on_step_begin(self, args, state, control, **kwargs):
        if not self.begun:
            self.begun = True
            record("begin", state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == stop:
            control.should_save = control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        record("end", state.global_step)


trainer.add_callback(Record())
trainer.train(resume_from_checkpoint=resume)
leave()
"""

# a plain accelerate script with its own AdamW (two groups) and a LambdaLR built on it before prepare (accelerate
# keeps a torch scheduler to itself and saves it as scheduler.bin): argv[3] steps, then save_state into argv[2];
# argv[4], when given, is loaded first. Each rank records its fp32 masters, expert-parallel rank, the scheduler's
# state and the optimizer's group lrs after the load and after the save
ACCELERATE_CHAIN_SCRIPT = MODEL_SNIPPET + """
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin
from deepspeed.utils import safe_get_full_fp32_param

out, steps, resume = sys.argv[2], int(sys.argv[3]), (sys.argv[4] if len(sys.argv) > 4 else None)
accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=sys.argv[1]))
norms = [p for n, p in model.named_parameters() if "norm" in n]
optimizer = torch.optim.AdamW([{"params": [p for n, p in model.named_parameters() if "norm" not in n]},
                               {"params": norms, "weight_decay": 0.0}], lr=1e-3)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / 8)
model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)


def record(name):
    ep = next(((m.ep_rank, m.ep_size) for m in model.module.modules()
               if type(m).__name__ == "DeepSpeedExpertMaskedMoE"), (0, 1))
    torch.save({"masters": {n: safe_get_full_fp32_param(p) for n, p in model.module.named_parameters()}, "ep": ep,
                "step": scheduler.scheduler.last_epoch, "scheduler": scheduler.state_dict(),
                "lrs": [g["lr"] for g in optimizer.param_groups]}, f"{out}/{name}{torch.distributed.get_rank()}.pt")


if resume:
    accelerator.load_state(resume)
    record("begin")
torch.manual_seed(1 + torch.distributed.get_rank())
for _ in range(steps):
    ids = torch.randint(0, 64, (2, 16))
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
accelerator.save_state(out)
record("end")
leave()
"""

# a plain accelerate script: DeepSpeed through accelerate's plugin, the script's own AdamW and loader
ACCELERATE_SCRIPT = MODEL_SNIPPET + """
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin

before = model.model.embed_tokens.weight.detach().clone()
accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=sys.argv[1]))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
loader = torch.utils.data.DataLoader([{"input_ids": ids} for ids in torch.randint(0, 64, (8, 16))], batch_size=2)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
for _, batch in zip(range(2), loader):
    accelerator.backward(model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss)
    optimizer.step()
    optimizer.zero_grad()
print("OPTIMIZER " + json.dumps({"engine": type(model).__name__, "type": type(model.optimizer).__name__,
                                 "trained": not torch.equal(before, model.module.model.embed_tokens.weight)}))
report(model.module, optimizer, model)
leave()
"""

DS_BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 0}}
HF_BASE = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "zero_optimization": {"stage": 0}}
ENABLED = {"loongforge": {"enabled": True}}
FUSED_ADAMW_CLIP = {"gradient_clipping": 1.0, "loongforge": {"enabled": True, "optimizer": {"fused_adamw_clip": True}}}

# case -> (loongforge part of the config, extra environment); every case runs DEEPSPEED_SCRIPT
DS_CASES = {
    "enabled": (ENABLED, {}),
    "moe_off": ({"loongforge": {"enabled": True, "moe": {"expert_masked": False}}}, {}),
    "disabled": ({"loongforge": {"enabled": False}}, {}),
    "absent": ({}, {}),
    "env_opt_out": (ENABLED, {"LOONGFORGE_DISABLE": "1"}),
}
CLI_CONFIG = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 0}, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "loongforge": {"enabled": True, "optimizer": {"fused_adamw_clip": True},
                             "sampler": {"n_clusters": 2, "refresh_every": 0}}}

STOCK_TYPES = {"MixtralRMSNorm", "MixtralSparseMoeBlock"}
OUR_TYPES = {"FusedRMSNorm", "ExpertMaskedMoE"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "LOONGFORGE_DISABLE"}
    env.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.update(extra)
    return env


def _write(directory, name: str, text: str):
    path = directory / name
    path.write_text(text)
    return path


def _tagged_all(output: str, tag: str) -> list[dict]:
    """Every JSON object the script printed after ``tag`` (RESULT, OPTIMIZER), in order. Ranks of a multi-rank
    script print to one pipe, so another rank's output may share the line, before or after the object."""
    decoder = json.JSONDecoder()
    return [decoder.raw_decode(part)[0] for part in output.split(tag + " ")[1:]]


def _tagged(output: str, tag: str) -> dict:
    """The JSON of the last ``tag`` line the script printed."""
    found = _tagged_all(output, tag)
    assert found, f"the script printed no {tag} line; its output:\n{output[-6000:]}"
    return found[-1]


def _result(output: str) -> dict:
    return _tagged(output, "RESULT")


def _run_script(tmp_path, text: str, config: dict, *args: str, ranks: int = 1, env: dict | None = None) -> str:
    """Write the script and its config under tmp_path and run it, as one process or as ``ranks`` processes
    under torch.distributed.run (``env``: more environment); its output (every rank's)."""
    script = _write(tmp_path, "script.py", text)
    config_path = _write(tmp_path, "ds_config.json", json.dumps(config))
    launch = [] if ranks == 1 else ["-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
                                    str(_free_port())]
    proc = subprocess.run([sys.executable, *launch, str(script), str(config_path), *args], cwd=tmp_path,
                          env=_env(env or {}), capture_output=True, text=True, timeout=TIMEOUT_S)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"the script failed (exit {proc.returncode}):\n{output[-6000:]}"
    return output


@pytest.fixture(scope="module")
def autoload_installed():
    probe = subprocess.run([sys.executable, "-c", "import sys; print(any(type(f).__name__ == 'DeepSpeedImportHook' "
                            "for f in sys.meta_path), 'torch' in sys.modules)"],
                           capture_output=True, text=True, env=_env({}), timeout=60)
    hooked, torch_loaded = probe.stdout.split()
    if hooked != "True":
        pytest.skip("loongforge_autoload.pth is not in site-packages: install the package (pip install -e .)")
    return torch_loaded == "True"


@pytest.fixture(scope="module")
def ds_runs(tmp_path_factory, autoload_installed):
    """Every DS_CASES run and the CLI run, started together; case -> (returncode, stdout + stderr)."""
    directory = tmp_path_factory.mktemp("config_only")
    script = _write(directory, "train_ds.py", DEEPSPEED_SCRIPT)
    procs = {}
    for case, (block, extra_env) in DS_CASES.items():
        config = _write(directory, f"{case}.json", json.dumps({**DS_BASE, **block}))
        procs[case] = subprocess.Popen([sys.executable, str(script), str(config)], cwd=directory, env=_env(extra_env),
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cli_config = {**CLI_CONFIG, "loongforge": {**CLI_CONFIG["loongforge"], "sampler": {
        **CLI_CONFIG["loongforge"]["sampler"], "cache_dir": str(directory / "signatures")}}}
    config = _write(directory, "cli.json", json.dumps(cli_config))
    script = _write(directory, "train_ds_cli.py", DEEPSPEED_CLI_SCRIPT)
    procs["cli"] = subprocess.Popen([sys.executable, str(script), "--deepspeed", "--deepspeed_config", str(config)],
                                    cwd=directory, env=_env({}), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
    runs = {}
    for case, proc in procs.items():
        output, _ = proc.communicate(timeout=TIMEOUT_S)
        runs[case] = (proc.returncode, output)
    return runs


def _run(ds_runs, case: str) -> tuple[dict, str]:
    returncode, output = ds_runs[case]
    assert returncode == 0, f"case {case}: the script failed (exit {returncode}):\n{output[-6000:]}"
    return _result(output), output


def test_autoload_keeps_interpreter_start_light(autoload_installed):
    assert not autoload_installed, "the .pth autoloader imported torch at interpreter start"


def test_enabled_block_replaces_modules(ds_runs):
    result, output = _run(ds_runs, "enabled")
    types = set(result["types"])
    assert OUR_TYPES <= types and not STOCK_TYPES & types, sorted(types)
    assert "[LoongForge] fused RMSNorm: 5 modules" in output  # 2 layers x 2 norms + the final norm
    assert "[LoongForge] ExpertMaskedMoE: 2 modules" in output
    # the script's AdamW was built before injection; it must now hold the injected modules' Parameters
    assert "[LoongForge] client optimizer: 6 parameters remapped" in output
    assert result["optimizer_params_in_model"]
    # DeepSpeed's throughput timer no longer synchronizes the device twice per step (async_throughput_timer)
    assert result["timer_synchronized"] is False
    assert "[LoongForge] DeepSpeed throughput timer: no device synchronize" in output
    # the expert-aware sampler (on by default) needs training_data, which this script does not pass: said, not
    # dropped silently
    assert "[LoongForge] sampler: not applied (no training_data was passed to deepspeed.initialize" in output


def test_summary_names_what_was_not_replaced(ds_runs):
    result, output = _run(ds_runs, "moe_off")
    types = set(result["types"])
    assert "FusedRMSNorm" in types and "MixtralSparseMoeBlock" in types and "ExpertMaskedMoE" not in types
    assert "[LoongForge] not replaced: 2 modules" in output
    assert "MixtralSparseMoeBlock: moe.expert_masked is false" in output
    assert result["optimizer_params_in_model"]


def test_config_from_args_builds_optimizer_and_sampler(ds_runs):
    result, output = _run(ds_runs, "cli")
    assert "FusedRMSNorm" in result["types"] and "ExpertMaskedMoE" in result["types"], result["types"]
    assert "[LoongForge] optimizer: FusedAdamWClip" in output
    assert "[LoongForge] training data: ExpertAwareSampler" in output
    assert "LOADER ExpertAwareSampler OPTIMIZER FusedAdamWClip" in output
    # the hook and then ds_loongforge.optim.initialize pass the config on: the timer is set, and said, once
    assert result["timer_synchronized"] is False and output.count("DeepSpeed throughput timer") == 1, output
    assert result["optimizer_params_in_model"]  # model.parameters() was taken before injection


@pytest.mark.parametrize("case", ["disabled", "absent", "env_opt_out"])
def test_stock_deepspeed_without_enabled_block(ds_runs, case):
    result, output = _run(ds_runs, case)
    types = set(result["types"])
    assert STOCK_TYPES <= types and not OUR_TYPES & types, sorted(types)
    lines = [line for line in output.splitlines() if "[LoongForge]" in line]
    # the opt-out says, once, that it overrides the config's enabled block; nothing else of LoongForge runs
    assert lines == (['[LoongForge] LOONGFORGE_DISABLE=1: the config\'s "loongforge" block is ignored, '
                      'deepspeed.initialize runs stock'] if case == "env_opt_out" else []), lines
    assert result["timer_synchronized"] is True  # DeepSpeed's default, untouched


@pytest.fixture
def accelerate_installed(autoload_installed):
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("needs accelerate (the HF Trainer hands DeepSpeed to accelerate's Accelerator, which calls "
                    "deepspeed.initialize); accelerate is not installed in this environment")


def test_hf_trainer_with_deepspeed_config(tmp_path, accelerate_installed):
    output = _run_script(tmp_path, TRAINER_SCRIPT, {**HF_BASE, **ENABLED}, str(tmp_path / "out"))
    result = _result(output)
    types = set(result["types"])
    assert OUR_TYPES <= types and not STOCK_TYPES & types, sorted(types)
    assert "[LoongForge] fused RMSNorm: 5 modules" in output
    # the Trainer builds its optimizer before deepspeed.initialize: without the remap it would train stale copies
    assert "[LoongForge] client optimizer: 6 parameters remapped" in output
    assert result["optimizer_params_in_model"]
    assert result["timer_synchronized"] is False


# a model loaded under deepspeed.zero.Init (ZeRO-3: transformers' from_pretrained does it while a ZeRO-3 config is
# registered, as the HF Trainer's TrainingArguments does), a Mixtral and a dense Llama (its MLPs fused into
# FusedSwiGLUMLP), per dtype in argv[2] (comma-separated), with the block:
# injected directly (every parameter must stay partitioned), then trained 3 steps through deepspeed.initialize beside
# the same checkpoint loaded whole; losses, the gathered weights and the module types of both
ZERO_INIT_SCRIPT = MODEL_SNIPPET + """
import os
import deepspeed
import ds_loongforge
from ds_loongforge.data import build_dataloader, routing_weights
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations import HfDeepSpeedConfig

from deepspeed.accelerator import get_accelerator

deepspeed.init_distributed(dist_backend="nccl" if os.environ.get("DS_ACCELERATOR") == "cuda" else "gloo")
here = os.path.dirname(os.path.abspath(sys.argv[1]))
llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
if torch.distributed.get_rank() == 0:
    model.save_pretrained(os.path.join(here, "mixtral"))
    llama.save_pretrained(os.path.join(here, "llama"))
torch.distributed.barrier()
torch.manual_seed(1)
batches = torch.randint(0, 64, (3, 2, 16)).to(get_accelerator().current_device_name())
data = [{"input_ids": ids} for ids in torch.randint(0, 64, (16, 16))]
out = {}
for kind, dtype in ((kind, dtype) for kind in ("mixtral", "llama") for dtype in sys.argv[2].split(",")):
    folder, cls = os.path.join(here, kind), {"mixtral": MixtralForCausalLM, "llama": LlamaForCausalLM}[kind]
    config = {**json.load(open(sys.argv[1])), dtype: {"enabled": True}}
    config["train_batch_size"] = config["train_micro_batch_size_per_gpu"] * torch.distributed.get_world_size()

    def load(zero_init):
        hf_config = HfDeepSpeedConfig(config) if zero_init else None  # registered while it lives
        loaded = cls.from_pretrained(folder)
        del hf_config
        # from_pretrained returns the model in eval(), where the fused loss leaves the call to transformers (full
        # logits); the HF Trainer trains in train() mode, so do we
        return loaded.train()

    probe = load(True)
    # zero.Init's buffer dtypes: on the GPU it leaves the rotary inv_freq buffers bf16 in a bf16 run (they were built
    # through its patched tensor constructors); a whole load keeps them fp32. Each whole load below takes them.
    zero_init_buffers = {n: b.dtype for n, b in probe.named_buffers()}
    partitioned_before = all(hasattr(p, "ds_id") for p in probe.parameters())
    ds_loongforge.inject(probe, config)
    partitioned = [n for n, p in probe.named_parameters() if hasattr(p, "ds_id") and p.data.numel() == 0]
    runs = {}
    def gathered(engine):
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}

    for zero_init in (False, True):
        loaded = load(zero_init)
        if not zero_init:
            cast = [n for n, b in loaded.named_buffers() if zero_init_buffers.get(n, b.dtype) != b.dtype]
            for n, b in loaded.named_buffers():
                b.data = b.data.to(zero_init_buffers.get(n, b.dtype))
            out[f"{kind} {dtype} buffers cast"] = cast
        reference = None if zero_init or kind != "mixtral" else routing_weights(loaded)  # before ZeRO-3 partitions
        engine, *_ = deepspeed.initialize(model=loaded, config=config)
        initial, losses = gathered(engine), []
        if reference is not None:  # the sampler's snapshot of the partitioned model: gathered, the whole weights
            snap, dt = routing_weights(engine.module), torch.bfloat16 if dtype == "bf16" else torch.float32
            out[f"{kind} {dtype} snapshot"] = all(
                torch.equal(a.to(dt).float(), b) for a, b in zip([reference.embedding_VH, *reference.routers_LEH],
                                                                 [snap.embedding_VH, *snap.routers_LEH]))
        if zero_init and kind == "mixtral":  # the expert-aware sampler on it, refreshing every 2 batches
            sampler = {"expert_aware": True, "n_clusters": 2, "refresh_every": 2, "cache_dir": here + "/signatures"}
            loader = build_dataloader(data, {"loongforge": {"enabled": True, "sampler": sampler}}, engine.module, 2)
            out[f"{kind} {dtype} sampler batches"] = [sum(1 for _ in loader), len(loader)]  # one epoch
            try:
                build_dataloader(data, {"loongforge": {"enabled": True, "sampler": {**sampler, "signature": "forward"}}},
                                 engine.module, 2)
            except ValueError as e:
                out[f"{kind} {dtype} forward kind"] = str(e)
        fused = []
        for ids in batches:
            result = engine(input_ids=ids, labels=ids)
            fused.append(result.logits is None)  # the fused loss's output: no [tokens, vocab] logits
            engine.backward(result.loss)
            engine.step()
            losses.append(result.loss.item())
        out[f"{kind} {dtype} fused loss calls" + (" zero.Init" if zero_init else "")] = fused
        runs[zero_init] = (losses, initial, gathered(engine), sorted({type(m).__name__ for m in engine.module.modules()}))
    (losses, initial, weights, types), (zlosses, zinitial, zweights, ztypes) = runs[False], runs[True]
    out[f"{kind} {dtype}"] = {"partitioned_before": partitioned_before, "params": len(list(probe.parameters())),
                  "partitioned_after_inject": len(partitioned), "losses": losses, "zero_init_losses": zlosses,
                  "types": types, "zero_init_types": ztypes, "names_equal": sorted(weights) == sorted(zweights),
                  "initial_differing": [n for n in initial if not torch.equal(initial[n], zinitial.get(n))],
                  "weights_differing": [n for n in weights if not torch.equal(weights[n], zweights.get(n))],
                  "max_trained_difference": max(float((weights[n] - zweights[n]).abs().max()) for n in weights)}
print("RESULT " + json.dumps(out))
leave()
"""


@pytest.mark.parametrize("accelerator, dtypes, ranks", [
    ("cpu", "fp32,bf16", 2),
    pytest.param("cuda", "fp32,bf16", 1, marks=pytest.mark.gpu),  # our CUDA kernels; one GPU is lent
])
def test_model_loaded_under_zero_init_trains_as_one_loaded_whole(tmp_path, accelerator, dtypes, ranks):
    """A model whose parameters ZeRO-3 partitioned as it was built (``deepspeed.zero.Init``) is injected one module
    at a time, gathered to build each replacement and its new Parameters partitioned right after, so it is never
    whole on a rank. On 2 CPU ranks (and one GPU), a Mixtral and a dense Llama, fp32 and bf16: its weights after
    deepspeed.initialize are those of the same checkpoint loaded whole, bit for bit, and so are its 3 steps' losses
    and weights, on the CPU and on the GPU. On the GPU zero.Init leaves the rotary inv_freq buffers of a bf16 model
    in bf16 (a whole load keeps them fp32): the whole load takes zero.Init's buffer dtypes, and that is the one cast
    it needs. Before, such a model was refused."""
    config = {**DS_BASE, **ENABLED, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "gradient_clipping": 1.0}
    output = _run_script(tmp_path, AUTOLOAD + ZERO_INIT_SCRIPT, config, dtypes, ranks=ranks,
                         env={"DS_ACCELERATOR": accelerator})
    assert "runs the original forward" not in output  # the fused loss ran in every call, its head weight gathered
    runs = _result(output)
    dtype_list = dtypes.split(",")
    for kind, dtype in ((kind, dtype) for kind in ("llama", "mixtral") for dtype in dtype_list):
        # the one difference between the two loads that the GPU shows: zero.Init's bf16 rotary buffers
        cast = runs.pop(f"{kind} {dtype} buffers cast")
        assert cast == (["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]
                        if accelerator == "cuda" and dtype == "bf16" else []), (kind, dtype, cast)
    for dtype in dtype_list:  # the expert-aware sampler reads the partitioned routers (gathered for its snapshot)
        assert runs.pop(f"mixtral {dtype} snapshot") is True, dtype
        seen, length = runs.pop(f"mixtral {dtype} sampler batches")
        assert seen == length >= 3, (dtype, seen, length)  # past a refresh boundary (every 2 batches)
        assert "signature 'forward' runs a whole copy" in runs.pop(f"mixtral {dtype} forward kind"), dtype
    assert "refreshing signatures in the background" in output  # snapshots taken while iterating, too
    for key in [k for k in runs if " fused loss calls" in k]:  # in train() mode, every step through the fused loss
        assert runs.pop(key) == [True] * 3, key
    assert sorted(runs) == sorted(f"{kind} {dtype}" for kind in ("llama", "mixtral") for dtype in dtype_list), runs
    for case, run in runs.items():
        assert run["partitioned_before"], (case, run)
        assert run["partitioned_after_inject"] == run["params"], (case, run)  # gate_up, experts, routers included
        ours, stock = ((OUR_TYPES, STOCK_TYPES) if case.startswith("mixtral")
                       else ({"FusedRMSNorm", "FusedSwiGLUMLP"}, {"LlamaRMSNorm", "LlamaMLP"}))
        assert ours <= set(run["zero_init_types"]) and not stock & set(run["zero_init_types"]), (case, run)
        assert run["zero_init_types"] == run["types"] and "_DeferredLMHead" in run["types"], run  # the fused loss
        assert run["names_equal"] and run["initial_differing"] == [], (case, run)  # what inject built, exactly
        assert len(set(run["losses"])) == 3, run  # the steps trained
        # bit for bit on the GPU too once the whole load has zero.Init's buffer dtypes (the difference Session 25's
        # benchmarks/diagnose_zero_init_bits.py found: the first forward's attention output, from the bf16 inv_freq)
        assert run["weights_differing"] == [] and run["zero_init_losses"] == run["losses"], (case, run)


# the HF Trainer under a ZeRO-3 config: TrainingArguments registers it, so from_pretrained builds the model under
# zero.Init; argv[3] "1": the block (from argv[1]'s config), "2": the block with fused_adamw_clip, "0": none; the
# logged losses
TRAINER_ZERO_INIT_SCRIPT = MODEL_SNIPPET + """
import os
from transformers import Trainer, TrainingArguments

folder = os.path.join(os.path.dirname(os.path.abspath(sys.argv[1])), "model")
if int(os.environ.get("RANK", "0")) == 0:
    model.save_pretrained(folder)
config = json.load(open(sys.argv[1]))
if sys.argv[3] == "0":
    config.pop("loongforge")
elif sys.argv[3] == "2":
    config["loongforge"]["optimizer"] = {"fused_adamw_clip": True}
args = TrainingArguments(output_dir=sys.argv[2], deepspeed=config, max_steps=3, per_device_train_batch_size=2,
                         learning_rate=1e-2, report_to=[], use_cpu=True, save_strategy="no", logging_steps=1)
torch.distributed.barrier()
model = MixtralForCausalLM.from_pretrained(folder)
partitioned = all(hasattr(p, "ds_id") for p in model.parameters())
data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (8, 16))]
trainer = Trainer(model=model, args=args, train_dataset=data)
trainer.train()
print("TRAINED " + json.dumps({"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                               "built_partitioned": partitioned}))
report(trainer.model_wrapped.module, trainer.optimizer, trainer.model_wrapped)
leave()
"""


def test_hf_trainer_zero3_model_built_under_zero_init(tmp_path, accelerate_installed):
    """The HF Trainer with a ZeRO-3 config builds the model under zero.Init; the block alone injects it, the fused
    LM head + cross-entropy included (ZeRO-3 gathers the head's weight for the model's forward and backward), and
    the Trainer's 3 logged losses on 2 ranks are stock's (the fused kernels' sums in another order: 1e-5). With
    fused_adamw_clip too, FusedAdamWClip stands in for the Trainer's AdamW inside ZeRO-3 and the losses are again
    stock's (AdamW and the clip in fp32 in another order)."""
    config = {**HF_BASE, **ENABLED, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "gradient_clipping": 1.0}
    runs = {}
    for block in ("1", "2", "0"):
        (tmp_path / block).mkdir()
        output = _run_script(tmp_path / block, TRAINER_ZERO_INIT_SCRIPT, config, str(tmp_path / block / "out"),
                             block, ranks=2)
        runs[block] = _tagged(output, "TRAINED")
        assert runs[block]["built_partitioned"], runs
        types = set(_result(output)["types"])
        if block != "0":
            assert OUR_TYPES <= types and not STOCK_TYPES & types, sorted(types)
            assert "[LoongForge] fused RMSNorm: 5 modules" in output
            assert "_DeferredLMHead" in types and "runs the original forward" not in output  # the fused loss ran
        else:
            assert not OUR_TYPES & types, sorted(types)
        assert ("FusedAdamWClip takes the script's AdamW" in output) == (block == "2"), block
    stock = runs["0"]["losses"]
    assert len(set(stock)) == 3, runs
    for block in ("1", "2"):
        ours = runs[block]["losses"]
        assert len(ours) == len(stock) == 3, runs
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(ours, stock)), (block, runs)


def test_hf_trainer_torch_compile_trains_the_injected_model_as_eager(tmp_path, accelerate_installed):
    """``TrainingArguments(torch_compile=True)`` with the block: the Trainer has DeepSpeed compile the engine, which
    then runs the injected modules (custom ops under compile), and the two steps' losses are the eager run's."""
    runs = {}
    for flag in ("0", "1"):
        (tmp_path / flag).mkdir()
        output = _run_script(tmp_path / flag, TRAINER_COMPILE_SCRIPT, {**HF_BASE, **ENABLED}, str(tmp_path / "out"),
                             flag)
        runs[flag] = _tagged(output, "TRAINED")
        types = set(_result(output)["types"])
        assert OUR_TYPES <= types and not STOCK_TYPES & types, sorted(types)
    assert runs["1"]["compiled"] and not runs["0"]["compiled"], runs
    compiled, eager = runs["1"]["losses"], runs["0"]["losses"]
    assert len(compiled) == len(eager) == 2
    assert all(abs(c - e) <= 1e-4 * abs(e) for c, e in zip(compiled, eager)), runs


def test_hf_trainer_takes_fused_adamw_clip_from_the_block_alone(tmp_path, accelerate_installed):
    """The Trainer builds its AdamW before deepspeed.initialize when the DeepSpeed config has no "optimizer";
    with fused_adamw_clip in the block, FusedAdamWClip stands in for it on its own param groups (a user found this
    raising "do not pass an optimizer as well"), and the Trainer's LR schedule keeps driving the lr."""
    output = _run_script(tmp_path, TRAINER_SCRIPT, {**HF_BASE, **FUSED_ADAMW_CLIP}, str(tmp_path / "out"))
    assert "[LoongForge] FusedAdamWClip takes the script's AdamW: its 2 parameter groups" in output
    opt = _tagged(output, "OPTIMIZER")
    assert opt["type"] == "FusedAdamWClip"
    assert opt["weight_decays"] == [0.0, 0.0]  # the Trainer's groups (decay / no decay), its default weight decay
    # a linear schedule over max_steps=2 from 1e-3: 0 after the last step, in the groups FusedAdamWClip reads
    assert opt["lrs"] == opt["scheduler_lrs"] == [0.0, 0.0]
    assert _result(output)["optimizer_params_in_model"]


def test_accelerate_script_with_deepspeed_plugin(tmp_path, accelerate_installed):
    """A plain accelerate script (Accelerator with a DeepSpeedPlugin over the config file, its own AdamW, prepare,
    accelerator.backward): accelerate calls deepspeed.initialize, and the block alone brings the fused modules
    and FusedAdamWClip in place of the script's AdamW, which then trains the injected model's parameters."""
    output = _run_script(tmp_path, ACCELERATE_SCRIPT, {**DS_BASE, **FUSED_ADAMW_CLIP})
    result = _result(output)
    assert OUR_TYPES <= set(result["types"]) and not STOCK_TYPES & set(result["types"]), result["types"]
    assert "[LoongForge] fused RMSNorm: 5 modules" in output
    assert "[LoongForge] FusedAdamWClip takes the script's AdamW: its 1 parameter groups" in output
    opt = _tagged(output, "OPTIMIZER")
    assert opt == {"engine": "DeepSpeedEngine", "type": "FusedAdamWClip", "trained": True}, opt
    assert result["optimizer_params_in_model"]


EP_SCRIPT_RANKS = 2


def test_expert_parallel_from_the_block_alone(tmp_path, autoload_installed):
    """An unmodified script run on 2 ranks with moe.ep_size=2 in the block gets expert-parallel MoE layers:
    the hook initialises torch.distributed before inject, as deepspeed.initialize would just after (a user found
    the MoE blocks left stock, "needs torch.distributed initialised before inject")."""
    output = _run_script(tmp_path, DEEPSPEED_SCRIPT, {**DS_BASE, "loongforge": {"enabled": True, "moe": {
        "ep_size": 2}}}, ranks=EP_SCRIPT_RANKS)
    results = _tagged_all(output, "RESULT")
    assert len(results) == EP_SCRIPT_RANKS, output[-6000:]
    for result in results:
        assert "DeepSpeedExpertMaskedMoE" in result["types"] and "MixtralSparseMoeBlock" not in result["types"]
        assert result["optimizer_params_in_model"]
    assert "[LoongForge] torch.distributed initialised before inject (moe.ep_size=2)" in output
    assert "[LoongForge] DeepSpeedExpertMaskedMoE: 2 modules" in output


def test_hf_trainer_expert_parallel_checkpoint_exports(tmp_path, accelerate_installed):
    """The HF Trainer on 2 ranks with moe.ep_size 2 and FusedAdamWClip from the block alone (its AdamW's groups
    had no 'moe' group, which ZeRO asserts on), then its checkpoint through loongforge_export: the Trainer's own
    model.safetensors holds rank 0's experts only, the export every expert's fp32 master as DeepSpeed assembles
    it, in a folder from_pretrained loads; and the Trainer resumes the checkpoint on 4 ranks at ep_size 4."""
    import torch
    from transformers import MixtralForCausalLM

    out = tmp_path / "out"
    output = _run_script(tmp_path, TRAINER_EP_SCRIPT, {**HF_BASE, "zero_optimization": {"stage": 2},
                                                       "gradient_clipping": 1.0, "loongforge": {
        "enabled": True, "moe": {"ep_size": 2}, "optimizer": {"fused_adamw_clip": True}}}, str(out),
                         ranks=EP_SCRIPT_RANKS)
    assert "[LoongForge] FusedAdamWClip takes the script's AdamW" in output
    # the expert weights in a group of their own, whose lr the Trainer's schedule drives too (linear over 2 steps
    # from 1e-3: 0 after the last); the Trainer builds its scheduler on the engine's optimizer, all three groups
    opt = _tagged(output, "OPTIMIZER")
    assert opt["type"] == "FusedAdamWClip" and opt["moe"] == [False, False, True], opt
    assert opt["lrs"] == opt["scheduler_lrs"] == [0.0, 0.0, 0.0], opt

    exported = subprocess.run([sys.executable, "-m", "ds_loongforge.export", str(out / "checkpoint-2"),
                               str(tmp_path / "hf")], env=_env({}), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert exported.returncode == 0, exported.stdout[-3000:] + exported.stderr[-3000:]
    model, info = MixtralForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    ranks = {r["ep_rank"]: r["masters"] for r in (torch.load(out / f"masters{rank}.pt") for rank in range(2))}
    assert sorted(ranks) == [0, 1]
    state = model.state_dict()
    for name, master in ranks[0].items():
        want = torch.cat([ranks[0][name], ranks[1][name]]) if ".experts." in name else master
        assert torch.equal(state[name], want), name

    # the Trainer resumes that checkpoint on 4 ranks at ep_size 4 (one expert a rank): the optimizer state follows
    # the experts (ds_loongforge.checkpoint), every rank's masters the saved ones, then a third step
    output = _run_script(tmp_path, TRAINER_RESUME_SCRIPT, {**HF_BASE, "zero_optimization": {"stage": 2},
                                                           "gradient_clipping": 1.0, "loongforge": {
        "enabled": True, "moe": {"ep_size": 4}, "optimizer": {"fused_adamw_clip": True}}}, str(out),
                         str(out / "checkpoint-2"), ranks=4)
    assert "saved by 2 ranks (expert groups at ep_size [2]), loaded at 4 ranks" in output
    assert _tagged(output, "RESUMED")["step"] == 3
    for rank in range(4):
        resumed = torch.load(out / f"resumed{rank}.pt")
        assert resumed["step"] == 2 and resumed["ep_rank"] == rank, resumed["ep_rank"]
        for name, value in resumed["masters"].items():
            want = torch.cat([ranks[0][name], ranks[1][name]])[rank:rank + 1] if ".experts." in name else \
                ranks[0][name]
            assert torch.equal(value, want), f"rank {rank}, {name}"


def _trainer_records(out, name: str, ranks: int) -> dict:
    """A TRAINER_CHAIN_SCRIPT run's records at ``name`` ('begin', 'end'): its step, each rank's scheduler state and
    group lrs, and every parameter's fp32 master whole (the experts of the expert-parallel ranks concatenated)."""
    import torch

    records = [torch.load(out / f"{name}{rank}.pt") for rank in range(ranks)]
    by_ep_rank = {}
    for record in records:
        by_ep_rank.setdefault(record["ep"][0], record["masters"])
    ep_size = records[0]["ep"][1]
    assert sorted(by_ep_rank) == list(range(ep_size)), [r["ep"] for r in records]
    masters = {key: torch.cat([by_ep_rank[e][key] for e in range(ep_size)]) if ".experts." in key else value
               for key, value in by_ep_rank[0].items()}
    assert len({r["step"] for r in records}) == 1
    return {"step": records[0]["step"], "masters": masters, "schedulers": [r["scheduler"] for r in records],
            "lrs": [r["lrs"] for r in records]}


@pytest.mark.parametrize("optimizer_from, fused", [("trainer", True), ("trainer", False), ("config", True)])
def test_hf_trainer_resumes_across_expert_sharding(tmp_path, accelerate_installed, optimizer_from, fused):
    """The HF Trainer saved with every expert on every rank (moe.ep_size 1) resumes with expert parallelism
    (ep_size 2) and that checkpoint again at ep_size 1, on 2 ranks, ZeRO-2. DeepSpeed gives the optimizer 3 groups
    with expert-parallel layers (the experts' own) and 2 without, so the LR scheduler's state, one LambdaLR entry
    per group, is fitted to the groups (ds_loongforge.checkpoint); torch raised IndexError on it. The Trainer's
    AdamW (FusedAdamWClip standing in, or torch's own, whose experts the hook splits into a 'moe' group: ZeRO
    asserted without one) keeps its scheduler in its own scheduler.pt; with the optimizer in the DeepSpeed config
    the Trainer hands DeepSpeed a scheduler factory and the engine's checkpoint holds it. Each resume begins at the
    saved step with the saved masters, bit for bit, and the schedule where it was."""
    import torch

    config = {**HF_BASE, "zero_optimization": {"stage": 2}, "gradient_clipping": 1.0,
              "loongforge": {"enabled": True, "optimizer": {"fused_adamw_clip": fused}}}
    if optimizer_from == "config":
        config["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}
    previous, checkpoint = None, None
    for run, (ep_size, stop) in enumerate([(1, 2), (2, 4), (1, 6)]):
        out = tmp_path / f"run{run}"
        config["loongforge"]["moe"] = {"ep_size": ep_size}
        output = _run_script(tmp_path, TRAINER_CHAIN_SCRIPT, config, str(out), str(stop),
                             *([checkpoint] if checkpoint else []), ranks=2)
        begin, end = _trainer_records(out, "begin", 2), _trainer_records(out, "end", 2)
        assert end["step"] == stop
        # the Trainer's AdamW groups parameters with and without weight decay, DeepSpeed's takes them as one; with
        # expert-parallel layers DeepSpeed splits off an expert group
        groups = (2 if optimizer_from == "trainer" else 1) + (ep_size > 1)
        for scheduler, lrs in zip(begin["schedulers"] + end["schedulers"], begin["lrs"] + end["lrs"]):
            assert len(scheduler["base_lrs"]) == len(scheduler["lr_lambdas"]) == len(lrs) == groups, scheduler
            assert scheduler["_last_lr"] == lrs, (scheduler, lrs)
        if not fused and ep_size > 1:
            assert ("[LoongForge] client optimizer: AdamW with its expert parameters in 'moe' groups of their own "
                    "for ZeRO (1 added;") in output, output[-6000:]
        if previous is not None:
            assert "loaded at 2 ranks with " + ("expert parallelism" if ep_size > 1 else "every expert unsharded") \
                in output, output[-6000:]
            assert begin["step"] == previous["step"]
            for key, value in previous["masters"].items():
                assert torch.equal(begin["masters"][key], value), f"run {run}: {key}"
            saved = previous["schedulers"][0]
            for scheduler in begin["schedulers"]:
                assert scheduler["last_epoch"] == saved["last_epoch"] == previous["step"], (scheduler, saved)
                assert set(scheduler["_last_lr"]) == set(saved["_last_lr"]), (scheduler, saved)
            # linear decay over 6 steps from 1e-3: the resumed run trains on at the lr the schedule had reached
            assert begin["lrs"][0][0] == pytest.approx(1e-3 * (6 - previous["step"]) / 6)
        assert not all(torch.equal(end["masters"][key], value) for key, value in begin["masters"].items())
        previous, checkpoint = end, str(out / f"checkpoint-{stop}")


@pytest.mark.parametrize("fused", [True, False])
def test_accelerate_save_and_load_state_across_expert_sharding(tmp_path, accelerate_installed, fused):
    """accelerate's save_state / load_state with a torch LambdaLR built on the script's AdamW before prepare, on 2
    ranks at moe.ep_size 1 -> 2 -> 1, ZeRO-2, FusedAdamWClip standing in for the AdamW or the AdamW itself (its
    experts split into a 'moe' group: ZeRO asserted without one). The scheduler keeps one entry per script group
    (torch zips them strictly with the optimizer it was built on) and drives the expert group through the group it
    was split from; the expert group's lr a step behind in the saved state made the load into unsharded experts
    refuse the disagreeing groups, and after a load the script's AdamW dicts were no longer the optimizer's, so its
    schedule set an lr nobody read. Each load gives the saved masters bit for bit and every group the schedule's
    lr."""
    import torch

    config = {**DS_BASE, "zero_optimization": {"stage": 2}, "gradient_clipping": 1.0,
              "loongforge": {"enabled": True, "optimizer": {"fused_adamw_clip": fused}}}
    previous, checkpoint = None, None
    for run, ep_size in enumerate([1, 2, 1]):
        out = tmp_path / f"run{run}"
        out.mkdir()
        config["loongforge"]["moe"] = {"ep_size": ep_size}
        _run_script(tmp_path, ACCELERATE_CHAIN_SCRIPT, config, str(out), "2", *([checkpoint] if checkpoint else []),
                    ranks=2)
        end = _trainer_records(out, "end", 2)
        assert end["step"] == 2 * (run + 1)
        for scheduler, lrs in zip(end["schedulers"], end["lrs"]):
            # two entries (the script's groups) whatever the optimizer's groups; each group the scheduled lr
            assert len(scheduler["base_lrs"]) == 2 and len(lrs) == 2 + (ep_size > 1), (scheduler, lrs)
            assert set(lrs) == {1e-3 * (1 - end["step"] / 8)}, (scheduler, lrs)
        if previous is not None:
            begin = _trainer_records(out, "begin", 2)
            assert begin["step"] == previous["step"]
            for key, value in previous["masters"].items():
                assert torch.equal(begin["masters"][key], value), f"run {run}: {key}"
            for scheduler, lrs in zip(begin["schedulers"], begin["lrs"]):
                assert scheduler == previous["schedulers"][0]
                assert set(lrs) == {1e-3 * (1 - begin["step"] / 8)}, (scheduler, lrs)
        previous, checkpoint = end, str(out)


# a dense Llama's DeepSpeed engine under a config, its training step on a batch, and every parameter's fp32 master
# and Adam moments under stock names (gate_up_proj cut into gate_proj and up_proj rows): the checkpoint scripts below
LLAMA_ENGINE_SNIPPET = """
import json, os, sys
import torch
import deepspeed
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from transformers import LlamaConfig, LlamaForCausalLM

out = sys.argv[2]
batches = torch.randint(0, 64, (3, 2, 16), generator=torch.Generator().manual_seed(1))


def engine_for(config, frozen=()):  # frozen: parameters whose names hold one of these (left out of the optimizer)
    torch.manual_seed(0)  # LF_TEST_MLP_BIAS=1: MLPs with biases; an "optimizer" in the config: DeepSpeed's own
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         mlp_bias=os.environ.get("LF_TEST_MLP_BIAS") == "1"))
    for name, p in model.named_parameters():
        p.requires_grad_(not any(part in name for part in frozen))
    trained = [p for p in model.parameters() if p.requires_grad]
    if "optimizer" in config:
        return deepspeed.initialize(model=model, model_parameters=trained, config=config)[0]
    return deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(trained, lr=1e-2), config=config)[0]


def step(engine, ids):
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()


def full(engine, p, key):
    # DeepSpeed's ZeRO-1/2 links each parameter to its Adam moments at the first step (also after its own load)
    getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", lambda: None)()
    value = safe_get_full_fp32_param(p) if key is None else safe_get_full_optimizer_state(p, key)
    opt = engine.optimizer
    if value is None and hasattr(opt, "fp32_groups_flat"):  # FP16_Optimizer: one flat master a group
        for g16, flat in zip(opt.fp16_groups, opt.fp32_groups_flat):
            start = 0
            for q in g16:
                if q is p:
                    whole = flat if key is None else opt.optimizer.state[flat][key]
                    return whole[start:start + p.numel()].view(p.shape).detach().clone()
                start += q.numel()
    if value is None and not engine.zero_optimization():  # without ZeRO: torch's own state, of the weight (fp32)
        opt = engine.optimizer                            # or of DeepSpeed's fp32 master of it (bf16/fp16)
        master = next((b for g16, g32 in zip(getattr(opt, "fp16_groups", []), getattr(opt, "fp32_groups", []))
                       for a, b in zip(g16, g32) if a is p), p)
        value = master.detach().clone() if key is None else getattr(opt, "optimizer", opt).state[master][key].clone()
    return value


def states(engine):
    out = {}
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            values = [full(engine, p, key) for key in (None, "exp_avg", "exp_avg_sq")]
        else:  # frozen: the weight, three times (no master, no moments)
            with deepspeed.zero.GatheredParameters([p]):
                values = [p.detach().float().clone()] * 3
        if "gate_up_proj" in name:
            for part, half in zip(("gate_proj", "up_proj"), zip(*(v.chunk(2) for v in values))):
                out[name.replace("gate_up_proj", part)] = torch.stack(half)
        else:
            out[name] = torch.stack(values)
    return out


def masters(engine):  # the fp32 masters alone, under stock names (an optimizer that has not stepped has no moments)
    out = {}
    for name, p in engine.module.named_parameters():
        value = full(engine, p, None)
        out.update(zip((name.replace("gate_up_proj", part) for part in ("gate_proj", "up_proj")), value.chunk(2))
                   if "gate_up_proj" in name else [(name, value)])
    return out
"""
# a dense Llama trained 2 steps by stock DeepSpeed (no block), saved, and stepped once more; then the same model
# built again under argv[1]'s enabled block (MLPs fused: gate_proj and up_proj become one gate_up_proj), the
# checkpoint loaded and stepped once on the same batch, and saved. Each engine's fp32 masters and Adam moments under
# stock names (gate_up_proj cut into gate_proj and up_proj rows) after the load / before the third step, and its
# weights after it. With argv[3], a fresh process loads that last checkpoint into an engine of argv[1]'s config
STOCK_TO_FUSED_SCRIPT = LLAMA_ENGINE_SNIPPET + """
config = json.load(open(sys.argv[1]))
if len(sys.argv) > 3:  # a fresh process: the fused engine's checkpoint into one with the MLP fusion off
    unfused = engine_for(config)
    assert not any("gate_up_proj" in n for n, _ in unfused.module.named_parameters())
    unfused.load_checkpoint(out, tag="fused")
    torch.save(states(unfused), os.path.join(out, "unfused.pt"))
    leave()
stock = engine_for({k: v for k, v in config.items() if k != "loongforge"})
for ids in batches[:2]:
    step(stock, ids)
stock.save_checkpoint(out, tag="ckpt")
saved = states(stock)
step(stock, batches[2])
fused = engine_for(config)
assert any("gate_up_proj" in n for n, _ in fused.module.named_parameters())
fused.load_checkpoint(out, tag="ckpt")
loaded = states(fused)
step(fused, batches[2])
fused.save_checkpoint(out, tag="fused")
torch.save({"saved": saved, "loaded": loaded, "stock_after": dict(stock.module.state_dict()),
            "fused_after": dict(fused.module.state_dict()), "steps": [stock.global_steps, fused.global_steps],
            "fused_saved": states(fused)}, os.path.join(out, "result.pt"))
leave()
"""


def test_stock_zero_checkpoint_resumes_with_fused_mlps(tmp_path, autoload_installed):
    """Turning the block on for a run saved by stock DeepSpeed: the fused MLP holds gate_proj and up_proj as one
    gate_up_proj, so ZeRO's flat partitions have other parameter boundaries, and DeepSpeed's load raised "The ZeRO
    checkpoint parameter-alignment layout does not match the current zero_optimization.parameter_alignment setting"
    (a setting nobody changed). The weights load by name, the fp32 masters and Adam moments are rebuilt per
    parameter (the gate's and up's rows joined), and the next step is stock's; and a checkpoint of the fused MLP
    loads into an engine with fused_kernels.swiglu off (rows cut in halves)."""
    import torch

    config = {**DS_BASE, "zero_optimization": {"stage": 2}, "gradient_clipping": 1.0, **ENABLED}
    output = _run_script(tmp_path, MODEL_SNIPPET + STOCK_TO_FUSED_SCRIPT, config, str(tmp_path / "ckpt"))
    assert "saved with the MLPs' gate and up projections as two, loaded as one gate_up_proj" in output, output[-6000:]
    result = torch.load(tmp_path / "ckpt" / "result.pt")
    assert result["steps"] == [3, 3]
    assert result["saved"].keys() == result["loaded"].keys()
    for name, value in result["saved"].items():
        assert torch.equal(result["loaded"][name], value), name
    assert result["stock_after"].keys() == result["fused_after"].keys()
    for name, value in result["stock_after"].items():  # fp32; the fused kernels' sums in another order
        torch.testing.assert_close(result["fused_after"][name], value, rtol=0, atol=1e-6, msg=name)
    config["loongforge"] = {**config["loongforge"], "fused_kernels": {"swiglu": False}}
    output = _run_script(tmp_path, MODEL_SNIPPET + STOCK_TO_FUSED_SCRIPT, config, str(tmp_path / "ckpt"), "unfused")
    assert "saved with the MLPs' gate and up projections as one gate_up_proj, loaded as two" in output, output[-6000:]
    unfused = torch.load(tmp_path / "ckpt" / "unfused.pt")
    assert result["fused_saved"].keys() == unfused.keys()
    for name, value in result["fused_saved"].items():
        assert torch.equal(unfused[name], value), name


# 2 ranks (ZeRO-3: every parameter partitioned, none persistent): the same dense Llama built under the config with
# argv[3]'s loongforge block (absent: "null") and with argv[4]'s; the first trained 2 steps, saved, stepped once
# more; the second loads the checkpoint and steps on the same third batch. Rank 0 saves every parameter's fp32
# master and Adam moments under stock names (gate_up_proj cut into gate_proj and up_proj rows) at the save and after
# the load, and after the third step of each engine
MLP_LAYOUT_SCRIPT = LLAMA_ENGINE_SNIPPET + """
base = json.load(open(sys.argv[1]))
blocks = [json.loads(arg) for arg in sys.argv[3:5]]
frozen = json.loads(sys.argv[5])
first, second = (engine_for(base if block is None else {**base, "loongforge": block}, frozen) for block in blocks)
if torch.distributed.get_rank() == 0:
    print("optimizers:", type(first.optimizer).__name__, type(second.optimizer).__name__)
for ids in batches[:2]:
    step(first, ids)
first.save_checkpoint(out, tag="ckpt")
saved = states(first)
step(first, batches[2])
first_after = states(first)
second.load_checkpoint(out, tag="ckpt")
loaded = states(second)
step(second, batches[2])
second_after = states(second)
fused = [any("gate_up_proj" in n for n, _ in e.module.named_parameters()) for e in (first, second)]
if torch.distributed.get_rank() == 0:
    torch.save({"saved": saved, "loaded": loaded, "first_after": first_after, "second_after": second_after,
                "fused": fused, "steps": [first.global_steps, second.global_steps]}, os.path.join(out, "result.pt"))
leave()
"""


@pytest.mark.parametrize("stage, first, second, dtype", [
    (3, "absent", "enabled", "fp32"),  # a stock run resumed with the block on
    (3, "enabled", "disabled", "fp32"),  # a LoongForge run resumed with the block switched off
    (3, "enabled", "absent", "bf16"),  # ... or removed
    (0, "absent", "enabled", "fp32"),
    (0, "enabled", "disabled", "fp32"),
    (0, "absent", "enabled", "bf16"),  # DeepSpeed's FP16_UnfusedOptimizer around the script's AdamW
    (0, "enabled", "absent", "bf16"),
])
def test_checkpoint_across_the_fused_mlp(tmp_path, autoload_installed, stage, first, second, dtype):
    """ZeRO-3 partitions each parameter on its own, so one gate_up_proj and the gate_proj + up_proj it fuses cut
    into other rank slices at 2 ranks, while the flat partitions keep their sizes: DeepSpeed loaded a checkpoint
    of either layout into the other without a word, and every MLP's masters and moments were other rows' (the
    next step trained on them). Without ZeRO the saved torch optimizer state knows parameters by place only, and
    torch refused it ("a parameter group that doesn't match the size"). The load now rebuilds them per parameter,
    in both directions, also for an engine whose config has the block off or absent (ZeRO-1/2: the tests above);
    the next step is the saving engine's."""
    layouts = ("two", "one gate_up_proj") if first == "absent" else ("one gate_up_proj", "two")
    said = ((f"saved with the MLPs' gate and up projections as {layouts[0]}, loaded as {layouts[1]}: ZeRO-3 fp32 "
             "masters and Adam moments rebuilt per parameter") if stage == 3 else
            "saved with the MLPs' gate and up projections in the other layout (no ZeRO): the optimizer state mapped "
            "per parameter")
    output = _resume_across_the_fused_mlp(tmp_path, stage, first, second, dtype)
    assert said in output, output[-6000:]


@pytest.mark.parametrize("stage, first, second, optimizer, mlp_bias", [
    (0, "absent", "enabled", "deepspeed", True),  # FP16_Optimizer: loaded silently wrong
    (0, "enabled", "absent", "deepspeed", True),
    (0, "absent", "enabled", "deepspeed", False),  # the same element order: DeepSpeed's own load is right
    (0, "absent", "enabled", "script", True),  # FP16_UnfusedOptimizer: torch refused the groups
    (0, "enabled", "disabled", "script", True),
    (2, "absent", "enabled", "script", True),  # ZeRO maps by name: biases need nothing more
    (3, "enabled", "absent", "script", True),
])
def test_checkpoint_across_the_fused_mlp_with_mlp_biases(tmp_path, autoload_installed, stage, first, second,
                                                         optimizer, mlp_bias):
    """bf16 without ZeRO around DeepSpeed's own fused optimizer (FusedAdam: FP16_Optimizer, one flat fp32 master
    and flat moments a parameter group, no parameter boundaries saved): across the MLP layout the flats have the
    same size, and where the MLPs have biases another element order, [gate.weight, gate.bias, up.weight, up.bias]
    against [gate_up.weight, gate_up.bias]: DeepSpeed loaded them by size, up_proj's masters were the gate's bias
    and rows shifted by it, and the next step trained on them. Around a script's optimizer (FP16_UnfusedOptimizer),
    the per-parameter map put gate_proj and up_proj's weights where a stock run had gate_proj's weight and bias,
    and torch refused the groups. Both now load the saved masters and moments, and the next step is the saving
    engine's. ZeRO-2/3 know their state by parameter name: checked with biases too."""
    config_optimizer = {"type": "AdamW", "params": {"lr": 1e-2}} if optimizer == "deepspeed" else None
    output = _resume_across_the_fused_mlp(tmp_path, stage, first, second, "bf16", optimizer=config_optimizer,
                                          mlp_bias=mlp_bias)
    if stage == 0:
        kind = "FP16_Optimizer" if optimizer == "deepspeed" else "FP16_UnfusedOptimizer"
        assert f"optimizers: {kind} {kind}" in output, output[-6000:]
    mapped = ("in the other layout (no ZeRO): the optimizer state mapped" if stage == 0 else
              "saved with the MLPs' gate and up projections as")
    assert (mapped in output) == (mlp_bias or optimizer == "script"), output[-6000:]


@pytest.mark.parametrize("stage, first, second, dtype", [
    (3, "fused_adamw_clip", "absent", "fp32"),
    (3, "absent", "fused_adamw_clip", "bf16"),
])
def test_checkpoint_across_the_fused_mlp_with_fused_adamw_clip_at_zero3(tmp_path, autoload_installed, stage, first,
                                                                        second, dtype):
    """FusedAdamWClip at ZeRO-3 (standing in for the script's AdamW) keeps its state as torch's AdamW keeps it, one
    entry per ZeRO-3 sub-group's fp32 partition: a stock run resumes its checkpoint across the MLP layout and the
    other way, masters and moments as saved, and the next step is the saving engine's."""
    output = _resume_across_the_fused_mlp(tmp_path, stage, first, second, dtype)
    assert "FusedAdamWClip takes the script's AdamW" in output, output[-6000:]


@pytest.mark.parametrize("stage, first, second, dtype, frozen", [
    (3, "enabled", "absent", "fp32", ["embed_tokens"]),  # was loaded silently wrong, as without frozen parameters
    (3, "absent", "enabled", "bf16", ["mlp"]),  # was a KeyError: the frozen gate_up_proj looked up by name
    (3, "enabled", "disabled", "fp32", ["layers.0.mlp"]),  # one MLP frozen, the other trained
    (2, "absent", "enabled", "bf16", ["embed_tokens", "layers.0.mlp"]),  # "parameter-alignment layout", KeyError
    (2, "enabled", "absent", "fp32", ["mlp"]),
    (1, "enabled", "absent", "fp32", ["embed_tokens"]),
])
def test_checkpoint_across_the_fused_mlp_with_frozen_parameters(tmp_path, autoload_installed, stage, first, second,
                                                                dtype, frozen):
    """Frozen parameters (a fine-tune that trains part of the model): the layout check compared the saved
    optimizer's parameter names with all of the engine's, frozen ones included, so it never matched, and DeepSpeed's
    own load ran: at ZeRO-3 silently wrong again, at ZeRO-1/2 refused. And DeepSpeed saves frozen parameters apart
    (ZeRO-2/3: ``frozen_param_fragments``) and looks each up by name: a frozen MLP in the other layout was a
    KeyError. Both now load; the weights, masters and moments are the saved ones, the next step the saving
    engine's."""
    output = _resume_across_the_fused_mlp(tmp_path, stage, first, second, dtype, frozen)
    if stage >= 2 and any("mlp" in part for part in frozen):
        assert "frozen MLP projections saved in the other layout" in output, output[-6000:]


@pytest.mark.parametrize("stage, first, second, dtype, frozen", [
    (3, "enabled", "absent", "fp32", []),
    (2, "absent", "enabled", "bf16", ["embed_tokens"]),
])
def test_checkpoint_across_the_fused_mlp_with_optimizer_offload(tmp_path, autoload_installed, stage, first, second,
                                                                dtype, frozen):
    """The same with the optimizer offloaded to the CPU (its fp32 masters and moments live on the host)."""
    _resume_across_the_fused_mlp(tmp_path, stage, first, second, dtype, frozen,
                                 offload={"offload_optimizer": {"device": "cpu"}})


def _resume_across_the_fused_mlp(tmp_path, stage, first, second, dtype, frozen=(), offload=None, optimizer=None,
                                 mlp_bias=False) -> str:
    """MLP_LAYOUT_SCRIPT on 2 ranks (``optimizer``: the config's, DeepSpeed's own; ``mlp_bias``: MLPs with
    biases); checks what it saved; its output."""
    import torch

    blocks = {"absent": None, "enabled": {"enabled": True}, "disabled": {"enabled": False},
              "fused_adamw_clip": {"enabled": True, "optimizer": {"fused_adamw_clip": True}}}
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}
    config = {**DS_BASE, "zero_optimization": {**zero, **(offload or {})}, "gradient_clipping": 1.0,
              "bf16": {"enabled": dtype == "bf16"}}
    if offload:  # the script's torch AdamW, which DeepSpeed would replace by its CPU Adam
        config["zero_force_ds_cpu_optimizer"] = False
    if optimizer is not None:
        config["optimizer"] = optimizer
    output = _run_script(tmp_path, MODEL_SNIPPET + MLP_LAYOUT_SCRIPT, config, str(tmp_path / "ckpt"),
                         json.dumps(blocks[first]), json.dumps(blocks[second]), json.dumps(list(frozen)), ranks=2,
                         env={"LF_TEST_MLP_BIAS": "1" if mlp_bias else "0"})
    result = torch.load(tmp_path / "ckpt" / "result.pt")
    on = ("enabled", "fused_adamw_clip")
    assert result["fused"] == [first in on, second in on] and result["steps"] == [3, 3]
    assert result["saved"].keys() == result["loaded"].keys()
    for name, value in result["saved"].items():
        assert torch.equal(result["loaded"][name], value), name
    atol = 1e-6 if dtype == "fp32" else 1e-3  # the fused kernels' sums in another order; bf16: one ulp of a weight
    for name, value in result["first_after"].items():
        other = result["second_after"][name]
        if dtype == "bf16":  # Adam moves an element whose gradients were all tiny (RMS < 1e-5, a second moment < 1e-10;
            # the median is ~1e-7) by about lr whatever their size, so there the fused kernels' bf16 sums and stock's
            # (a near-cancelling sum, 0 in one run) disagree by up to lr; a state loaded wrong moves whole tensors
            other = torch.where(torch.minimum(value[2], other[2]) < 1e-10, value, other)
        torch.testing.assert_close(other, value, rtol=0, atol=atol, msg=name)
    return output


# a dense Llama trained 2 steps under argv[1]'s config with argv[3]'s block (JSON; null: none) and saved; the same
# model under argv[4]'s block loads it without the optimizer states and steps once; the fp32 masters (stock names)
# and weights of both, as saved / loaded, and the second's weights after its step
NO_OPTIMIZER_STATES_SCRIPT = LLAMA_ENGINE_SNIPPET + """
base = json.load(open(sys.argv[1]))
first, second = (engine_for(base if block is None else {**base, "loongforge": block})
                 for block in (json.loads(arg) for arg in sys.argv[3:5]))
print("optimizers:", type(first.optimizer).__name__, type(second.optimizer).__name__)
for ids in batches[:2]:
    step(first, ids)
first.save_checkpoint(out, tag="ckpt", client_state={"user": 7})
_, client_state = second.load_checkpoint(out, tag="ckpt", load_optimizer_states=False)
# the masters' names ds_loongforge records for the export (with the package installed) are not the client's
print("client state:", client_state.get("user"), "loongforge_16bit_optimizer_params" in client_state)
result = {"saved": masters(first), "loaded": masters(second),
          **{key: {k: v.clone() for k, v in engine.module.state_dict().items()}
             for key, engine in (("weights", first), ("loaded_weights", second))}}
step(second, batches[2])
result["stepped_weights"] = dict(second.module.state_dict())
torch.save(result, os.path.join(out, "result.pt"))
leave()
"""


AUTOLOAD = "import ds_loongforge._autoload  # noqa: F401  (what loongforge_autoload.pth does)\n"
# argv[3]'s dtypes (comma-separated) without ZeRO around DeepSpeed's own optimizer (argv[1]'s config), a Llama with MLP
# biases (LF_TEST_MLP_BIAS=1) on the accelerator: a stock run's checkpoint into a LoongForge engine and the other way,
# each with and without the optimizer states; every fp32 master (and with the states its moments) as saved. Run after
# AUTOLOAD (the device runs the tests from the source tree, without the installed .pth)
FP16_OPTIMIZER_SCRIPT = LLAMA_ENGINE_SNIPPET + """
from deepspeed.accelerator import get_accelerator

batches = batches.to(get_accelerator().current_device_name())
ok = True
for dtype in sys.argv[3].split(","):
    base = {**json.load(open(sys.argv[1])), dtype: {"enabled": True}}
    for blocks in ((None, {"enabled": True}), ({"enabled": True}, None)):
        first = engine_for(base if blocks[0] is None else {**base, "loongforge": blocks[0]})
        for ids in batches[:2]:
            step(first, ids)
        tag = f"{dtype}_{blocks[0] is None}"
        first.save_checkpoint(out, tag=tag)
        saved = states(first)
        for with_states in (True, False):
            second = engine_for(base if blocks[1] is None else {**base, "loongforge": blocks[1]})
            assert any("gate_up_proj" in n for e in (first, second) for n, _ in e.module.named_parameters())
            assert type(second.optimizer).__name__ == "FP16_Optimizer"
            second.load_checkpoint(out, tag=tag, load_optimizer_states=with_states)
            loaded = states(second) if with_states else masters(second)
            wrong = [n for n, v in loaded.items() if not torch.equal(v, saved[n] if with_states else saved[n][0])]
            print(json.dumps({"dtype": dtype, "saved_fused": blocks[0] is not None, "with_states": with_states,
                              "wrong": wrong}), flush=True)
            ok &= not wrong
print("ALL_OK" if ok else "WRONG")
leave()
"""


@pytest.mark.parametrize("accelerator, dtypes", [
    ("cpu", "bf16"),  # DeepSpeed's CPU FusedAdam: keeps the script right where no GPU is
    pytest.param("cuda", "fp16,bf16", marks=pytest.mark.gpu),  # DeepSpeed's CUDA FusedAdam
])
def test_fp16_optimizer_checkpoints_across_the_fused_mlp(tmp_path, accelerator, dtypes):
    """The two FP16_Optimizer fixes above (the flats' element order across the MLP layout, and the masters of a load
    without optimizer states) with DeepSpeed's FusedAdam of the accelerator, in each dtype it runs."""
    config = {**DS_BASE, "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    output = _run_script(tmp_path, AUTOLOAD + MODEL_SNIPPET + FP16_OPTIMIZER_SCRIPT, config, str(tmp_path / "ckpt"),
                         dtypes, env={"DS_ACCELERATOR": accelerator, "LF_TEST_MLP_BIAS": "1"})
    loads = 2 * len(dtypes.split(","))  # each dtype: a stock checkpoint into LoongForge, and the other way
    assert "ALL_OK" in output, output[-6000:]
    assert output.count("the optimizer state mapped per parameter") == loads, output[-6000:]
    assert output.count("fp32 masters set from the checkpoint's") == loads, output[-6000:]


@pytest.mark.parametrize("first, second, optimizer", [
    ("enabled", "enabled", "deepspeed"),  # FP16_Optimizer
    ("enabled", "enabled", "script"),  # FP16_UnfusedOptimizer
    ("absent", "enabled", "deepspeed"),  # across the MLP layout (MLP biases: another element order)
    ("enabled", "disabled", "script"),
])
def test_load_without_optimizer_states_keeps_the_loaded_weights(tmp_path, autoload_installed, first, second,
                                                               optimizer):
    """``load_checkpoint(load_optimizer_states=False)`` (a fine-tune from a checkpoint with a fresh optimizer) without
    ZeRO in bf16: DeepSpeed loaded the 16-bit weights and left its fp32 masters at the new model's initial values
    (only ``load_module_only`` refreshes them), so the first step wrote those masters over the loaded weights: the
    run trained on from its initialisation, without a word (the weights moved by 0.125 in one step at lr 1e-2 here).
    The masters are now the checkpoint's fp32 ones, in either MLP layout; the moments start afresh."""
    import torch

    blocks = {"absent": None, "enabled": {"enabled": True}, "disabled": {"enabled": False}}
    config = {**DS_BASE, "gradient_clipping": 1.0, "bf16": {"enabled": True}}
    if optimizer == "deepspeed":
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
    output = _run_script(tmp_path, MODEL_SNIPPET + NO_OPTIMIZER_STATES_SCRIPT, config, str(tmp_path / "ckpt"),
                         json.dumps(blocks[first]), json.dumps(blocks[second]),
                         env={"LF_TEST_MLP_BIAS": "1" if first != second else "0"})
    kind = "FP16_Optimizer" if optimizer == "deepspeed" else "FP16_UnfusedOptimizer"
    assert f"optimizers: {kind} {kind}" in output, output[-6000:]
    assert "loaded without its optimizer states (no ZeRO" in output and "set from the checkpoint's" in output, \
        output[-6000:]
    assert "client state: 7 False" in output, output[-6000:]
    saved = torch.load(tmp_path / "ckpt" / "ckpt" / "mp_rank_00_model_states.pt", weights_only=False)
    assert saved["loongforge_16bit_optimizer_params"]["optimizer"] == kind
    result = torch.load(tmp_path / "ckpt" / "result.pt")
    assert result["saved"].keys() == result["loaded"].keys()
    for name, value in result["saved"].items():
        assert torch.equal(result["loaded"][name], value), name
    for name, value in result["weights"].items():
        assert torch.equal(result["loaded_weights"][name], value), name
        # one first AdamW step from the loaded weights (lr 1e-2; the two optimizers' weight decay is at most 0.1)
        excess = adam_first_step_excess(value, result["stepped_weights"][name], lr=1e-2, weight_decay=0.1)
        assert excess <= 1e-6, (name, excess)


# a dense Llama (argv[5]: the parameters frozen, engine_for) trained 2 steps under argv[1]'s config with argv[3]'s
# block (JSON; null: none), saved and stepped once more (argv[4] "save"); or the same model under argv[3]'s block,
# that checkpoint loaded ("load"; the latest tag) or the universal checkpoint converted from it with DeepSpeed's
# universal loading on ("load_universal"), and stepped once on the same batch
RESUME_SCRIPT = LLAMA_ENGINE_SNIPPET + """
config = json.load(open(sys.argv[1]))
block = json.loads(sys.argv[3])
loading = sys.argv[4] != "save"
if sys.argv[4] == "load_universal":
    config["checkpoint"] = {"load_universal": True}
engine = engine_for(config if block is None else {**config, "loongforge": block}, json.loads(sys.argv[5]))
if loading:
    engine.load_checkpoint(out)
else:
    for ids in batches[:2]:
        step(engine, ids)
    engine.save_checkpoint(out, tag="ckpt")
before = states(engine)
step(engine, batches[2])
after = states(engine)  # collective
if torch.distributed.get_rank() == 0:
    torch.save({"before": before, "after": after, "steps": engine.global_steps,
                "fused": any("gate_up_proj" in n for n, _ in engine.module.named_parameters())},
               os.path.join(out, ("load" if loading else "save") + ".pt"))
leave()
"""


@pytest.mark.parametrize("stage, first, second, dtype, load_ranks, frozen", [
    (2, "enabled", "absent", "fp32", 1, []),
    (2, "absent", "enabled", "bf16", 2, []),
    (3, "enabled", "disabled", "fp32", 2, []),
    (3, "absent", "enabled", "fp32", 1, []),
    (2, "enabled", "enabled", "fp32", 1, []),  # the same layout: DeepSpeed's own load, untouched
    (2, "enabled", "absent", "fp32", 2, ["embed_tokens", "layers.0.mlp"]),
    (3, "absent", "enabled", "fp32", 2, ["embed_tokens", "layers.0.mlp"]),
])
def test_universal_checkpoint_across_the_fused_mlp(tmp_path, autoload_installed, stage, first, second, dtype,
                                                   load_ranks, frozen):
    """DeepSpeed's universal checkpoints (ds_to_universal: one folder of fp32 master, moments and step per
    parameter, loadable at another world size) name the folders by parameter: a stock run's, loaded with the
    block on, was a FileNotFoundError for each gate_up_proj; a LoongForge run's, loaded with it off or removed,
    "Steps [...] are not equal" (ds_to_universal also writes fp32-only folders for the module's state-dict keys,
    which are transformers' gate_proj / up_proj). The states are now joined or cut per parameter, also at another
    world size and with frozen parameters (a frozen MLP among them); the loaded masters, moments and frozen weights
    are the saved ones and the next step is the saving engine's."""
    output = _resume_in_another_process(tmp_path, stage, first, second, dtype, load_ranks, frozen, universal=True)
    assert ("a universal checkpoint with the MLPs' gate and up projections" in output) == (first != second), \
        output[-6000:]


@pytest.mark.parametrize("stage, first, second, load_ranks, frozen", [
    (3, "absent", "enabled", 4, []),
    (3, "enabled", "absent", 1, ["embed_tokens"]),
    (3, "absent", "enabled", 4, ["embed_tokens", "layers.0.mlp"]),
    (2, "enabled", "absent", 1, []),
    (2, "absent", "enabled", 4, ["embed_tokens", "layers.0.mlp"]),
])
def test_checkpoint_across_the_fused_mlp_at_another_world_size(tmp_path, autoload_installed, stage, first, second,
                                                               load_ranks, frozen):
    """Across the layout at another world size (DeepSpeed's own load refuses a ZeRO world-size change; the
    per-parameter rebuild does not need one). ZeRO-3: at more ranks than saved DeepSpeed stopped on a bare
    AssertionError (no model file of their own for the new ranks); at fewer, a frozen parameter's saved partition
    did not fit. New ranks now read rank 0's model file, and frozen partitions are cut again. ZeRO-2 passed."""
    output = _resume_in_another_process(tmp_path, stage, first, second, "fp32", load_ranks, frozen)
    said = ("ZeRO-3 fp32 masters and Adam moments rebuilt per parameter" if stage == 3 else
            "fp32 masters and Adam moments rebuilt from the saved partitions")
    assert said in output, output[-6000:]


def _resume_in_another_process(tmp_path, stage, first, second, dtype, load_ranks, frozen, universal=False) -> str:
    """RESUME_SCRIPT saving on 2 ranks and loading on ``load_ranks`` (a universal checkpoint converted from the save
    with ``universal``); checks that the loaded states are the saved ones and the next step the saving engine's;
    the loading run's output."""
    import torch

    blocks = {"absent": None, "enabled": {"enabled": True}, "disabled": {"enabled": False}}
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}
    config = {**DS_BASE, "zero_optimization": zero, "gradient_clipping": 1.0, "bf16": {"enabled": dtype == "bf16"}}
    out = tmp_path / "ckpt"
    _run_script(tmp_path, MODEL_SNIPPET + RESUME_SCRIPT, config, str(out), json.dumps(blocks[first]), "save",
                json.dumps(frozen), ranks=2)
    if universal:
        convert = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                                  str(out / "ckpt"), "--output_folder", str(out / "universal"),
                                  "--inject_missing_state"], env=_env({}), capture_output=True, text=True,
                                 timeout=TIMEOUT_S)
        assert convert.returncode == 0, convert.stdout[-3000:] + convert.stderr[-3000:]
    output = _run_script(tmp_path, MODEL_SNIPPET + RESUME_SCRIPT, config, str(out), json.dumps(blocks[second]),
                         "load_universal" if universal else "load", json.dumps(frozen), ranks=load_ranks)
    saved, loaded = torch.load(out / "save.pt"), torch.load(out / "load.pt")
    assert [saved["fused"], loaded["fused"]] == [first == "enabled", second == "enabled"]
    assert saved["steps"] == loaded["steps"] == 3
    assert saved["before"].keys() == loaded["before"].keys()
    for name, value in saved["before"].items():
        assert torch.equal(loaded["before"][name], value), name
    atol = 1e-6 if dtype == "fp32" else 1e-3  # as test_checkpoint_across_the_fused_mlp
    for name, value in saved["after"].items():
        torch.testing.assert_close(loaded["after"][name], value, rtol=0, atol=atol, msg=name)
    return output


# ZeRO-3, one step of a dense Llama under argv[1]'s config, then the model saved as the HF Trainer's save_model and
# accelerate's get_state_dict save it (the engine's consolidated 16-bit state dict, save_16bit_model) and loaded
# strictly into a stock LlamaForCausalLM
ZERO3_SAVE_SCRIPT = LLAMA_ENGINE_SNIPPET + """
engine = engine_for(json.load(open(sys.argv[1])))
step(engine, batches[0])
consolidated = engine._zero3_consolidated_16bit_state_dict()
with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
    own = {key: value.clone() for key, value in engine.module.state_dict().items()}
engine.save_16bit_model(out)
stock = LlamaForCausalLM(engine.module.config)
stock.load_state_dict(torch.load(os.path.join(out, "pytorch_model.bin")), strict=True)
print("SAVED " + json.dumps({
    "fused": any("gate_up_proj" in n for n, _ in engine.module.named_parameters()),
    "keys": sorted(consolidated) == sorted(own),
    "equal": all(torch.equal(consolidated[k], own[k]) for k in own if k in consolidated),
    "stock_equal": all(torch.equal(v, own[k]) for k, v in stock.state_dict().items())}))
leave()
"""


def test_zero3_consolidated_save_has_transformers_keys(tmp_path, autoload_installed):
    """Under ZeRO-3 the HF Trainer's save_model, accelerate's get_state_dict and save_16bit_model take DeepSpeed's
    consolidated 16-bit state dict, gathered parameter by parameter under named_parameters names: the fused MLP's
    gate_up_proj went into the saved model, and stock transformers initialised every MLP's gate and up projections
    at random (warning that they were newly initialised). The saved keys are now the module's state_dict keys, the
    weights its own, and a stock model loads them strictly."""
    config = {**DS_BASE, **ENABLED, "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}
    output = _run_script(tmp_path, MODEL_SNIPPET + ZERO3_SAVE_SCRIPT, config, str(tmp_path / "saved"))
    assert _tagged(output, "SAVED") == {"fused": True, "keys": True, "equal": True, "stock_equal": True}


# a frozen model (a DPO reference or distillation teacher) given to deepspeed.initialize with the training config and
# no optimizer; argv[3]: "bf16" or "fp32"
FROZEN_SCRIPT = MODEL_SNIPPET + """
import deepspeed

model.requires_grad_(False)
engine, optimizer, _, _ = deepspeed.initialize(model=model, config=sys.argv[1])
with torch.no_grad():
    logits = engine(input_ids=torch.randint(0, 64, (2, 16))).logits
print("FROZEN " + json.dumps({"optimizer": type(engine.optimizer).__name__, "returned": type(optimizer).__name__,
                              "finite": bool(torch.isfinite(logits).all())}))
report(engine.module, engine.optimizer or torch.optim.SGD([torch.zeros(1)], lr=0.0), engine)
leave()
"""


@pytest.mark.parametrize("precision, expected", [("fp32", "NoneType"), ("bf16", "BF16_Optimizer")])
def test_frozen_model_with_fused_adamw_clip_in_the_config(tmp_path, autoload_installed, precision, expected):
    """The training config (fused_adamw_clip in the block) reused for a frozen reference or teacher model, ZeRO-0 as
    TRL sets it for one: stock DeepSpeed builds no optimizer (BF16_Optimizer's wrapper in bf16); the hook built
    FusedAdamWClip on no parameters and torch raised "optimizer got an empty parameter list". Now the engine is
    stock's, with the modules injected."""
    config = {**DS_BASE, **FUSED_ADAMW_CLIP, "bf16": {"enabled": precision == "bf16"}}
    output = _run_script(tmp_path, FROZEN_SCRIPT, config, str(tmp_path), precision)
    assert _tagged(output, "FROZEN") == {"optimizer": expected, "returned": expected, "finite": True}
    assert "[LoongForge] optimizer: no FusedAdamWClip (no parameter of MixtralForCausalLM requires grad)" in output
    assert OUR_TYPES <= set(_result(output)["types"])


# ds_loongforge.optim.initialize with parameter groups whose "params" are generators or a lone tensor (torch's
# optimizers take them)
GENERATOR_GROUPS_SCRIPT = """
import json, os, sys
import torch
from ds_loongforge.optim import initialize

model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
groups = [{"params": torch.nn.Parameter(torch.zeros(3, 2))},  # a lone tensor, as torch takes it too
          {"params": (p for p in model[0].parameters()), "weight_decay": 0.0}, {"params": model[1].parameters()}]
engine, _, _, _ = initialize(model=model, model_parameters=groups, config=json.load(open(sys.argv[1])))
print("GROUPS " + json.dumps([len(g["params"]) for g in engine.basic_optimizer.param_groups]))
sys.stdout.flush()
os._exit(0)
"""


def test_fused_adamw_clip_takes_generator_param_groups(tmp_path, autoload_installed):
    """The frozen-model check (no parameter requires grad) reads each group's "params": a generator there must
    still reach FusedAdamWClip whole, and a lone multi-element tensor is not asked for its truth value."""
    output = _run_script(tmp_path, GENERATOR_GROUPS_SCRIPT, {**DS_BASE, "optimizer": {
        "type": "LoongForgeAdamW", "params": {"lr": 1e-3}}})
    assert _tagged(output, "GROUPS") == [1, 2, 2]


def test_library_entry_points_are_lazy():
    code = textwrap.dedent("""
        import sys, ds_loongforge
        assert "torch" not in sys.modules
        from ds_loongforge.integrations.inject import inject
        from ds_loongforge.integrations.deepspeed_hook import initialize
        assert ds_loongforge.inject is inject and ds_loongforge.initialize is initialize
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=_env({"LOONGFORGE_DISABLE": "1"}))
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


@pytest.mark.parametrize("user_timers,block,expected", [
    (None, {}, {"throughput": {"synchronized": False}}),
    ({"throughput": {"enabled": True}}, {}, {"throughput": {"enabled": True, "synchronized": False}}),
    ({"throughput": {"synchronized": True}}, {}, {"throughput": {"synchronized": True}}),  # the user's choice
    ({"throughput": {"enabled": False}}, {}, {"throughput": {"enabled": False}}),  # no timer, nothing to change
    (None, {"async_throughput_timer": False}, None),
    (None, {"enabled": False}, None),  # a disabled block changes nothing
])
def test_throughput_timer_setting(user_timers, block, expected):
    """initialize turns DeepSpeed's per-step device synchronizes of its throughput timer off unless the DeepSpeed
    config sets them or the block says not to; the caller's dict is never modified."""
    from ds_loongforge.config import parse_config, throughput_timer_setting

    ds_config = {**DS_BASE, "loongforge": {"enabled": True, **block}}
    if user_timers is not None:
        ds_config["timers"] = user_timers
    before = json.dumps(ds_config, sort_keys=True)
    out = throughput_timer_setting(ds_config, parse_config(ds_config))
    assert throughput_timer_setting(ds_config) == out  # the block parsed from the config itself
    assert json.dumps(ds_config, sort_keys=True) == before
    assert out.get("timers") == expected
    assert {k: v for k, v in out.items() if k != "timers"} == {k: v for k, v in ds_config.items() if k != "timers"}


def test_async_throughput_timer_must_be_a_bool():
    from ds_loongforge.config import LoongForgeConfigError, parse_config

    with pytest.raises(LoongForgeConfigError, match="async_throughput_timer = 'yes'"):
        parse_config({"loongforge": {"enabled": True, "async_throughput_timer": "yes"}})
