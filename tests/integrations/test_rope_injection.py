"""fused_kernels.rope: inject patches modeling_<family>.apply_rotary_pos_emb with a wrapper that runs Liger-Kernel's
fused RoPE on CUDA tensors and transformers' function otherwise.

CPU (always): without liger-kernel nothing is patched and the summary says why; the switch; idempotence; the
wrapper gives CPU tensors to the original (bitwise the stock model); which calls the wrapper hands to the fused
function (and in which dtype); a fused function with Liger's in-place contract inside whole models gives stock
logits and gradients; config validation. GPU (``gpu`` marker, needs liger-kernel): the patched function is
Liger's; Liger against HF's function on random inputs; tiny models with the patch against stock.
"""

import copy
import inspect
import logging
import sys

import pytest
import torch
import transformers
from torch import nn

from ds_loongforge.config import FusedKernelsConfig, LoongForgeConfigError, parse_config
from ds_loongforge.integrations import rope
from ds_loongforge.integrations.inject import KIND_ROPE, inject
from ds_loongforge.integrations.presets import PRESETS
from ds_loongforge.ops.numerics import max_error, relative_l2_error, tolerance
from transformers.models.llama import modeling_llama
from transformers.models.mixtral import modeling_mixtral
from transformers.models.qwen3 import modeling_qwen3

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128)
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", modeling_mixtral,
                dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", modeling_qwen3, dict(intermediate_size=48, head_dim=16)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", modeling_llama, dict(intermediate_size=48)),
}
# every other kind off: the model differs from stock in its rotary function only (``rounding`` is a choice,
# not an on/off switch: it stays at its default)
ROPE_ONLY = {"enabled": True, "fused_kernels": {name: name == "rope" for name, field in FusedKernelsConfig.model_fields.items()
                                                if field.annotation is bool},
             "moe": {"expert_masked": False, "sync_free_balancing_loss": False}}
ALL_ON = {"enabled": True}
ORIGINALS = {name: module.apply_rotary_pos_emb for name, (_, _, module, _) in FAMILIES.items()}


@pytest.fixture(autouse=True)
def _restore_rope():
    """The patch is process-wide: every test starts and ends with transformers' own functions."""
    rope.restore()
    yield
    rope.restore()
    for name, (_, _, module, _) in FAMILIES.items():
        assert module.apply_rotary_pos_emb is ORIGINALS[name], f"{name}: a test left its patch in place"


def _rope_patches(report) -> dict:
    """The report's patched functions of the RoPE kind (ALL_ON also installs the balancing-loss function, and every
    inject of a transformers model the causal-mask skip under compile)."""
    return {kind: names for kind, names in report.patched_functions.items() if kind.startswith(KIND_ROPE)}


def build(family: str, device="cpu", dtype=torch.float32, **overrides) -> nn.Module:
    config_cls, model_cls, _, kwargs = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**COMMON, **kwargs, **overrides})
    return getattr(transformers, model_cls)(config).to(device, dtype)


def run(model: nn.Module, ids: torch.Tensor):
    """Logits and every parameter gradient (by name) of one forward + backward of the next-token loss (computed
    here from the logits: a forward with labels may hand the loss to a fused LM head + cross-entropy instead)."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
    return logits.detach(), {name: p.grad for name, p in model.named_parameters()}


def hf_rope(q, k, cos, sin):
    """transformers' function as shipped (the reference)."""
    return ORIGINALS["llama"](q, k, cos, sin)


def rope_inputs(batch, heads_q, heads_k, seq, head_dim, cos_batch=1, dtype=torch.float32, device="cpu",
                layout="projection", cos_dtype=None):
    """q [B, Hq, S, D], k [B, Hk, S, D] and HF's cos/sin [1 or B, S, D] (halves duplicated).

    layout "projection": q/k are transposes of [B, S, H, D] tensors, as HF's attention makes them (Liger rotates
    them in place); "contiguous": [B, H, S, D] tensors (Liger copies)."""
    def qk(heads):
        if layout == "projection":
            return torch.randn(batch, seq, heads, head_dim, device=device, dtype=dtype).transpose(1, 2)
        return torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype)

    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    positions = torch.arange(seq, device=device, dtype=torch.float32)[None].expand(cos_batch, seq)
    positions = positions + torch.randint(0, 50, (cos_batch, 1), device=device)  # per-row offsets
    freqs = positions[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos_dtype = cos_dtype or dtype
    return qk(heads_q), qk(heads_k), emb.cos().to(cos_dtype), emb.sin().to(cos_dtype)


class RecordingFused:
    """A stand-in for Liger's function: records what it was given, returns HF's result."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, cos, sin):
        self.calls.append((q, k, cos, sin))
        return hf_rope(q, k, cos, sin)


class SavedStorages:
    """Every storage autograd saves (saved_tensors_hooks) and every storage the fake rotates in its forward, in
    order: a node that saved a tensor of a storage before that storage was rotated would read rotated values in
    backward, which is the hazard of writing in place where autograd cannot see it."""

    def __init__(self):
        self.events = []  # ("saved" | "rotated", storage data_ptr)

    def hooks(self):
        def pack(t):
            self.events.append(("saved", t.untyped_storage().data_ptr()))
            return t
        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def rotated(self, t):
        self.events.append(("rotated", t.untyped_storage().data_ptr()))

    def clobbered(self):
        saved_before = set()
        bad = []
        for kind, ptr in self.events:
            if kind == "saved":
                saved_before.add(ptr)
            elif ptr in saved_before:
                bad.append(ptr)
        return bad


def _rotate_into(x, cos, sin, sign, audit=None):
    """The fused function's contract: x [B, H, S, D] rotated in x's own storage when ``rope.rows_in_place(x)`` (HF's
    projection layout, a column slice of the fused q/k/v product), else in a copy; the result is a [B, H, S, D]
    view of that storage. Forward (``audit`` given) writes as a Triton store does, unseen by autograd (through
    ``.data``: no version bump), and reports the storage to the audit; backward's copy_ bumps the incoming
    gradient's version counter, so a gradient that something else still holds raises instead of silently
    changing."""
    buf = x.transpose(1, 2) if rope.rows_in_place(x) else x.transpose(1, 2).contiguous()
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    x1, x2 = buf.chunk(2, dim=-1)
    rotated = buf * c + torch.cat((-x2, x1), dim=-1) * s * sign
    if audit is None:
        buf.copy_(rotated)
    else:
        audit.rotated(buf)
        buf.data.copy_(rotated)
    return buf.transpose(1, 2)


class InPlaceRope(torch.autograd.Function):
    """Liger's rope with its in-place behaviour, in PyTorch (forward and backward rotate in place)."""

    audit: SavedStorages | None = None

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        audit = InPlaceRope.audit or SavedStorages()
        return _rotate_into(q, cos, sin, 1.0, audit), _rotate_into(k, cos, sin, 1.0, audit)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        return _rotate_into(dq, cos, sin, -1.0), _rotate_into(dk, cos, sin, -1.0), None, None


def fake_liger(monkeypatch, fused=None, cuda=True):
    """Make inject find a 'liger' (``fused``) and a CUDA device, whatever this machine has."""
    fused = fused or RecordingFused()
    monkeypatch.setattr(rope, "load_liger", lambda: (fused, "fake-liger 0.0"))
    monkeypatch.setattr(rope, "cuda_visible", lambda: cuda)
    return fused


# ---------------------------------------------------------------------------------------------------- CPU


_INTERPRETED_ROW_STRIDED_ROPE = """
import json, sys, torch
from ds_loongforge.integrations import rope
from tests.integrations.test_rope_injection import hf_rope, rope_inputs

torch.manual_seed(int(sys.argv[1]))  # the test's seed: a failure reproduces
fused, label = rope.load_liger()
out = {"row_strided": fused == rope.RowStridedRope.apply, "label": label, "cases": []}
for batch, hq, hk, seq, hd, cos_batch in [(2, 8, 2, 16, 32, 1), (1, 4, 4, 7, 16, 1), (3, 6, 2, 5, 24, 3),
                                          (1, 8, 2, 1, 32, 1)]:
    _, _, cos, sin = rope_inputs(batch, hq, hk, seq, hd, cos_batch)
    q_cols, kv_cols = hq * hd, hk * hd
    leaf = torch.randn(batch, seq, q_cols + 2 * kv_cols, requires_grad=True)

    def slices(y):
        q, k, v = y.split([q_cols, kv_cols, kv_cols], dim=-1)
        return q.view(batch, seq, hq, hd).transpose(1, 2), k.view(batch, seq, hk, hd).transpose(1, 2), v

    q, k, v = slices(leaf * 1)
    q_out, k_out = rope.RowStridedRope.apply(q, k, cos, sin)
    dq, dk = torch.randn_like(q_out), torch.randn_like(k_out)
    sent = (dq.clone(), dk.clone())
    (grad,) = torch.autograd.grad((q_out, k_out), leaf, sent)
    ref = leaf.detach().double().requires_grad_()
    q_ref, k_ref, _ = slices(ref * 1)
    q_want, k_want = hf_rope(q_ref, k_ref, cos.double(), sin.double())
    (grad_want,) = torch.autograd.grad((q_want, k_want), ref, (dq.double(), dk.double()))
    out["cases"].append({
        "in_place": q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr(),
        "forward_error": max((q_out.double() - q_want).abs().max().item(),
                             (k_out.double() - k_want).abs().max().item()),
        "grad_error": (grad.double() - grad_want).abs().max().item(),
        # one token at position offset 0 has sin = 0: the rotation is the identity and leaves dq as it was
        "grad_outputs_rotated_in_place": not torch.equal(sent[0], dq) or bool((sin == 0).all())})
from ds_loongforge.ops.numerics import row_strided_rope_checks  # what loongforge_report --verify runs on a GPU
out["verify_failures"] = [r.describe() for r in row_strided_rope_checks(2, 9, 8, 2, 32, torch.float32, fused,
                                                                         device="cpu") if not r.passed]
print(json.dumps(out))
"""


def test_row_strided_rope_kernel_under_triton_interpreter():
    """RowStridedRope launches Liger's Triton kernel on the fused q/k/v product's column slices: run on the CPU by
    Triton's interpreter (TRITON_INTERPRET=1, set before the kernel is defined, so in a subprocess), it rotates
    them in place, to fp32 rounding of HF's fp64 values and gradients, on GQA, MHA, per-batch cos and one token;
    and, as Liger's own backward does, it rotates [B, S, H, D]-dense incoming gradients in place (why callers
    that reuse grad_outputs must pass copies)."""
    import json
    import os
    import subprocess
    from pathlib import Path

    pytest.importorskip("liger_kernel", reason="needs liger-kernel (pip install liger-kernel==0.8.5)")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-c", _INTERPRETED_ROW_STRIDED_ROPE, str(torch.initial_seed())], env=env,
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["row_strided"], f"liger-kernel's _triton_rope arguments changed ({result['label']})"
    for case in result["cases"]:
        assert case["in_place"] and case["grad_outputs_rotated_in_place"], case
        assert case["forward_error"] < 1e-5 and case["grad_error"] < 1e-5, case
    assert result["verify_failures"] == []  # fp32: the interpreter gets bf16 wrong for Liger's own function too


def test_presets_name_standard_rotary_functions():
    """Each preset's rope is HF's standard function in this transformers (checked on values, not the name);
    DeepSeek-V3 has none and says why."""
    import importlib

    for preset in PRESETS:
        if preset.resolve() is None:
            continue
        if preset.rope is None:
            assert preset.name == "deepseek_v3" and "interleaved" in preset.rope_why_not
            continue
        function = getattr(importlib.import_module(preset.modeling_module), preset.rope)
        assert rope.standard_rope_problem(function) is None, preset.name
    from transformers.models.deepseek_v3 import modeling_deepseek_v3

    assert "does not compute" in rope.standard_rope_problem(modeling_deepseek_v3.apply_rotary_pos_emb_interleave)


def test_without_liger_nothing_is_patched(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, rope.LIGER_MODULE, None)  # `import liger_kernel.transformers.rope` fails
    monkeypatch.setattr(rope, "cuda_visible", lambda: True)
    model = build("mixtral")
    with caplog.at_level(logging.INFO, logger="ds_loongforge"):
        report = inject(model, ALL_ON)
    assert modeling_mixtral.apply_rotary_pos_emb is ORIGINALS["mixtral"]
    assert _rope_patches(report) == {}
    assert report.not_patched == [("modeling_mixtral.apply_rotary_pos_emb",
                                   "liger-kernel is not installed (pip install liger-kernel)")]
    assert ("[LoongForge] not replaced: modeling_mixtral.apply_rotary_pos_emb: liger-kernel is not installed"
            in caplog.text)
    assert report.not_replaced == []  # modules: all replaced as before


def test_no_cuda_device_nothing_is_patched(monkeypatch):
    fused = fake_liger(monkeypatch, cuda=False)
    report = inject(build("llama"), ROPE_ONLY)
    assert modeling_llama.apply_rotary_pos_emb is ORIGINALS["llama"] and not fused.calls
    assert "no CUDA device" in dict(report.not_patched)["modeling_llama.apply_rotary_pos_emb"]


def test_switched_off_nothing_is_patched(monkeypatch):
    fake_liger(monkeypatch)
    report = inject(build("mixtral"), {"enabled": True, "fused_kernels": {"rope": False}})
    assert modeling_mixtral.apply_rotary_pos_emb is ORIGINALS["mixtral"] and _rope_patches(report) == {}
    assert report.not_patched == [("modeling_mixtral.apply_rotary_pos_emb", "fused_kernels.rope is false")]
    report = inject(build("mixtral"), {"enabled": False})
    assert modeling_mixtral.apply_rotary_pos_emb is ORIGINALS["mixtral"] and report.not_patched == []


def test_deepseek_is_reported_not_patched(monkeypatch):
    fake_liger(monkeypatch)
    config = transformers.DeepseekV3Config(**{**COMMON, "hidden_size": 32}, intermediate_size=48,
                                           moe_intermediate_size=16, n_routed_experts=4, n_shared_experts=1,
                                           num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                                           q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
                                           v_head_dim=8)
    report = inject(transformers.DeepseekV3ForCausalLM(config), ALL_ON)
    (name, reason), = report.not_patched
    assert name == "modeling_deepseek_v3.apply_rotary_pos_emb" and "interleaved" in reason
    assert "modeling_deepseek_v3.apply_rotary_pos_emb: deepseek_v3: partial, interleaved" in report.summary()


def test_patch_is_idempotent_and_keeps_the_original(monkeypatch, caplog):
    fused = fake_liger(monkeypatch)
    with caplog.at_level(logging.INFO, logger="ds_loongforge"):
        first = inject(build("mixtral"), ALL_ON)
    wrapper = modeling_mixtral.apply_rotary_pos_emb
    assert wrapper is not ORIGINALS["mixtral"]
    assert getattr(wrapper, rope.ORIGINAL_ATTR) is ORIGINALS["mixtral"]
    assert rope.original(wrapper) is ORIGINALS["mixtral"]
    assert getattr(wrapper, rope.FUSED_ATTR) is fused
    assert _rope_patches(first) == {f"{KIND_ROPE} (fake-liger 0.0)": ["modeling_mixtral.apply_rotary_pos_emb"]}
    assert "[LoongForge] fused RoPE (fake-liger 0.0): modeling_mixtral.apply_rotary_pos_emb" in caplog.text
    assert first.families == ["mixtral"]

    second = inject(build("mixtral"), ALL_ON)  # a second model of the family: the wrapper is not wrapped again
    assert modeling_mixtral.apply_rotary_pos_emb is wrapper
    assert second.patched_functions == first.patched_functions
    assert rope.patch(modeling_mixtral.__name__, "apply_rotary_pos_emb", fused, "fake-liger 0.0") is None
    assert modeling_mixtral.apply_rotary_pos_emb is wrapper
    assert rope.patched() == [f"{modeling_mixtral.__name__}.apply_rotary_pos_emb"]
    assert rope.restore() == [f"{modeling_mixtral.__name__}.apply_rotary_pos_emb"]
    assert modeling_mixtral.apply_rotary_pos_emb is ORIGINALS["mixtral"] and rope.patched() == []


def test_only_the_model_families_are_patched(monkeypatch):
    fake_liger(monkeypatch)
    inject(build("qwen3"), ROPE_ONLY)
    assert modeling_qwen3.apply_rotary_pos_emb is not ORIGINALS["qwen3"]
    assert modeling_mixtral.apply_rotary_pos_emb is ORIGINALS["mixtral"]
    assert modeling_llama.apply_rotary_pos_emb is ORIGINALS["llama"]


@pytest.mark.parametrize("family", ["mixtral", "qwen3"])
def test_cpu_tensors_run_the_original_bitwise(monkeypatch, family):
    """A model injected on a CUDA machine but run on the CPU: the wrapper hands its calls to the original."""
    fused = fake_liger(monkeypatch)
    stock = build(family).train()
    injected = copy.deepcopy(stock)
    inject(injected, ROPE_ONLY)
    assert getattr(FAMILIES[family][2].apply_rotary_pos_emb, rope.FUSED_ATTR) is fused
    ids = torch.randint(0, VOCAB, (2, 11))
    logits, grads = run(injected, ids)
    rope.restore()
    ref_logits, ref_grads = run(stock, ids)
    assert not fused.calls
    assert torch.equal(logits, ref_logits)
    for name, grad in grads.items():
        assert torch.equal(grad, ref_grads[name]), name
    q, k, cos, sin = rope_inputs(2, 4, 2, 7, 16)
    wrapper = rope.make_wrapper(ORIGINALS[family], fused, "fake")
    for got, want in zip(wrapper(q, k, cos, sin), ORIGINALS[family](q, k, cos, sin)):
        assert torch.equal(got, want)


def _wrapper_on_cpu(fused):
    """The wrapper with "cpu" as its fused device, to check on this machine which calls reach ``fused``."""
    return rope.make_wrapper(ORIGINALS["llama"], fused, "fake", device_type="cpu")


def test_wrapper_hands_standard_calls_to_fused_unchanged():
    fused = RecordingFused()
    wrapper = _wrapper_on_cpu(fused)
    for kwargs in ({}, {"unsqueeze_dim": 1}):
        q, k, cos, sin = rope_inputs(2, 4, 2, 9, 16, cos_batch=2)
        out = wrapper(q, k, cos, sin, **kwargs)
        assert [t is u for t, u in zip(fused.calls[-1], (q, k, cos, sin))] == [True] * 4
        for got, want in zip(out, hf_rope(q, k, cos, sin)):
            assert torch.equal(got, want)
    q, k, cos, sin = rope_inputs(2, 4, 2, 9, 16)
    wrapper(q, k, cos, sin, 1)  # unsqueeze_dim positionally
    assert len(fused.calls) == 3


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_wrapper_runs_the_original_under_torch_compile():
    """Liger's Triton launch breaks the graph (the first GPU run of tests/integrations/test_compile.py: one break per
    model); under compile the wrapper leaves the standard expression to the compiler, which fuses it itself."""
    fused = RecordingFused()
    wrapper = _wrapper_on_cpu(fused)
    q, k, cos, sin = rope_inputs(2, 4, 2, 9, 16)
    explanation = torch._dynamo.explain(wrapper)(q, k, cos, sin)
    assert explanation.graph_break_count == 0
    compiled = torch.compile(wrapper, backend="aot_eager")(q, k, cos, sin)
    assert not fused.calls
    for got, want in zip(compiled, hf_rope(q, k, cos, sin)):
        assert torch.equal(got, want)
    wrapper(q, k, cos, sin)  # eager: the fused function still takes the call
    assert len(fused.calls) == 1


def test_wrapper_casts_to_the_dtype_hf_computes_in():
    """Autocast: q/k bf16, cos/sin fp32. HF's broadcasting computes and returns fp32; the fused call gets fp32."""
    fused = RecordingFused()
    q, k, cos, sin = rope_inputs(1, 2, 2, 5, 8, dtype=torch.bfloat16, cos_dtype=torch.float32)
    out = _wrapper_on_cpu(fused)(q, k, cos, sin)
    assert [t.dtype for t in fused.calls[0]] == [torch.float32] * 4
    want = hf_rope(q, k, cos, sin)
    assert [t.dtype for t in out] == [t.dtype for t in want] == [torch.float32] * 2
    for got, ref in zip(out, want):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("case", ["fp64", "unsqueeze_dim_2", "cos_requires_grad", "qk_dtypes_differ", "empty",
                                  "cos_batch_mismatch", "partial_cos", "odd_head_dim", "position_ids_kwarg"])
def test_wrapper_falls_back_to_the_original(case):
    fused = RecordingFused()
    wrapper = _wrapper_on_cpu(fused)
    q, k, cos, sin = rope_inputs(2, 4, 2, 6, 8)
    kwargs = {}
    if case == "fp64":
        q, k, cos, sin = (t.double() for t in (q, k, cos, sin))
    elif case == "unsqueeze_dim_2":  # [B, S, H, D] layout
        q, k, kwargs = q.transpose(1, 2), k.transpose(1, 2), {"unsqueeze_dim": 2}
    elif case == "cos_requires_grad":
        cos = cos.clone().requires_grad_()
    elif case == "qk_dtypes_differ":
        k = k.bfloat16()
    elif case == "empty":
        q, k, cos, sin = rope_inputs(2, 4, 2, 0, 8)
    elif case == "cos_batch_mismatch":  # broadcasts in HF; not a layout the kernel indexes
        q, k, cos, sin = rope_inputs(1, 4, 2, 6, 8, cos_batch=2)
    elif case == "partial_cos":  # cos over half the head: HF raises, as the wrapper must let it
        cos, sin = cos[..., :4], sin[..., :4]
    elif case == "odd_head_dim":
        q, k, cos, sin = rope_inputs(2, 4, 2, 6, 7)[:2] + (cos[..., :7], sin[..., :7])
    elif case == "position_ids_kwarg":  # not a parameter of transformers 5's function
        kwargs = {"position_ids": None}
    try:
        want = ORIGINALS["llama"](q, k, cos, sin, **kwargs)
    except Exception as err:  # noqa: BLE001
        with pytest.raises(type(err)):
            wrapper(q, k, cos, sin, **kwargs)
    else:
        for got, ref in zip(wrapper(q, k, cos, sin, **kwargs), want):
            assert torch.equal(got, ref)
    assert not fused.calls


def test_wrapper_gives_up_on_a_failing_fused_function_once(monkeypatch):
    calls = []

    def broken(*args):
        calls.append(args)
        raise RuntimeError("triton: no compiler")

    wrapper = _wrapper_on_cpu(broken)
    q, k, cos, sin = rope_inputs(1, 2, 2, 5, 8)
    with pytest.warns(RuntimeWarning, match="fused RoPE .* failed.*no compiler"):
        out = wrapper(q, k, cos, sin)
    for got, ref in zip(out, hf_rope(q, k, cos, sin)):
        assert torch.equal(got, ref)
    wrapper(q, k, cos, sin)
    assert len(calls) == 1  # not tried again
    rope.restore()  # forgets the failure
    monkeypatch.setenv("LOONGFORGE_STRICT_OPS", "1")
    with pytest.raises(RuntimeError, match="no compiler"):
        wrapper(q, k, cos, sin)


@pytest.mark.parametrize("family,config", [("mixtral", ROPE_ONLY), ("qwen3", ROPE_ONLY), ("qwen3", ALL_ON),
                                           ("llama", ALL_ON)])
def test_in_place_fused_rope_inside_models_matches_stock(family, config):
    """Liger rotates q/k (and, in backward, their gradients) in their own storage. In the families' attention
    that storage is the q/k projection's output (Qwen3: the q/k norm's output, FusedRMSNorm's when injected;
    with the fused q/k/v projection, column slices of its product),
    which no autograd node saved: a fused function with that contract (writes that bump the version counter, so
    a clobbered saved tensor would raise) leaves logits and every gradient as the stock model's."""
    stock = build(family).train()
    ids = torch.randint(0, VOCAB, (2, 13))
    ref_logits, ref_grads = run(stock, ids)
    injected = copy.deepcopy(stock)
    inject(injected, config)
    module = FAMILIES[family][2]
    calls = []

    def in_place(q, k, cos, sin):
        calls.append(rope.rows_in_place(q) and rope.rows_in_place(k))
        return InPlaceRope.apply(q, k, cos, sin)

    assert rope.patch(module.__name__, "apply_rotary_pos_emb", in_place, "in-place", device_type="cpu") is None
    audit = InPlaceRope.audit = SavedStorages()
    try:
        with audit.hooks():
            logits, grads = run(injected, ids)
    finally:
        InPlaceRope.audit = None
    assert audit.clobbered() == []  # no node saved q/k's storage before it was rotated
    assert sum(kind == "rotated" for kind, _ in audit.events) == 2 * COMMON["num_hidden_layers"]
    # in place: HF's projection layout, or (fused_kernels.qkv) column slices of the one q/k/v product
    assert calls == [True] * COMMON["num_hidden_layers"]
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        if name in ref_grads:
            want = ref_grads[name]
        else:  # FusedSwiGLUMLP's gate_up_proj = [gate_proj; up_proj]
            prefix, kind = name.rsplit(".gate_up_proj.", 1)
            want = torch.cat([ref_grads[f"{prefix}.gate_proj.{kind}"], ref_grads[f"{prefix}.up_proj.{kind}"]])
        torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_config_switch_and_validation():
    assert parse_config({"loongforge": {"enabled": True}}).fused_kernels.rope is True
    assert parse_config({"loongforge": {"fused_kernels": {"rope": False}}}).fused_kernels.rope is False
    with pytest.raises(LoongForgeConfigError, match=r"loongforge\.fused_kernels\.rope = 'yes'"):
        parse_config({"loongforge": {"fused_kernels": {"rope": "yes"}}})
    with pytest.raises(LoongForgeConfigError, match=r"loongforge\.fused_kernels\.rope = 1"):
        parse_config({"loongforge": {"fused_kernels": {"rope": 1}}})
    with pytest.raises(LoongForgeConfigError,
                       match=r"loongforge\.fused_kernels\.ropes = True: unknown key; did you mean 'rope'"):
        parse_config({"loongforge": {"fused_kernels": {"ropes": True}}})


# ---------------------------------------------------------------------------------------------------- GPU

DEVICE = "cuda"


def _liger_or_skip():
    fused, label = rope.load_liger()
    if fused is None:
        pytest.skip(f"needs liger-kernel (pip install liger-kernel==0.8.5): {label}")
    return fused, label


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["mixtral", "qwen3", "llama"])
def test_gpu_patched_function_is_liger(family, caplog):
    fused, label = _liger_or_skip()
    from liger_kernel.ops.rope import LigerRopeFunction

    module = FAMILIES[family][2]
    with caplog.at_level(logging.INFO, logger="ds_loongforge"):
        report = inject(build(family, DEVICE), ROPE_ONLY)
    name = f"{module.__name__.rpartition('.')[2]}.apply_rotary_pos_emb"
    assert _rope_patches(report) == {f"{KIND_ROPE} ({label})": [name]}
    assert [entry for entry in report.not_patched if entry[0].endswith(".apply_rotary_pos_emb")] == []
    assert f"[LoongForge] fused RoPE ({label}): {name}" in caplog.text
    # Liger's Triton kernel launched by RowStridedRope (LigerRopeFunction where its arguments differ), not Liger's
    # multi-backend dispatcher (whose Python cost more host time per call than the kernel launch); bound
    # classmethods: equal, not the same object, at each access
    from liger_kernel.ops.rope import _triton_rope

    launched_here = tuple(inspect.signature(_triton_rope.fn).parameters) == rope._KERNEL_ARGS
    assert fused == (rope.RowStridedRope.apply if launched_here else LigerRopeFunction.apply)
    assert getattr(module.apply_rotary_pos_emb, rope.FUSED_ATTR) == fused
    assert rope.original(module.apply_rotary_pos_emb) is ORIGINALS[family]


# (batch, q heads, kv heads, seq, head_dim, cos batch)
GPU_SHAPES = [
    pytest.param(2, 8, 2, 64, 128, 1, id="gqa_s64_d128"),
    pytest.param(1, 4, 4, 37, 64, 1, id="b1_odd_seq37"),
    pytest.param(3, 6, 2, 17, 96, 3, id="per_batch_cos_d96"),
    pytest.param(1, 32, 8, 1, 128, 1, id="seq1"),
]


def _forward_backward(function, q, k, cos, sin, dq, dk):
    """Outputs and q/k gradients of ``function`` on copies of q, k, dq, dk (same strides): Liger rotates q/k in
    place in forward, and in backward the incoming gradients, so each call gets its own."""
    q_leaf = q.detach().clone().requires_grad_()  # clone keeps the transposed layout
    k_leaf = k.detach().clone().requires_grad_()
    q_out, k_out = function(q_leaf, k_leaf, cos, sin)
    grads = torch.autograd.grad((q_out, k_out), (q_leaf, k_leaf),
                                (dq.to(q_out.dtype, copy=True), dk.to(k_out.dtype, copy=True)))
    return [q_out.detach(), k_out.detach(), *grads]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["projection", "contiguous"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch,heads_q,heads_k,seq,head_dim,cos_batch", GPU_SHAPES)
def test_gpu_fused_rope_matches_hf(batch, heads_q, heads_k, seq, head_dim, cos_batch, dtype, layout):
    fused, label = _liger_or_skip()
    wrapper = rope.make_wrapper(ORIGINALS["llama"], fused, label)
    q, k, cos, sin = rope_inputs(batch, heads_q, heads_k, seq, head_dim, cos_batch, dtype, DEVICE, layout)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    names = ["q", "k", "dq", "dk"]
    got = _forward_backward(wrapper, q, k, cos, sin, dq, dk)
    eager = _forward_backward(hf_rope, q, k, cos, sin, dq, dk)
    for name, a, b in zip(names, got, eager):
        assert a.shape == b.shape and a.dtype == b.dtype, name
    if dtype == torch.float32:
        for name, a, b in zip(names, got, eager):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        return
    ref = _forward_backward(hf_rope, *(t.double() for t in (q, k, cos, sin, dq, dk)))
    for name, a, e, r in zip(names, got, eager, ref):
        assert max_error(a, r) <= tolerance(max_error(e, r), r, dtype), (name, max_error(a, r), max_error(e, r))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch,heads_q,heads_k,seq,head_dim,cos_batch", GPU_SHAPES)
def test_gpu_qkv_product_slices_rotated_in_place(batch, heads_q, heads_k, seq, head_dim, cos_batch, dtype):
    """fused_kernels.qkv hands RoPE column slices of one [B, S, N] product (rows N apart): RowStridedRope rotates
    them where they are (no copy of q or k) and computes HF's values and gradients; the v columns are untouched."""
    fused, label = _liger_or_skip()
    assert fused == rope.RowStridedRope.apply, "liger-kernel's _triton_rope arguments changed: the copying path runs"
    wrapper = rope.make_wrapper(ORIGINALS["llama"], fused, label)
    _, _, cos, sin = rope_inputs(batch, heads_q, heads_k, seq, head_dim, cos_batch, dtype, DEVICE)
    q_cols, kv_cols = heads_q * head_dim, heads_k * head_dim
    leaf = torch.randn(batch, seq, q_cols + 2 * kv_cols, device=DEVICE, dtype=dtype, requires_grad=True)

    def slices(y):
        q, k, v = y.split([q_cols, kv_cols, kv_cols], dim=-1)
        return (q.view(batch, seq, heads_q, head_dim).transpose(1, 2),
                k.view(batch, seq, heads_k, head_dim).transpose(1, 2), v)

    y = leaf * 1  # the product: a non-leaf, as F.linear's output
    q, k, v = slices(y)
    v_before = v.detach().clone()
    q_out, k_out = wrapper(q, k, cos, sin)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()  # rotated in the product
    assert torch.equal(v, v_before)
    dq, dk = torch.randn_like(q_out), torch.randn_like(k_out)  # [B, S, H, D]-dense: rotated in place by backward
    (grad,) = torch.autograd.grad((q_out, k_out), leaf, (dq.clone(), dk.clone()))  # so it gets copies

    ref_leaf = leaf.detach().double().requires_grad_()
    q_ref, k_ref, _ = slices(ref_leaf * 1)
    q_want, k_want = hf_rope(q_ref, k_ref, cos.double(), sin.double())
    (grad_want,) = torch.autograd.grad((q_want, k_want), ref_leaf, (dq.double(), dk.double()))
    eager_q, eager_k = hf_rope(*slices(leaf.detach())[:2], cos, sin)
    for name, got, want, eager in (("q", q_out, q_want, eager_q), ("k", k_out, k_want, eager_k)):
        assert max_error(got, want) <= tolerance(max_error(eager, want), want, dtype), name
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(grad.double(), grad_want, rtol=tol, atol=tol)
    assert torch.equal(grad[..., q_cols + kv_cols:], torch.zeros_like(grad[..., q_cols + kv_cols:]))


@pytest.mark.gpu
def test_gpu_liger_in_place_behaviour_and_autocast_dtypes():
    """Pins what the wrapper's docstring says: Liger writes into the storage of projection-layout q/k, and its
    backward into that of the incoming gradient; with cos/sin wider than q (autocast) the wrapper's cast keeps
    HF's result dtype and leaves the caller's q alone; fp64 runs the original."""
    fused, label = _liger_or_skip()
    wrapper = rope.make_wrapper(ORIGINALS["llama"], fused, label)
    q, k, cos, sin = rope_inputs(2, 4, 2, 9, 64, device=DEVICE)
    q_in = q.detach().clone().requires_grad_()
    q_out, k_out = wrapper(q_in, k, cos, sin)
    assert q_out.data_ptr() == q_in.data_ptr()  # rotated in place
    torch.testing.assert_close(q_out, hf_rope(q, k, cos, sin)[0], rtol=1e-5, atol=1e-5)
    dq = torch.randn_like(q_out)  # [B, S, H, D] storage, like q_out
    dq_before = dq.clone()
    (q_grad,) = torch.autograd.grad((q_out, k_out), (q_in,), (dq, torch.zeros_like(k_out)))
    assert not torch.equal(dq, dq_before)  # the incoming gradient was rotated in place
    torch.testing.assert_close(q_grad, hf_rope(dq_before, dq_before, cos, -sin)[0], rtol=1e-5, atol=1e-5)

    q, k, cos, sin = rope_inputs(2, 4, 2, 9, 64, dtype=torch.bfloat16, device=DEVICE, cos_dtype=torch.float32)
    q_before = q.clone()
    q_out, k_out = wrapper(q, k, cos, sin)
    want = hf_rope(q_before, k, cos, sin)
    assert q_out.dtype == k_out.dtype == want[0].dtype == torch.float32
    assert torch.equal(q, q_before)  # an fp32 copy was rotated, not the caller's bf16 q
    torch.testing.assert_close(q_out, want[0], rtol=1e-5, atol=1e-5)

    q64, k64, cos64, sin64 = (t.double() for t in rope_inputs(1, 2, 2, 5, 8, device=DEVICE))
    for got, ref in zip(wrapper(q64, k64, cos64, sin64), hf_rope(q64, k64, cos64, sin64)):
        assert torch.equal(got, ref)


def _stock_and_injected(family, dtype, **overrides):
    stock = build(family, DEVICE, dtype, **overrides).train()
    injected = copy.deepcopy(stock)
    return stock, injected


@pytest.mark.gpu
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["mixtral", "qwen3"])
def test_gpu_model_fp32_matches_stock(family, attn):
    _liger_or_skip()
    stock, injected = _stock_and_injected(family, torch.float32, attn_implementation=attn)
    ids = torch.randint(0, VOCAB, (2, 37), device=DEVICE)
    ref_logits, ref_grads = run(stock, ids)  # before the patch: transformers' function
    report = inject(injected, ROPE_ONLY)
    assert _rope_patches(report), report.summary()
    logits, grads = run(injected, ids)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["mixtral", "qwen3"])
def test_gpu_model_bf16_within_twice_stock_error(family):
    """bf16 against the same weights in fp64 (where the wrapper runs the original): the patched model's error
    is at most 2x stock's, for the logits and every parameter gradient (relative L2: a whole model's error is
    dominated by roundings both share). Mixtral routes to all its experts here, so that bf16 rounding of the
    router logits cannot change which experts a token reaches (a top-k flip would not be the rope's doing)."""
    _liger_or_skip()
    # (experts_implementation: transformers' default grouped_mm has no fp64 kernel for the reference)
    overrides = {"num_experts_per_tok": 4, "experts_implementation": "eager"} if family == "mixtral" else {}
    stock, injected = _stock_and_injected(family, torch.bfloat16, **overrides)
    reference = copy.deepcopy(stock).double()
    ids = torch.randint(0, VOCAB, (1, 45), device=DEVICE)
    ref_logits, ref_grads = run(reference, ids)
    stock_logits, stock_grads = run(stock, ids)
    report = inject(injected, ROPE_ONLY)
    assert _rope_patches(report), report.summary()
    logits, grads = run(injected, ids)
    pairs = [("logits", logits, stock_logits, ref_logits)]
    pairs += [(name, grads[name], stock_grads[name], ref_grads[name]) for name in ref_grads]
    for name, ours, theirs, ref in pairs:
        ours_err, stock_err = relative_l2_error(ours, ref), relative_l2_error(theirs, ref)
        assert ours_err <= 2 * stock_err + 1e-6, f"{name}: {ours_err:.3e} > 2 x {stock_err:.3e}"
