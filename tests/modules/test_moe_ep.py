"""Expert parallelism over gloo with several CPU processes: each rank's outputs and gradients equal the
single-process layer's on the same tokens; expert gradients are the matching slices; the router
gradient summed over ranks equals the single-process one. Includes a rank that receives no tokens and a
rank that sends none."""


import pytest
import torch
import torch.distributed as dist

from ds_loongforge.modules.moe import ExpertMaskedMoE
from tests._dist import spawn_with_deadline

H, INTER, E, K = 16, 8, 8, 2


def _full_model(seed: int, skew: bool) -> ExpertMaskedMoE:
    torch.manual_seed(seed)
    moe = ExpertMaskedMoE(H, INTER, E, K, impl="cpu")
    if skew:  # every token prefers experts 0 and 1, which rank 0 owns: other ranks receive nothing
        with torch.no_grad():
            moe.gate.weight.zero_()
            moe.gate.weight[0] = 3.0
            moe.gate.weight[1] = 2.0
    return moe


def _inputs(world: int, tokens: list[int], seed: int):
    g = torch.Generator().manual_seed(seed + 1)
    xs = [torch.rand(n, H, generator=g) + 0.05 for n in tokens[:world]]
    dys = [torch.randn(n, H, generator=g) for n in tokens[:world]]
    return xs, dys


def _worker(rank, world, port, seed, skew, tokens, out_dir, chunks=2):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        full = _full_model(seed, skew)
        moe = ExpertMaskedMoE(H, INTER, E, K, impl="cpu", ep_group=dist.group.WORLD, overlap_chunks=chunks)
        local = E // world
        with torch.no_grad():
            moe.gate.weight.copy_(full.gate.weight)
            moe.experts.gate_up_proj.copy_(full.experts.gate_up_proj[rank * local:(rank + 1) * local])
            moe.experts.down_proj.copy_(full.experts.down_proj[rank * local:(rank + 1) * local])
        xs, dys = _inputs(world, tokens, seed)
        x = xs[rank].clone().requires_grad_()
        y = moe(x)
        grads = torch.autograd.grad(y, [x, moe.gate.weight, moe.experts.gate_up_proj, moe.experts.down_proj],
                                    dys[rank], allow_unused=False)
        torch.save({"y": y.detach(), "grads": grads}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


CASES = ("random", "skewed_to_rank0", "rank1_sends_nothing")


# chunks = overlap_chunks: one all-to-all per group of local experts (2 = default; 3 groups of 4 are uneven)
@pytest.mark.parametrize("world,chunks,case", [(w, 2, c) for w in (2, 4) for c in CASES]
                         + [(2, 1, "random"), (2, 3, "random")])
def test_expert_parallel_equals_single_process(world, chunks, case, tmp_path):
    seed = int(torch.randint(0, 2**31, ()))
    skew = case == "skewed_to_rank0"
    tokens = [23, 0 if case == "rank1_sends_nothing" else 17, 31, 9]
    spawn_with_deadline(_worker, world, seed, skew, tokens, str(tmp_path), chunks)

    full = _full_model(seed, skew)
    xs, dys = _inputs(world, tokens, seed)
    x_all = torch.cat(xs).requires_grad_()
    y_all = full(x_all)
    params = [full.gate.weight, full.experts.gate_up_proj, full.experts.down_proj]
    dx_all, dgate, dgate_up, ddown = torch.autograd.grad(y_all, [x_all] + params, torch.cat(dys))

    local = E // world
    starts = [sum(tokens[:r]) for r in range(world)]
    gate_sum = torch.zeros_like(dgate)
    for rank in range(world):
        res = torch.load(tmp_path / f"rank{rank}.pt")
        rows = slice(starts[rank], starts[rank] + tokens[rank])
        torch.testing.assert_close(res["y"], y_all[rows].detach(), rtol=1e-5, atol=1e-6)
        dx, dg, dgu, dd = res["grads"]
        torch.testing.assert_close(dx, dx_all[rows], rtol=1e-5, atol=1e-6)
        experts = slice(rank * local, (rank + 1) * local)
        torch.testing.assert_close(dgu, dgate_up[experts], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dd, ddown[experts], rtol=1e-5, atol=1e-6)
        gate_sum += dg
    torch.testing.assert_close(gate_sum, dgate, rtol=1e-5, atol=1e-6)
    if skew:
        assert torch.count_nonzero(dgate_up[2:]) == 0  # idle experts: zero gradients on every rank


def test_experts_must_divide_over_the_ep_group(tmp_path):
    spawn_with_deadline(_bad_divisor_worker, 2, str(tmp_path))
    assert (tmp_path / "message.txt").read_text().startswith(
        "ExpertMaskedMoE: num_experts=3 is not divisible by the expert-parallel size 2")


def _bad_divisor_worker(rank, world, port, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ExpertMaskedMoE(8, 8, 3, 1, ep_group=dist.group.WORLD)
    except ValueError as err:
        if rank == 0:
            with open(f"{out_dir}/message.txt", "w") as f:
                f.write(str(err))
    finally:
        # no collective ran: without this barrier one rank could tear its connections down while the other
        # was still pairing in init_process_group (CI once: "Gloo connectFullMesh failed ... closed by peer")
        dist.barrier()
        dist.destroy_process_group()


def _buffer_worker(rank, world, port, seed, out_dir):
    import warnings

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        full = _full_model(seed, skew=False)
        tokens = [40, 40]
        xs, dys = _inputs(2, tokens, seed)
        results = {}
        for name, kwargs in {"tiny": {"all_to_all_buffer_factor": 0.01, "buffer_warmup_steps": 0},
                             "steady": {"buffer_warmup_steps": 3}}.items():
            moe = ExpertMaskedMoE(H, INTER, E, K, impl="cpu", ep_group=dist.group.WORLD, **kwargs)
            with torch.no_grad():
                moe.gate.weight.copy_(full.gate.weight)
                moe.experts.gate_up_proj.copy_(full.experts.gate_up_proj[rank * 4:(rank + 1) * 4])
                moe.experts.down_proj.copy_(full.experts.down_proj[rank * 4:(rank + 1) * 4])
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                outs = []
                for _ in range(12):
                    x = xs[rank].clone().requires_grad_()
                    y = moe(x)
                    (dx,) = torch.autograd.grad(y, x, dys[rank])
                    outs.append((y.detach(), dx))
            buf = moe.receive_buffer
            results[name] = {"outs": outs, "warnings": [str(w.message) for w in caught],
                             "fill": moe.last_routing.summary()["buffer_fill"],
                             "after_warmup": buf.reallocations_after_warmup, "capacity": buf.capacity,
                             "peak": buf.peak_rows}
        torch.save(results, f"{out_dir}/buffers{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_receive_buffer_grows_exactly_and_stays_put_after_warmup(tmp_path):
    seed = int(torch.randint(0, 2**31, ()))
    spawn_with_deadline(_buffer_worker, 2, seed, str(tmp_path))
    full = _full_model(seed, skew=False)
    xs, dys = _inputs(2, [40, 40], seed)
    grew_any, fills = False, []
    for rank in range(2):
        res = torch.load(tmp_path / f"buffers{rank}.pt")
        x = xs[rank].clone().requires_grad_()
        y = full(x)
        (dx,) = torch.autograd.grad(y, x, dys[rank])
        for name in ("tiny", "steady"):
            for y_ep, dx_ep in res[name]["outs"]:   # exact on every step, before and after any growth
                torch.testing.assert_close(y_ep, y.detach(), rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(dx_ep, dx, rtol=1e-5, atol=1e-6)
        tiny = res["tiny"]
        # the tiny buffer starts at max(1, ceil(0.01 * 80 pairs / 2 ranks)) = 1 row; a rank that received more
        # grew (one warning), one that received at most a row (routing can send every token to the other
        # rank's experts) did not
        grew = tiny["peak"] > 1
        grew_any = grew_any or grew
        assert len(tiny["warnings"]) == int(grew), tiny["warnings"]
        assert not grew or "receive buffer grew from" in tiny["warnings"][0]
        assert tiny["capacity"] >= tiny["peak"]
        steady = res["steady"]
        assert steady["warnings"] == [] and steady["after_warmup"] == 0
        assert steady["capacity"] >= steady["peak"]
        assert 0 <= tiny["fill"] <= 1 and 0 <= steady["fill"] <= 1   # received rows / buffer rows
        fills.append(steady["fill"])
    assert grew_any and max(fills) > 0   # 160 pairs in all: some rank received more than one row


def test_receive_buffer_rejects_bad_settings():
    from ds_loongforge.modules.moe import ReceiveBuffer

    with pytest.raises(ValueError, match="all_to_all_buffer_factor must be > 0, got 0"):
        ReceiveBuffer(factor=0)
    with pytest.raises(ValueError, match="buffer_growth must be > 0, got -0.1"):
        ReceiveBuffer(growth=-0.1)
    with pytest.raises(ValueError, match="buffer_warmup_steps must be >= 0, got -1"):
        ReceiveBuffer(warmup_steps=-1)


def test_chunk_bounds_cover_every_local_expert_once():
    from ds_loongforge.modules.moe import chunk_bounds

    assert chunk_bounds(4, 3) == [(0, 1), (1, 3), (3, 4)]
    assert chunk_bounds(2, 8) == [(0, 1), (1, 2)]   # never more chunks than local experts
    assert chunk_bounds(5, 1) == [(0, 5)]
    for local in range(1, 17):
        for chunks in range(1, 6):
            b = chunk_bounds(local, chunks)
            assert b[0][0] == 0 and b[-1][1] == local and all(lo < hi for lo, hi in b)
            assert all(b[i][1] == b[i + 1][0] for i in range(len(b) - 1))


def _out_of_step_worker(rank, world, port, out_dir):
    """Both ranks train one step; then rank 0 runs a no-grad forward (an eval or a generation on one rank) while
    rank 1 runs its next training forward: each call's exchange pairs with the other rank's, which must not pass
    silently."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        moe = ExpertMaskedMoE(H, INTER, E, K, impl="cpu", ep_group=dist.group.WORLD)
        moe(torch.randn(5, H)).sum().backward()
        try:
            if rank == 0:
                with torch.no_grad():
                    moe(torch.randn(3, H))
            else:
                moe(torch.randn(4, H)).sum().backward()
            message = None
        except RuntimeError as err:
            message = str(err)
        with open(f"{out_dir}/message{rank}.txt", "w") as f:
            f.write(message or "no error")
    finally:
        dist.destroy_process_group()


def test_ranks_out_of_step_are_an_error_not_a_silent_pairing(tmp_path):
    spawn_with_deadline(_out_of_step_worker, 2, str(tmp_path))
    zero, one = ((tmp_path / f"message{r}.txt").read_text() for r in range(2))
    assert zero.startswith("ExpertMaskedMoE: the ranks of the expert-parallel group are out of step: rank 0 is at "
                           "this layer's call 2 (no grad), rank 1 at its call 2 (grad enabled)"), zero
    assert one.startswith("ExpertMaskedMoE: the ranks of the expert-parallel group are out of step: rank 1 is at "
                          "this layer's call 2 (grad enabled), rank 0 at its call 2 (no grad)"), one
    assert "synced_gpus=True" in zero


def test_receive_buffer_calibrates_to_the_warmup_peak_and_says_what_to_raise():
    """At the end of warm-up the buffer is the peak plus growth, whatever factor sized warm-up with; a later larger
    step grows it once with a warning that names the knobs that act after calibration (buffer_growth, warm-up),
    not the factor. The first allocation is never a reallocation after warm-up (buffer_warmup_steps=0 too)."""
    import warnings

    from ds_loongforge.modules.moe import ReceiveBuffer

    like = torch.empty(1, 4)
    for factor in (1.2, 100.0):
        buf = ReceiveBuffer(factor=factor, warmup_steps=3, growth=0.25)
        for rows in (30, 40, 35):
            buf.take(rows, pairs=64, ep_size=2, like=like)
        buf.take(20, pairs=64, ep_size=2, like=like)  # the first step after warm-up calibrates
        assert buf.capacity == 50 and buf.reallocations_after_warmup == 0, (factor, buf.capacity)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            buf.take(70, pairs=64, ep_size=2, like=like)
        assert buf.capacity == 70 and buf.reallocations_after_warmup == 1
        assert "raise moe.buffer_growth" in str(caught[0].message) and "buffer_factor" not in str(caught[0].message)
    buf = ReceiveBuffer(warmup_steps=0)
    buf.take(10, pairs=64, ep_size=2, like=like)
    assert buf.reallocations == 1 and buf.reallocations_after_warmup == 0
