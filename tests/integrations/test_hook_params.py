"""deepspeed.initialize's hook and the Parameters a script collected before it: inject fuses a dense MLP's
gate_proj and up_proj into one gate_up_proj, so the remap by name found no match and an optimizer (or a
model_parameters list) built before deepspeed.initialize went on training the two dead tensors while gate_up_proj
never moved (every dense family, Qwen2-MoE's shared expert; the HF Trainer builds its optimizer first). Also: a
misspelt key in a block passed to inject, and training_data with a dense model."""

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ds_loongforge.integrations import deepspeed_hook
from ds_loongforge.integrations.inject import inject
from tests._dist import spawn_with_deadline

BLOCK = {"enabled": True, "sampler": {"expert_aware": False}}


def _llama(bias: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100, max_position_embeddings=64, mlp_bias=bias)
    return LlamaForCausalLM(config)


def _hf_groups(model):
    """The HF Trainer's two groups: weights with decay, biases and norms without."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "norm" not in n)]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _ids(params) -> list[int]:
    return [id(p) for p in params]


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_fused_mlp_parameters_replace_their_parts_in_a_client_optimizer(bias):
    """The fused Parameter takes its gate part's place, once; the up part leaves; Adam's moments already held for
    the parts are joined in the fused rows' order (gate rows first); every trainable Parameter of the injected
    model is in the optimizer exactly once, and nothing else."""
    model = _llama(bias)
    optimizer = torch.optim.AdamW(_hf_groups(model), lr=1e-2)
    model(torch.randint(0, 100, (2, 8)), labels=torch.randint(0, 100, (2, 8))).loss.backward()
    optimizer.step()  # moments exist for every part
    mlp = model.model.layers[0].mlp
    old_states = {name: optimizer.state[getattr(mlp, name).weight]["exp_avg"].clone()
                  for name in ("gate_proj", "up_proj")}
    before = dict(model.named_parameters())
    inject(model, BLOCK)
    remap = deepspeed_hook._parameter_remap(before, dict(model.named_parameters()))
    moved = deepspeed_hook._remap_optimizer(optimizer, remap)
    assert moved == 2 * 2 * (2 if bias else 1)  # layers x (gate, up) x (weight, bias)
    held = [p for g in optimizer.param_groups for p in g["params"]]
    assert sorted(_ids(held)) == sorted(_ids(model.parameters())), "optimizer and model Parameters differ"
    fused = model.model.layers[0].mlp.gate_up_proj.weight
    assert torch.equal(optimizer.state[fused]["exp_avg"], torch.cat([old_states["gate_proj"],
                                                                     old_states["up_proj"]]))
    assert optimizer.param_groups[0]["weight_decay"] == 0.1 and any(p is fused for p in held[:len(
        optimizer.param_groups[0]["params"])])
    before_step = fused.detach().clone()
    model(torch.randint(0, 100, (2, 8)), labels=torch.randint(0, 100, (2, 8))).loss.backward()
    optimizer.step()
    assert not torch.equal(before_step, fused.detach()), "gate_up_proj did not train"


def test_fused_mlp_parameters_replace_their_parts_in_model_parameters():
    for collected in ("list", "groups"):
        model = _llama(bias=True)
        params = list(model.parameters()) if collected == "list" else _hf_groups(model)
        before = dict(model.named_parameters())
        inject(model, BLOCK)
        remap = deepspeed_hook._parameter_remap(before, dict(model.named_parameters()))
        out = deepspeed_hook._remap_model_parameters(params, remap)
        flat = out if collected == "list" else [p for g in out for p in g["params"]]
        assert sorted(_ids(flat)) == sorted(_ids(model.parameters())), collected


def test_a_parameter_that_left_the_model_without_a_replacement_is_an_error():
    model = _llama()
    before = dict(model.named_parameters())
    model.model.layers[0].self_attn.q_proj = torch.nn.Linear(32, 32, bias=True)  # renamed: .weight stays, +bias
    after = dict(model.named_parameters())
    after.pop("model.layers.0.self_attn.q_proj.weight")
    with pytest.raises(RuntimeError, match="q_proj.weight.*no parameter of the injected model takes its place"):
        deepspeed_hook._parameter_remap(before, after)


def test_a_misspelt_key_of_the_block_passed_to_inject_is_an_error():
    """A key only the block has makes the dict the block, so a misspelt neighbour is named (it was read as a
    DeepSpeed config without the block: everything silently off)."""
    from ds_loongforge.config import LoongForgeConfigError

    with pytest.raises(LoongForgeConfigError, match="fused_kernel.*did you mean 'fused_kernels'"):
        inject(_llama(), {"enabled": True, "fused_kernel": {"rmsnorm": True}})
    with pytest.raises(LoongForgeConfigError, match="strict_op.*did you mean 'strict_ops'"):
        inject(_llama(), {"enabled": True, "strict_op": False})
    report = inject(_llama(), {"train_batch_size": 8, "optimizer": {"type": "AdamW"}})  # a DeepSpeed config
    assert not report.replaced  # without a "loongforge" block: disabled


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        ids = torch.arange(8) + i
        return {"input_ids": ids, "labels": ids}


def _worker(rank, world, port, out_dir):
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world))
    import argparse

    import ds_loongforge

    try:  # a config in args and one in the call: DeepSpeed's own refusal, not a silent choice of one
        ds_loongforge.initialize(model=_llama(), args=argparse.Namespace(deepspeed_config="elsewhere.json"),
                                 config={"train_micro_batch_size_per_gpu": 2, "loongforge": {"enabled": True}})
        both = "accepted"
    except AssertionError as error:
        both = str(error)
    model = _llama()
    optimizer = torch.optim.AdamW(_hf_groups(model), lr=1e-2)  # built before initialize, as the HF Trainer does
    engine, optimizer, loader, _ = ds_loongforge.initialize(
        model=model, optimizer=optimizer, training_data=Rows(),
        config={"train_micro_batch_size_per_gpu": 2, "loongforge": {"enabled": True}})  # sampler on by default
    fused = engine.module.model.layers[0].mlp.gate_up_proj.weight
    before = fused.detach().clone()
    batch = next(iter(loader))
    engine.backward(engine(**batch).loss)
    engine.step()
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    torch.save({"both": both, "loader": type(loader).__name__, "trained": not torch.equal(before, fused.detach()),
                "all_held": held == {id(p) for p in engine.module.parameters()}}, f"{out_dir}/rank{rank}.pt")


def test_initialize_trains_the_fused_mlp_and_gives_a_dense_model_deepspeeds_loader(tmp_path):
    """End to end through ds_loongforge.initialize: the client optimizer trains gate_up_proj, and training_data
    with a dense model (no router: nothing for the expert-aware sampler, on by default, to balance) goes to
    DeepSpeed's loader (it raised after the engine was built). A config both in args and in the call is DeepSpeed's
    error, as without LoongForge (the hook used to pick the call's)."""
    spawn_with_deadline(_worker, 1, str(tmp_path), timeout_s=300)
    result = torch.load(tmp_path / "rank0.pt")
    assert result.pop("both").startswith("Not sure how to proceed, we were given deepspeed configs in the deepspeed "
                                          "arguments and deepspeed.initialize() function call"), result
    assert result == {"loader": "DeepSpeedDataLoader", "trained": True, "all_held": True}, result


def test_every_familys_injected_parameters_replace_the_collected_ones():
    """For each supported family: an AdamW over the stock model's Parameters holds exactly the injected model's
    after the remap (no family renames a Parameter the remap cannot place)."""
    from tests.integrations.test_inject import ENABLED, FAMILIES, build

    for family in FAMILIES:
        model = build(family)
        before = dict(model.named_parameters())
        optimizer = torch.optim.AdamW(list(before.values()))
        inject(model, ENABLED)
        deepspeed_hook._remap_optimizer(optimizer,
                                        deepspeed_hook._parameter_remap(before, dict(model.named_parameters())))
        held = [p for g in optimizer.param_groups for p in g["params"]]
        assert sorted(_ids(held)) == sorted(_ids(model.parameters())), family


def test_expert_parallelism_on_a_model_without_moe_is_said():
    report = inject(_llama(), {"enabled": True, "moe": {"ep_size": 2}})
    assert any("moe.ep_size=2 has no effect: LlamaForCausalLM has no MoE block" in note for note in report.notes)
    assert "[LoongForge] note: moe.ep_size=2 has no effect" in report.summary()
