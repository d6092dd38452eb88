"""ds_loongforge.export (``loongforge_export``) on checkpoints of real training runs (CPU, gloo, 4 processes).

- Expert-parallel checkpoints of injected models (Mixtral: ZeRO-2 bf16 + FusedAdamWClip with ep_size 2 in both
  of DeepSpeed's group layouts, ZeRO-1 fp32 with DeepSpeed's AdamW and ep_size 4, ep_size 1, ZeRO-1 bf16 under
  DeepSpeed's BF16_Optimizer (fp32 gradient accumulation) at ep_size 2, ZeRO-0 bf16 at ep_size 2 under
  FP16_UnfusedOptimizer and FP16_Optimizer (whose masters, by the names recorded at save time, are compared with
  the wrapper's live ones); Qwen2-MoE and
  DeepSeek-V3, with shared experts, dense MLP layers and a router buffer, at ep_size 2): the export equals, bit for
  bit, the fp32 masters DeepSpeed itself assembles at run time (``safe_get_full_fp32_param`` on each rank, every
  expert-parallel rank's experts concatenated in order), under transformers' keys, and loads strictly into the
  stock model; ``from_pretrained`` reads the written folder back.
- A dense injected Llama (fused gate/up MLP with biases, tied embeddings, a frozen weight and a frozen fused MLP),
  under ZeRO-2, ZeRO-3 and ZeRO-0 bf16 (FP16_Optimizer's flat masters): the fused gate_up master comes out as transformers' gate_proj / up_proj, the tied
  lm_head as the embedding's master, the frozen weights as saved (the frozen gate_up_proj cut as the master is).
- What must be an error: a missing rank's optimizer file, a missing expert's file or MoE layer, files of two
  different saves, a bad config. What must not: NaN masters (a diverged run), a checkpoint without its frozen
  weights (a warning).
"""

import json
import logging
import os
import shutil

import pytest
import torch

import deepspeed  # noqa: F401  (an install requirement: a missing one must fail, not skip)

from ds_loongforge.checkpoint import SIXTEEN_BIT_PARAMS_KEY
from ds_loongforge.export import CheckpointExportError, export, load_state_dict, main
from tests._dist import spawn_with_deadline

WORLD = 4
VOCAB, STEPS = 64, 2
SPAWN_TIMEOUT_S = 300


def _mixtral():
    from transformers import MixtralConfig

    return MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
                         max_position_embeddings=32)


def _llama():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                       tie_word_embeddings=True, mlp_bias=True)


def _ds_config(stage: int, bf16: bool, ep_size: int, fused_adamw_clip: bool, data_before: bool = False,
               fp32_grad_accum: bool = False, deepspeed_adam: bool = False) -> dict:
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16}, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.1, "torch_adam": True}},
              "loongforge": {"enabled": True, "strict_ops": False, "fused_kernels": {"rmsnorm": True, "swiglu": True},
                             "moe": {"ep_size": ep_size}, "optimizer": {"fused_adamw_clip": fused_adamw_clip},
                             "sampler": {"expert_aware": False}}}
    if data_before:
        config["use_data_before_expert_parallelism"] = True
    if fp32_grad_accum:  # ZeRO-1 bf16 then runs DeepSpeed's BF16_Optimizer, whose files differ
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    if deepspeed_adam:  # DeepSpeed's own (CPU) FusedAdam: without ZeRO in bf16, FP16_Optimizer's flat masters
        del config["optimizer"]["params"]["torch_adam"]
    return config


# name -> (model, DeepSpeed config); every rank runs them in this order, each with a fresh engine
RUNS = {
    "zero2_bf16_ep2": ("mixtral", _ds_config(2, True, 2, True)),
    "zero2_bf16_ep2_data_before_expert": ("mixtral", _ds_config(2, True, 2, True, data_before=True)),
    "zero1_fp32_ep4": ("mixtral", _ds_config(1, False, 4, False)),
    "zero2_bf16_ep1": ("mixtral", _ds_config(2, True, 1, True)),
    "zero1_bf16_optimizer_ep2": ("mixtral", _ds_config(1, True, 2, False, fp32_grad_accum=True)),
    "zero0_fp32_ep2": ("mixtral", _ds_config(0, False, 2, False)),
    "zero0_bf16_ep2": ("mixtral", _ds_config(0, True, 2, False)),  # FP16_UnfusedOptimizer
    "zero0_bf16_ep2_deepspeed_adam": ("mixtral", _ds_config(0, True, 2, False, deepspeed_adam=True)),
    "qwen2_moe_ep2": ("qwen2_moe", _ds_config(2, True, 2, True)),
    "deepseek_v3_ep2": ("deepseek_v3", _ds_config(2, True, 2, True)),
    "zero2_bf16_llama": ("llama", _ds_config(2, True, 1, True)),
    "zero3_bf16_llama": ("llama", _ds_config(3, True, 1, False)),
    "zero0_bf16_llama": ("llama", _ds_config(0, True, 1, False, deepspeed_adam=True)),
}
# without ZeRO in bf16: DeepSpeed's wrapper of each run's optimizer
SIXTEEN_BIT_WRAPPERS = {"zero0_bf16_ep2": "FP16_UnfusedOptimizer", "zero0_bf16_ep2_deepspeed_adam": "FP16_Optimizer",
                        "zero0_bf16_llama": "FP16_Optimizer"}
FROZEN = "model.layers.0.self_attn.q_proj.weight"  # frozen in the llama run
FROZEN_MLP = "model.layers.0.mlp"  # its gate_proj and up_proj frozen too: the injected gate_up_proj is frozen


def _forget_expert_groups() -> None:
    """DeepSpeed keeps one expert group per name (ep_size_<n>) for the life of the process, in the layout of
    the call that made it; the runs here ask for two layouts of ep_size 2 in one process."""
    from deepspeed.utils import groups

    for table in (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS,
                  groups._EXPERT_DATA_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS):
        table.clear()


def _train_and_save(rank, world, port, seed, ckpt_root, out_dir):
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    from deepspeed.utils import safe_get_full_fp32_param
    from transformers import LlamaForCausalLM, MixtralForCausalLM

    import ds_loongforge
    from ds_loongforge.modules.moe import ExpertMaskedMoE
    from tests.integrations.test_inject import build

    results = {}
    for name, (family, config) in RUNS.items():
        _forget_expert_groups()
        torch.manual_seed(seed)
        if family == "mixtral":
            model = MixtralForCausalLM(_mixtral())
        elif family == "llama":
            model = LlamaForCausalLM(_llama())
            model.get_parameter(FROZEN).requires_grad_(False)
            for proj in ("gate_proj", "up_proj"):
                model.get_submodule(f"{FROZEN_MLP}.{proj}").requires_grad_(False)
        else:
            model = build(family)
        engine, *_ = ds_loongforge.initialize(model=model, model_parameters=model.parameters(), config=config)
        g = torch.Generator().manual_seed(seed + 1 + rank)
        for _ in range(STEPS):
            ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=g)
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        engine.save_checkpoint(os.path.join(ckpt_root, name), tag=f"step{STEPS}")
        # DeepSpeed's own assembly of each master from its ZeRO partitions (a collective, in the same order on
        # every rank); frozen parameters have none
        masters = {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}
        if type(engine.optimizer).__name__ in ("FP16_Optimizer", "FP16_UnfusedOptimizer"):  # bf16 without ZeRO:
            # DeepSpeed's function has no answer there
            assert not any(m is not None for m in masters.values()), name
            masters = _sixteen_bit_wrapper_masters(engine)
        moe = [m for m in engine.module.modules() if isinstance(m, ExpertMaskedMoE)]
        keys = set(engine.module.state_dict())
        results[name] = {
            "masters": {n: m.detach().clone() for n, m in masters.items() if m is not None},
            "weights": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
            "buffers": {n: b.detach().clone() for n, b in engine.module.named_buffers() if n in keys},
            "ep_rank": moe[0].ep_rank if moe else 0,
            "optimizer": type(engine.optimizer).__name__,
        }
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def _sixteen_bit_wrapper_masters(engine) -> dict:
    """The live fp32 masters of DeepSpeed's bf16/fp16 wrapper without ZeRO, by parameter name: FP16_Optimizer's
    flat group cut over its parameters, FP16_UnfusedOptimizer's list."""
    optimizer = engine.optimizer
    names = {id(p): n for n, p in engine.module.named_parameters()}
    masters = {}
    for g, group in enumerate(optimizer.fp16_groups):
        held = (torch._utils._unflatten_dense_tensors(optimizer.fp32_groups_flat[g], group)
                if type(optimizer).__name__ == "FP16_Optimizer" else optimizer.fp32_groups[g])
        masters.update({names[id(p)]: m for p, m in zip(group, held, strict=True)})
    return masters


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Checkpoints of every run in RUNS and each rank's run-time masters."""
    root = tmp_path_factory.mktemp("export")
    seed = int(torch.randint(0, 2**31, ()))
    spawn_with_deadline(_train_and_save, WORLD, seed, str(root / "ckpt"), str(root), timeout_s=SPAWN_TIMEOUT_S)
    ranks = [torch.load(root / f"rank{rank}.pt") for rank in range(WORLD)]
    return root, ranks


def _expected(ranks: list, name: str, ep_size: int) -> dict:
    """The run-time masters as one model, under the engine's parameter names: dense ones equal on every rank,
    stacked experts concatenated over the expert-parallel ranks (equal on the ranks of one
    expert-data-parallel group)."""
    expected = {}
    for key, value in ranks[0][name]["masters"].items():
        if ep_size > 1 and ".experts." in key:
            by_ep_rank = {}
            for result in ranks:
                held = by_ep_rank.setdefault(result[name]["ep_rank"], result[name]["masters"][key])
                assert torch.equal(held, result[name]["masters"][key]), (name, key)
            assert sorted(by_ep_rank) == list(range(ep_size)), (name, sorted(by_ep_rank))
            expected[key] = torch.cat([by_ep_rank[e] for e in range(ep_size)])
        else:
            for result in ranks:
                assert torch.equal(result[name]["masters"][key], value), (name, key)
            expected[key] = value
    return expected


def _under_transformers_keys(masters: dict) -> dict:
    """An injected FusedSwiGLUMLP trains one gate_up_proj [2I, H] (and bias): gate_proj's rows, then up_proj's."""
    out = {}
    for key, value in masters.items():
        prefix, fused, kind = key.rpartition(".gate_up_proj.")
        if fused:
            out[f"{prefix}.gate_proj.{kind}"], out[f"{prefix}.up_proj.{kind}"] = value.chunk(2)
        else:
            out[key] = value
    return out


def _stock(family: str):
    import transformers

    from tests.integrations.test_inject import COMMON, FAMILIES

    if family == "mixtral":
        return transformers.MixtralForCausalLM(_mixtral())
    if family == "llama":
        return transformers.LlamaForCausalLM(_llama())
    config_cls, model_cls, kwargs, _ = FAMILIES[family]
    return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**COMMON, **kwargs}))


@pytest.mark.parametrize("name", [n for n, (family, config) in RUNS.items()
                                  if family != "llama" and n != "zero0_fp32_ep2"])
def test_export_is_deepspeeds_fp32_masters(trained, name):
    """Without ZeRO in bf16 (DeepSpeed's FP16_Optimizer and FP16_UnfusedOptimizer, whose files name no parameter)
    the export used to refuse the masters; it reads them by the names recorded at save time."""
    root, ranks = trained
    family, config = RUNS[name]
    assert ranks[0][name]["optimizer"] == SIXTEEN_BIT_WRAPPERS.get(name, ranks[0][name]["optimizer"])
    ep_size = config["loongforge"]["moe"]["ep_size"]
    expected = _under_transformers_keys(_expected(ranks, name, ep_size))
    buffers = ranks[0][name]["buffers"]
    got = load_state_dict(str(root / "ckpt" / name))
    assert set(got) == set(expected) | set(buffers)
    for key, value in got.items():
        assert value.dtype == torch.float32, key
        want = expected[key] if key in expected else buffers[key].float()
        assert torch.equal(value, want), f"{name}: {key} is not the optimizer's fp32 master"
    stock = _stock(family)
    stock.load_state_dict(got, strict=True)
    experts = [p for n, p in stock.named_parameters() if n.endswith("experts.gate_up_proj")]
    assert experts and all(p.shape == got[n].shape for n, p in stock.named_parameters() if n in got)
    if name == "zero2_bf16_ep2_data_before_expert":
        # the config's layout: expert-parallel groups [0, 2] and [1, 3], so rank 1 holds the first experts
        assert [r[name]["ep_rank"] for r in ranks] == [0, 0, 1, 1]
    elif ep_size == 2:
        assert [r[name]["ep_rank"] for r in ranks] == [0, 1, 0, 1]
    if name == "zero1_bf16_optimizer_ep2":
        assert ranks[0][name]["optimizer"] == "BF16_Optimizer"
    if family == "deepseek_v3":  # the router's correction bias: a buffer, taken as saved
        assert any(key.endswith("e_score_correction_bias") for key in buffers)


def test_export_writes_a_folder_from_pretrained_reads(trained, tmp_path, capsys):
    from transformers import MixtralForCausalLM

    root, _ = trained
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(root / "ckpt" / "zero2_bf16_ep2", checkpoint)
    _mixtral().save_pretrained(checkpoint)  # beside 'latest', as launch/train.py writes it
    assert main([str(checkpoint), str(tmp_path / "hf")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["model"] == "MixtralForCausalLM" and summary["dtypes"] == ["float32"], summary
    loaded = MixtralForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    want = load_state_dict(str(checkpoint))
    state = loaded.state_dict()
    assert set(state) == set(want)
    for key, value in want.items():
        assert torch.equal(state[key], value), key

    # no config: a bare safetensors state dict, sharded above max_shard_size
    summary = export(str(root / "ckpt" / "zero2_bf16_ep2"), str(tmp_path / "bare"), max_shard_size="20KB")
    assert summary["model"] is None
    from safetensors.torch import load_file

    index = json.loads((tmp_path / "bare" / "model.safetensors.index.json").read_text())
    shards = {}
    for filename in set(index["weight_map"].values()):
        shards.update(load_file(tmp_path / "bare" / filename))
    assert len(set(index["weight_map"].values())) > 1
    assert set(shards) == set(want)
    for key, value in want.items():
        assert torch.equal(shards[key], value), key


def _weights_as_one_model(ranks: list, name: str) -> dict:
    """Every rank's weights, experts concatenated in expert-parallel rank order (ep_size 2)."""
    held = {r[name]["ep_rank"]: r[name]["weights"] for r in ranks}
    return {key: torch.cat([held[0][key], held[1][key]]) if ".experts." in key else value
            for key, value in held[0].items()}


def test_zero0_fp32_export_is_the_weights(trained):
    """Without ZeRO the fp32 run's weights are its masters."""
    root, ranks = trained
    got = load_state_dict(str(root / "ckpt" / "zero0_fp32_ep2"))
    want = _weights_as_one_model(ranks, "zero0_fp32_ep2")
    assert set(got) == set(want)
    for key, value in got.items():
        assert value.dtype == torch.float32 and torch.equal(value, want[key]), key


@pytest.mark.parametrize("name", ["zero0_bf16_ep2", "zero0_bf16_ep2_deepspeed_adam"])
def test_zero0_16bit_masters_need_their_names(trained, tmp_path, name):
    """A bf16 checkpoint without ZeRO saved without the record of its masters' names (stock DeepSpeed, or an
    earlier ds_loongforge) is an error naming --source module, which exports the bf16 weights; so is one whose
    expert-parallel optimizer files are not all there, or whose masters are another save's (the other wrapper's)."""
    root, ranks = trained
    checkpoint, step = _copy(trained, tmp_path, name)
    model_file = step / "mp_rank_00_model_states.pt"
    states = torch.load(model_file, weights_only=False)
    record = states.pop(SIXTEEN_BIT_PARAMS_KEY)
    assert record["optimizer"] == SIXTEEN_BIT_WRAPPERS[name]
    torch.save(states, model_file)
    with pytest.raises(CheckpointExportError, match=r"holds no ZeRO optimizer files and its weights are "
                                                    r"torch\.bfloat16.*without the record.*--source module"):
        load_state_dict(str(checkpoint))
    got = load_state_dict(str(checkpoint), source="module")
    want = _weights_as_one_model(ranks, name)
    for key, value in got.items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, want[key]), key

    states[SIXTEEN_BIT_PARAMS_KEY] = record
    torch.save(states, model_file)
    load_state_dict(str(checkpoint))
    last = step / "expp_rank_1_mp_rank_00_optim_states.pt"
    kept = last.read_bytes()
    last.unlink()
    with pytest.raises(CheckpointExportError, match=r"has 4 experts and the 1 expert-parallel optimizer files hold 2"):
        load_state_dict(str(checkpoint))
    last.write_bytes(kept)
    other = "zero0_bf16_ep2_deepspeed_adam" if name == "zero0_bf16_ep2" else "zero0_bf16_ep2"  # the other wrapper
    shutil.copy(root / "ckpt" / other / f"step{STEPS}" / last.name, last)
    with pytest.raises(CheckpointExportError, match=r"expp_rank_1_mp_rank_00_optim_states\.pt: its optimizer state "
                                                    r"holds no FP16_\w+ fp32 masters"):
        load_state_dict(str(checkpoint))


def test_zero0_16bit_llama_export_has_transformers_keys(trained):
    """FP16_Optimizer's flat masters of an injected Llama with MLP biases: the flat holds the fused MLP's
    gate_up_proj weight then bias (not transformers' gate weight, gate bias, up weight, up bias); the export cuts
    them by the recorded names into transformers' keys, the tied lm_head the embedding's master."""
    _llama_export_is_the_masters(trained, "zero0_bf16_llama")


def _llama_export_is_the_masters(trained, name: str) -> dict:
    """The llama run's export equals its run-time masters under transformers' keys (the tied lm_head, the frozen
    weight as saved) and loads strictly into the stock model; returns those masters."""
    root, ranks = trained
    masters = _under_transformers_keys(_expected(ranks, name, 1))
    assert "model.layers.1.mlp.up_proj.bias" in masters
    masters["lm_head.weight"] = masters["model.embed_tokens.weight"]  # tied
    assert FROZEN not in masters
    weights = ranks[0][name]["weights"]
    masters[FROZEN] = weights[FROZEN].float()  # no master: the bf16 weight, exactly
    frozen_mlp = {n: w.float() for n, w in weights.items() if n.startswith(f"{FROZEN_MLP}.gate_up_proj.")}
    assert frozen_mlp and not set(_under_transformers_keys(frozen_mlp)) & set(masters)
    masters.update(_under_transformers_keys(frozen_mlp))
    got = load_state_dict(str(root / "ckpt" / name))
    assert set(got) == set(masters)
    for key, value in got.items():
        assert value.dtype == torch.float32 and torch.equal(value, masters[key]), key
    _stock("llama").load_state_dict(got, strict=True)
    return masters


def test_dense_llama_export_has_transformers_keys(trained, tmp_path):
    from transformers import LlamaForCausalLM

    root, ranks = trained
    name = "zero2_bf16_llama"
    masters = _llama_export_is_the_masters(trained, name)

    _llama().save_pretrained(tmp_path / "config")  # a config with no "architectures": AutoModelForCausalLM's pick
    assert export(str(root / "ckpt" / name), str(tmp_path / "hf"), config=str(tmp_path / "config"))["model"] == \
        "LlamaForCausalLM"
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, masters[key]), key


def test_zero3_llama_export_has_transformers_keys(trained, tmp_path):
    """A ZeRO-3 checkpoint: DeepSpeed's zero_to_fp32 assembles it under the engine's parameter names, so the
    fused MLP's gate_up_proj came out as such and stock transformers initialised its MLPs at random; and the export
    refused ZeRO-3 (or found no model file: ZeRO-3 names it per rank). Now the masters DeepSpeed holds at run time
    come out under transformers' keys (the tied lm_head, the frozen weight as saved) and load strictly."""
    from transformers import LlamaForCausalLM

    root, ranks = trained
    name = "zero3_bf16_llama"
    masters = _llama_export_is_the_masters(trained, name)
    _llama().save_pretrained(tmp_path / "config")
    export(str(root / "ckpt" / name), str(tmp_path / "hf"), config=str(tmp_path / "config"))
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, masters[key]), key
    with pytest.raises(CheckpointExportError, match="ZeRO-3 checkpoint, whose model files hold no weights"):
        load_state_dict(str(root / "ckpt" / name), source="module")


def test_module_source_is_the_weights_the_model_ran_with(trained):
    root, ranks = trained
    name = "zero2_bf16_ep2"
    got = load_state_dict(str(root / "ckpt" / name), source="module")
    masters = load_state_dict(str(root / "ckpt" / name))
    for key, value in got.items():
        assert value.dtype == torch.bfloat16, key
        if ".experts." in key:
            held = {r[name]["ep_rank"]: r[name]["weights"][key] for r in ranks}
            want = torch.cat([held[e] for e in range(2)])
        else:
            want = ranks[0][name]["weights"][key]
        assert torch.equal(value, want), key
        assert torch.equal(value, masters[key].to(torch.bfloat16))


def _copy(trained, tmp_path, name="zero2_bf16_ep2"):
    root, _ = trained
    checkpoint = tmp_path / name
    shutil.copytree(root / "ckpt" / name, checkpoint)
    return checkpoint, checkpoint / f"step{STEPS}"


def test_missing_optimizer_file_is_named(trained, tmp_path):
    checkpoint, step = _copy(trained, tmp_path)
    (step / "bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointExportError, match=r"ranks \[0, 1, 2\]: those of \[3\] are missing"):
        load_state_dict(str(checkpoint))


def test_missing_expert_file_is_named(trained, tmp_path):
    checkpoint, step = _copy(trained, tmp_path)
    (step / "layer_1_expert_2_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointExportError, match=r"layers\.1\.mlp\.experts\.\w+ is missing the files of experts "
                                                    r"\[2\] of 4"):
        load_state_dict(str(checkpoint))


def test_missing_moe_layer_is_named(trained, tmp_path):
    """All the files of one MoE layer gone: an error for the saved weights too, not a model without it."""
    checkpoint, step = _copy(trained, tmp_path)
    for path in step.glob("layer_1_expert_*_mp_rank_00_model_states.pt"):
        path.unlink()
    with pytest.raises(CheckpointExportError, match=r"2 MoE layers and the per-expert files of layers \[1\] are "
                                                    "missing"):
        load_state_dict(str(checkpoint), source="module")


def test_a_nan_master_matches_its_nan_weight(trained, tmp_path):
    """A diverged run's checkpoint is still one save: a NaN master and its NaN bf16 weight agree."""
    checkpoint, step = _copy(trained, tmp_path)
    model_file = step / "mp_rank_00_model_states.pt"
    states = torch.load(model_file, weights_only=False)
    key = next(iter(states["param_shapes"][0]))  # the first parameter of the dense group starts rank 0's partition
    states["module"][key].view(-1)[0] = float("nan")
    torch.save(states, model_file)
    optim_file = step / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    optim = torch.load(optim_file, weights_only=False)
    with torch.no_grad():  # the saved partition is a Parameter
        optim["optimizer_state_dict"]["single_partition_of_fp32_groups"][0][0] = float("nan")
    torch.save(optim, optim_file)
    got = load_state_dict(str(checkpoint))
    assert got[key].view(-1)[0].isnan() and not got[key].view(-1)[1:].isnan().any()


def test_checkpoint_without_frozen_parameters_is_said(trained, tmp_path, caplog):
    """save_checkpoint(exclude_frozen_parameters=True) (here: its files edited so) keeps no frozen weights: the
    export says so, and a config's strict key check names it."""
    checkpoint, step = _copy(trained, tmp_path, "zero2_bf16_llama")
    model_file = step / "mp_rank_00_model_states.pt"
    states = torch.load(model_file, weights_only=False)
    del states["module"][FROZEN]
    states["frozen_param_shapes"] = states["frozen_param_fragments"] = None
    torch.save(states, model_file)
    with caplog.at_level(logging.WARNING, logger="ds_loongforge"):
        assert FROZEN not in load_state_dict(str(checkpoint))
    assert "saved with exclude_frozen_parameters" in caplog.text
    _llama().save_pretrained(tmp_path / "config")
    with pytest.raises(CheckpointExportError, match=r"missing \['model\.layers\.0\.self_attn\.q_proj\.weight'\].*"
                                                    "exclude_frozen_parameters"):
        export(str(checkpoint), str(tmp_path / "hf"), config=str(tmp_path / "config"))


def test_files_of_two_saves_are_an_error(trained, tmp_path):
    """An expert file of another run (here: the ep_size 2 run in the other layout, whose experts differ) beside
    this run's optimizer files: the masters do not round to it."""
    root, _ = trained
    checkpoint, step = _copy(trained, tmp_path)
    other = root / "ckpt" / "zero2_bf16_ep2_data_before_expert" / f"step{STEPS}"
    expert_file = "layer_0_expert_3_mp_rank_00_model_states.pt"
    assert not torch.equal(*(next(iter(torch.load(d / expert_file).values())) for d in (step, other)))
    shutil.copy(other / expert_file, step / expert_file)
    with pytest.raises(CheckpointExportError, match=r"fp32 masters do not round to the weights saved beside them: "
                                                    r"model\.layers\.0\.mlp\.experts\.gate_up_proj"):
        load_state_dict(str(checkpoint))
    load_state_dict(str(checkpoint), source="module")  # the saved weights alone are what they are


def test_not_a_checkpoint_and_bad_source(tmp_path, trained):
    with pytest.raises(CheckpointExportError, match="mp_rank_00_model_states.pt is missing"):
        load_state_dict(str(tmp_path))
    root, _ = trained
    with pytest.raises(CheckpointExportError, match="source='fp16': must be one of"):
        load_state_dict(str(root / "ckpt" / "zero2_bf16_ep2"), source="fp16")
    assert main([str(tmp_path), str(tmp_path / "out")]) == 1
    assert main([str(root / "ckpt" / "zero2_bf16_ep2"), str(tmp_path / "out"), "--config", str(tmp_path)]) == 1


def test_cli_errors_are_one_line_and_checked_before_the_checkpoint_is_read(tmp_path, trained, capsys):
    """An output path that is a file, an unparsable --max-shard-size (said before the checkpoint is read and the
    folder made) and an unreadable model file: `loongforge_export: error: ...` and exit status 1, no traceback."""
    root, _ = trained
    source = str(root / "ckpt" / "zero2_bf16_ep2")
    (tmp_path / "a_file").write_text("x")
    assert main([source, str(tmp_path / "a_file")]) == 1
    assert "is a file; give a folder" in capsys.readouterr().err
    assert main([source, str(tmp_path / "out"), "--max-shard-size", "lots"]) == 1
    assert "max_shard_size='lots'" in capsys.readouterr().err and not (tmp_path / "out").exists()
    broken = tmp_path / "broken"
    shutil.copytree(source, broken)
    step = (broken / "latest").read_text().strip()
    (broken / step / "mp_rank_00_model_states.pt").write_bytes(b"not a torch file")
    assert main([str(broken), str(tmp_path / "out2")]) == 1
    assert "loongforge_export: error: could not read the checkpoint" in capsys.readouterr().err
