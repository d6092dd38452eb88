"""ExpertAwareSampler, routing signatures and the padding collator (CPU, seconds)."""

import numpy as np
import pytest
import torch
from torch import nn

from ds_loongforge.data import (ExpertAwareSampler, PadCollator, RouterSignatures, RoutingProbe, SignatureCache,
                                SignatureSet, batch_loads, build_dataloader, collect_observed_routing,
                                dataset_token_ids, max_load_cv, router_table, routing_weights)
from ds_loongforge.data import signatures as signatures_mod
from ds_loongforge.modules.moe import ExpertMaskedMoE


def planted(num_samples=1024, experts=8, clusters=4, seed=0, tokens=128):
    """Samples in equal-size planted clusters, each cluster routing 90% of its load to its own two experts."""
    rng = np.random.default_rng(seed)
    label = np.arange(num_samples) % clusters
    center = np.full((clusters, experts), 0.1 / experts)
    for c in range(clusters):
        center[c, 2 * c % experts:2 * c % experts + 2] += 0.45
    sig = 0.9 * center[label] + 0.1 * rng.dirichlet(np.ones(experts), num_samples)
    return SignatureSet(sig.astype(np.float32), np.full(num_samples, tokens), experts), label


class TinyMoE(nn.Module):
    def __init__(self, vocab=64, hidden=16, experts=4, top_k=2, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.moes = nn.ModuleList(ExpertMaskedMoE(hidden, 8, experts, top_k, impl="reference") for _ in range(layers))

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        for moe in self.moes:
            h = h + moe(h)
        return h


class ListDataset(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": torch.tensor(self.rows[i])}


def random_rows(n, vocab=64, seed=0, lo=5, hi=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, rng.integers(lo, hi)).tolist() for _ in range(n)]


def test_deterministic_by_seed_and_epoch():
    sigs, _ = planted(256)
    a = list(ExpertAwareSampler(sigs, 8, n_clusters=4, seed=3))
    b = list(ExpertAwareSampler(sigs, 8, n_clusters=4, seed=3))
    assert a == b
    other_seed = list(ExpertAwareSampler(sigs, 8, n_clusters=4, seed=4))
    assert a != other_seed
    s = ExpertAwareSampler(sigs, 8, n_clusters=4, seed=3)
    s.set_epoch(1)
    epoch1 = list(s)
    assert epoch1 != a and sorted(sum(epoch1, [])) == sorted(sum(a, [])) == list(range(256))
    s.set_epoch(0)
    assert list(s) == a


@pytest.mark.parametrize("num_samples, world, drop_last", [
    (240, 3, False),  # divisible by batch*world: disjoint and complete
    (250, 3, False),  # padded with repeats: complete, equal batches per rank
    (250, 3, True),   # last partial global batch dropped: disjoint, equal batches per rank
    (7, 4, False),    # fewer samples than ranks*batch: padding wraps around the data more than once
])
def test_ranks_disjoint_and_complete(num_samples, world, drop_last):
    sigs, _ = planted(num_samples)
    per_rank = [list(ExpertAwareSampler(sigs, 5, n_clusters=4, num_replicas=world, rank=r, seed=1,
                                        drop_last=drop_last)) for r in range(world)]
    counts = {len(batches) for batches in per_rank}
    assert len(counts) == 1 and counts.pop() == len(ExpertAwareSampler(sigs, 5, n_clusters=4, num_replicas=world,
                                                                      drop_last=drop_last))
    assert all(len(b) == 5 for batches in per_rank for b in batches)
    drawn = [i for batches in per_rank for b in batches for i in b]
    if drop_last:
        assert len(set(drawn)) == len(drawn) == (num_samples // (5 * world)) * 5 * world
    else:
        assert set(drawn) == set(range(num_samples))
        if num_samples % (5 * world) == 0:
            assert len(drawn) == num_samples


class DriftingSource:
    """A signature source whose 'router' changes at each snapshot (deterministically), like a training model."""

    def __init__(self, num_samples=300, experts=8):
        self.num_samples, self.experts, self.snapshots = num_samples, experts, 0

    def snapshot(self):
        self.snapshots += 1
        return self.snapshots

    def compute(self, version):
        rng = np.random.default_rng(version)
        return SignatureSet(rng.dirichlet(np.ones(self.experts), self.num_samples).astype(np.float32),
                            np.full(self.num_samples, 64), self.experts)


@pytest.mark.parametrize("stop_after, consumed", [
    (7, None),   # mid-epoch, between refresh boundaries
    (10, None),  # exactly at a boundary (refresh_every=5)
    (13, 9),     # a prefetching loader pulled 13 batches, the trainer consumed 9: a boundary in between
    (7, 4),      # pulled past the first boundary (5, where nothing was pending), consumed before it
    (6, 5),      # consumed up to that first boundary exactly: it runs again, live, in the resumed run
    (30, None),  # the epoch finished (30 batches/epoch): resume starts the next epoch
])
def test_exact_resume_with_refresh(stop_after, consumed):
    def run(interrupt):
        src = DriftingSource()
        sampler = ExpertAwareSampler(src, 10, n_clusters=6, seed=2, refresh_every=5)
        out, state = [], None
        for epoch in range(3):
            sampler.set_epoch(epoch)
            for batch in sampler:
                out.append(batch)
                if interrupt and len(out) == stop_after:
                    state = sampler.state_dict(consumed=None if consumed is None else consumed)
                    break
            if state is not None:
                break
        sampler.close()
        return out, state, src.snapshots

    full, _, _ = run(False)
    partial, state, snapshots = run(True)
    keep = stop_after if consumed is None else consumed
    assert partial[:keep] == full[:keep]
    src = DriftingSource()
    # the resumed model: weights as at the checkpoint (one snapshot at construction, one per boundary before it)
    at_checkpoint = snapshots if consumed is None else 1 + (consumed - 1) // 5
    src.snapshots = at_checkpoint
    resumed = ExpertAwareSampler(src, 10, n_clusters=6, seed=2, refresh_every=5)
    resumed.load_state_dict(state)
    src.snapshots = at_checkpoint
    out = []
    for epoch in range(state["epoch"] + (0 if state["in_epoch"] else 1), 3):
        resumed.set_epoch(epoch)
        out.extend(resumed)
    resumed.close()
    assert full[:keep] + out == full


def _ranks(make, world, epoch=0, state=None, stop=None):
    """Every rank of ``world`` (``make(rank, world)`` builds its sampler) through ``epoch`` (after ``state``, if
    given): the batches of each global step, and rank 0's state after ``stop`` steps (None: to the end)."""
    samplers = [make(r, world) for r in range(world)]
    iters = []
    for s in samplers:
        if state is not None:
            s.load_state_dict(state)
        s.set_epoch(epoch)
        iters.append(iter(s))
    steps, saved = [], None
    while stop is None or len(steps) < stop:
        step = [next(it, None) for it in iters]
        if step[0] is None:
            assert all(b is None for b in step), "ranks ran out of batches at different steps"
            break
        steps.append(step)
    if stop is not None:
        saved = samplers[0].state_dict()
        assert all(s.state_dict()["offset"] == saved["offset"] for s in samplers)
    for s in samplers:
        s.close()
    return steps, saved


@pytest.mark.parametrize("worlds, stops, drop_last, refresh", [
    ((2, 4), (7,), False, 0),
    ((4, 2), (5,), True, 0),
    ((3, 2), (4,), False, 0),     # 250 samples: neither world divides them, so both pad
    ((2, 3), (9,), True, 0),
    ((2, 4, 3), (6, 2), False, 0),  # two world changes in one epoch
    ((2, 4), (7,), False, 4),     # refresh boundaries on both sides of the change
    ((2, 4), (0,), False, 0),     # saved before the epoch's first step
])
def test_resume_at_another_world_size_deals_the_rest_of_the_epoch(worlds, stops, drop_last, refresh):
    """A state saved at one number of ranks, loaded at another: the rest of the epoch goes to the new ranks,
    each of the epoch's samples drawn once (the padding's repeats, fewer than a global batch per world, and
    drop_last's cut tail apart), and the next epoch is the new world's own."""
    n, b = 250, 5

    def make(rank, world):
        src = DriftingSource(n) if refresh else planted(n)[0]
        return ExpertAwareSampler(src, b, n_clusters=4, num_replicas=world, rank=rank, seed=1, drop_last=drop_last,
                                  refresh_every=refresh)

    drawn, state, ran = [], None, 0
    for world, stop in zip(worlds, stops):
        steps, state = _ranks(make, world, state=state, stop=stop)
        ran += stop
        assert len(steps) == stop and state["offset"] == ran
        drawn += [i for step in steps for batch in step for i in batch]
    rest, _ = _ranks(make, worlds[-1], state=state)
    assert rest and all(len(batch) == b for step in rest for batch in step)
    drawn += [i for step in rest for batch in step for i in batch]
    if drop_last:  # the cut tail: less than the last world's global batch
        assert len(set(drawn)) == len(drawn) and n - len(drawn) < b * worlds[-1]
    else:  # each segment pads to its world's global batch, with fewer repeats than one
        assert set(drawn) == set(range(n)) and len(drawn) - n < sum(b * w for w in worlds)
    # reproducible: the same state gives every rank the same batches again
    assert _ranks(make, worlds[-1], state=state)[0] == rest
    if not refresh:  # the next epoch: planned for the new world from its start, as a fresh run's
        sampler = make(0, worlds[-1])
        sampler.load_state_dict(state)
        for _ in range(2):
            sampler.set_epoch(state["epoch"])
            list(sampler)
            state = sampler.state_dict()
        sampler.set_epoch(1)
        fresh = make(0, worlds[-1])
        fresh.set_epoch(1)
        assert list(sampler) == list(fresh)


def test_set_epoch_after_an_epoch_taken_by_count_saves_the_new_epochs_start():
    """A loop that takes exactly len(sampler) batches never runs the iterator into StopIteration; set_epoch(e + 1)
    then ends epoch e, so a state saved there resumes epoch e + 1 from its first batch (it used to carry e's
    position and the resumed epoch yielded nothing)."""
    sigs, _ = planted(40)
    sampler = ExpertAwareSampler(sigs, 4, n_clusters=2, seed=5)
    sampler.set_epoch(0)
    it = iter(sampler)
    for _ in range(len(sampler)):
        next(it)
    sampler.set_epoch(1)
    state = sampler.state_dict()
    assert state["epoch"] == 1 and not state["in_epoch"]
    reference = ExpertAwareSampler(sigs, 4, n_clusters=2, seed=5)
    reference.set_epoch(1)
    resumed = ExpertAwareSampler(sigs, 4, n_clusters=2, seed=5)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)
    assert list(resumed) == list(reference) and len(reference) == 10


def test_resume_at_another_world_size_then_at_the_same_is_exact():
    """A run resumed at 4 ranks from 2 and saved again mid-epoch resumes (at 4) with exactly the batches the
    uninterrupted 4-rank continuation draws; the saved state records the 2-rank segment."""
    class StepSource(DriftingSource):
        """Router weights as of the sampler's step, like a model trained that far (the same in every run)."""
        sampler = None

        def snapshot(self):
            return 0 if self.sampler is None else self.sampler._steps

    def make(rank, world):
        src = StepSource(400)
        src.sampler = ExpertAwareSampler(src, 5, n_clusters=4, num_replicas=world, rank=rank, seed=3, refresh_every=3)
        return src.sampler

    _, at2 = _ranks(make, 2, stop=6)
    whole, _ = _ranks(make, 4, state=at2)
    head, at4 = _ranks(make, 4, state=at2, stop=5)
    assert head == whole[:5] and at4["segments"] == [[2, 6]] and at4["offset"] == 11
    tail, _ = _ranks(make, 4, state=at4)
    assert head + tail == whole


def test_balance_after_a_world_size_change():
    """The 4-rank rest of an epoch begun on 2 ranks is as balanced as an epoch planned for 4 from the start."""
    sigs, _ = planted(2048, experts=8, clusters=4)

    def make(rank, world):
        return ExpertAwareSampler(sigs, 16, n_clusters=8, num_replicas=world, rank=rank, seed=0)

    _, state = _ranks(make, 2, stop=10)
    rest, _ = _ranks(make, 4, state=state)
    batches = [batch for step in rest for batch in step]
    rng = np.random.default_rng(0)
    pool = np.array(sorted(i for batch in batches for i in batch))
    random_cv = np.mean([max_load_cv(batch_loads(rng.permutation(pool).reshape(-1, 16), sigs.loads_NS))
                         for _ in range(5)])
    assert max_load_cv(batch_loads(batches, sigs.loads_NS)) <= 0.5 * random_cv


def test_balance_beats_random_on_planted_clusters():
    sigs, _ = planted(2048, experts=8, clusters=4)
    loads = sigs.loads_NS
    aware = list(ExpertAwareSampler(sigs, 16, n_clusters=8, seed=0))
    rng = np.random.default_rng(0)
    random_cvs = []
    for _ in range(5):
        perm = rng.permutation(len(sigs))
        random_cvs.append(max_load_cv(batch_loads([perm[i:i + 16] for i in range(0, len(perm), 16)], loads)))
    aware_cv, random_cv = max_load_cv(batch_loads(aware, loads)), float(np.mean(random_cvs))
    assert aware_cv <= 0.5 * random_cv, (aware_cv, random_cv)


def test_router_signature_matches_its_definition():
    model = TinyMoE()
    weights = routing_weights(model)
    assert len(weights.routers_LEH) == 2 and weights.top_k == 2
    table = router_table(weights, "router")
    x = model.embed.weight.detach()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    expected = torch.softmax(x @ model.moes[1].gate.weight.detach().t(), -1)
    torch.testing.assert_close(table[:, 4:], expected)
    topk = router_table(weights, "router_topk")
    assert torch.allclose(topk.view(-1, 2, 4).sum(-1), torch.ones(64, 2)) and set(topk.unique().tolist()) <= {0, 0.5}
    rows = random_rows(20)
    sigs = RouterSignatures(model, dataset_token_ids(ListDataset(rows)))()
    assert sigs.signatures_NS.shape == (20, 8)
    np.testing.assert_allclose(sigs.signatures_NS[3], table[rows[3]].mean(0).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(sigs.num_tokens_N, [len(r) for r in rows])


def test_cache_hit_and_invalidation_on_router_change(tmp_path, monkeypatch):
    model = TinyMoE()
    ids = dataset_token_ids(ListDataset(random_rows(50)))
    cache = SignatureCache(tmp_path)
    source = RouterSignatures(model, ids, cache=cache)
    first = source()
    assert cache.path(first.key).exists()
    calls = []
    real = signatures_mod.signatures_from_table
    monkeypatch.setattr(signatures_mod, "signatures_from_table", lambda *a: calls.append(1) or real(*a))
    again = source()
    assert again.key == first.key and not calls
    np.testing.assert_array_equal(again.signatures_NS, first.signatures_NS)
    with torch.no_grad():
        model.moes[0].gate.weight.mul_(-1.0)
    changed = source()
    assert changed.key != first.key and calls == [1]
    assert not np.allclose(changed.signatures_NS, first.signatures_NS)
    other_data = RouterSignatures(model, dataset_token_ids(ListDataset(random_rows(50, seed=1))), cache=cache)()
    assert other_data.key != changed.key


def test_clear_errors_for_bad_settings():
    sigs, _ = planted(10)
    with pytest.raises(ValueError, match=r"n_clusters=11 is more than the 10 samples"):
        ExpertAwareSampler(sigs, 2, n_clusters=11)
    with pytest.raises(ValueError, match=r"batch_size must be an integer >= 1, got 0"):
        ExpertAwareSampler(sigs, 0)
    with pytest.raises(ValueError, match=r"n_clusters must be an integer >= 1, got 0"):
        ExpertAwareSampler(sigs, 2, n_clusters=0)
    with pytest.raises(ValueError, match=r"rank < num_replicas, got rank=2, num_replicas=2"):
        ExpertAwareSampler(sigs, 2, n_clusters=2, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match=r"no full batch of 8 on each of 2 ranks"):
        ExpertAwareSampler(sigs, 8, n_clusters=2, num_replicas=2, drop_last=True)
    with pytest.raises(ValueError, match="refresh_every > 0 needs a signature source"):
        ExpertAwareSampler(sigs, 2, n_clusters=2, refresh_every=10)
    with pytest.raises(ValueError, match="the dataset is empty"):
        dataset_token_ids(ListDataset([]))
    with pytest.raises(ValueError, match="the dataset is empty"):
        ExpertAwareSampler(SignatureSet(np.zeros((0, 4), np.float32), np.zeros(0, np.int64), 4), 2, n_clusters=1)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 64\)"):
        RouterSignatures(TinyMoE(), dataset_token_ids(ListDataset([[1, 64]])))()
    with pytest.raises(ValueError, match="has no MoE router"):
        routing_weights(nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4)))
    with pytest.raises(ValueError, match=r"batch_size must be an integer >= 1, got 0"):
        build_dataloader(ListDataset(random_rows(4)), {}, TinyMoE(), batch_size=0)
    state = ExpertAwareSampler(sigs, 2, n_clusters=2).state_dict()
    state.update(in_epoch=True, offset=3, segments=[[2, 4]], versions={0: state["plan"]})
    with pytest.raises(ValueError, match=r"segments \[\(2, 4\)\] hold more steps than its offset 3"):
        ExpertAwareSampler(sigs, 2, n_clusters=2, num_replicas=4).load_state_dict(state)
    state.update(offset=9, segments=[[2, 4]], num_replicas=3)
    sampler = ExpertAwareSampler(sigs, 2, n_clusters=2)
    sampler.load_state_dict(state)
    with pytest.raises(ValueError, match=r"says 4 steps of epoch 0 ran on 2 ranks, but that segment has only 3"):
        list(sampler)
    with pytest.raises(ValueError, match=r"checkpoint has batch_size=2, this sampler 5"):
        ExpertAwareSampler(sigs, 5, n_clusters=2).load_state_dict(ExpertAwareSampler(sigs, 2, n_clusters=2).state_dict())


def test_collator_pads_to_multiple_with_masks():
    collate = PadCollator(pad_token_id=7, pad_to_multiple_of=128)
    out = collate([{"input_ids": [1, 2, 3]}, {"input_ids": torch.arange(130), "labels": torch.arange(130) + 1}])
    assert out["input_ids"].shape == out["attention_mask"].shape == out["labels"].shape == (2, 256)
    assert out["attention_mask"].sum(1).tolist() == [3, 130]
    assert out["input_ids"][0, :4].tolist() == [1, 2, 3, 7] and (out["input_ids"][0, 3:] == 7).all()
    assert (out["labels"][0, 3:] == -100).all() and out["labels"][1, :130].tolist() == list(range(1, 131))
    exact = PadCollator(pad_to_multiple_of=4)([[5, 6, 7, 8]])  # already a multiple: no extra padding
    assert exact["input_ids"].tolist() == [[5, 6, 7, 8]] and exact["attention_mask"].all()
    left = PadCollator(pad_to_multiple_of=4, padding_side="left")([torch.tensor([9, 9])])
    assert left["input_ids"].tolist() == [[0, 0, 9, 9]] and left["attention_mask"].tolist() == [[0, 0, 1, 1]]
    with pytest.raises(ValueError, match="pad_to_multiple_of must be >= 1, got 0"):
        PadCollator(pad_to_multiple_of=0)
    with pytest.raises(ValueError, match="sample has no 'input_ids'"):
        collate([{"text": "hi"}])


def test_hf_dataset_input_matches_torch_dataset(tmp_path):
    import datasets
    rows = random_rows(96, seed=5)
    hf = datasets.Dataset.from_dict({"input_ids": rows, "text": [str(len(r)) for r in rows]})
    hf_ids, torch_ids = dataset_token_ids(hf), dataset_token_ids(ListDataset(rows))
    assert hf_ids.fingerprint == f"hf:{hf._fingerprint}" and torch_ids.fingerprint.startswith("ids:")
    np.testing.assert_array_equal(hf_ids.ids_T, torch_ids.ids_T)
    np.testing.assert_array_equal(hf_ids.offsets_N1, torch_ids.offsets_N1)
    selected = hf.select(range(10, 30))  # an indices mapping over the Arrow table
    np.testing.assert_array_equal(dataset_token_ids(selected).sample(0), rows[10])
    # a Sequence feature with a length is a fixed_size_list column: no offsets in Arrow, the same ids
    fixed_rows = [r[:5] for r in rows]
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32"), length=5)})
    fixed = datasets.Dataset.from_dict({"input_ids": fixed_rows}, features=features)
    fixed_ids = dataset_token_ids(fixed)
    np.testing.assert_array_equal(fixed_ids.ids_T, np.concatenate(fixed_rows))
    np.testing.assert_array_equal(fixed_ids.offsets_N1, np.arange(len(rows) + 1) * 5)

    model = TinyMoE()
    config = {"loongforge": {"enabled": True, "sampler": {"n_clusters": 4, "refresh_every": 0,
                                                          "pad_to_multiple_of": 16, "cache_dir": str(tmp_path)}}}
    loaders = [build_dataloader(hf.with_format("torch", columns=["input_ids"]), config, model, 6, rank=r,
                                world_size=2) for r in range(2)]
    seen = []
    for loader in loaders:
        assert isinstance(loader.batch_sampler, ExpertAwareSampler) and len(loader) == 8
        for batch in loader:
            assert batch["input_ids"].shape[0] == 6 and batch["input_ids"].shape[1] % 16 == 0
            seen.extend(batch["attention_mask"].sum(1).tolist())
    assert sorted(seen) == sorted(len(r) for r in rows)
    plain = build_dataloader(ListDataset(rows), {"loongforge": {"sampler": {"expert_aware": False}}}, model, 6)
    assert isinstance(plain.sampler, torch.utils.data.DistributedSampler) and len(plain) == 16


def test_probe_learns_observed_routing(tmp_path):
    model = TinyMoE(vocab=32)
    rows = random_rows(64, vocab=32, seed=2)
    collate = PadCollator(pad_to_multiple_of=8)
    batches = [collate([{"input_ids": r} for r in rows[i:i + 16]]) for i in range(0, 64, 16)]
    token_ids, targets = collect_observed_routing(model, batches)
    assert len(token_ids) == sum(map(len, rows)) and targets.shape == (len(token_ids), 8)
    torch.testing.assert_close(targets.view(-1, 2, 4).sum(-1), torch.ones(len(token_ids), 2))
    weights = routing_weights(model)
    probe = RoutingProbe(16, 2, 4)
    probe.fit(weights.embedding_VH, token_ids, targets, steps=200)
    observed = torch.zeros(32, 8).index_add_(0, token_ids, targets)
    observed /= torch.bincount(token_ids, minlength=32).clamp_min(1)[:, None]
    error = (probe.table(weights.embedding_VH) - observed).abs().mean()
    assert error < 0.5 * (router_table(weights, "router") - observed).abs().mean()
    sigs = RouterSignatures(model, dataset_token_ids(ListDataset(rows)), kind="probe", probe=probe,
                            cache=SignatureCache(tmp_path))()
    assert sigs.signatures_NS.shape == (64, 8)


class CausalTinyMoE(TinyMoE):
    """TinyMoE with a causal running mean between the MoE layers: routing depends on the preceding tokens."""

    def forward(self, input_ids, attention_mask=None):
        h = self.embed(input_ids)
        for moe in self.moes:
            h = h + moe(h)
            h = h + h.cumsum(1) / torch.arange(1, h.shape[1] + 1)[:, None]
        return h


def test_forward_signature_is_the_routing_of_a_direct_forward(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = CausalTinyMoE()
    rows = random_rows(12, seed=3)
    ids = dataset_token_ids(ListDataset(rows))
    cache = SignatureCache(tmp_path)
    source = RouterSignatures(model, ids, kind="forward", cache=cache, forward_batch_size=5)
    sigs = source()
    assert sigs.signatures_NS.shape == (12, 8)
    np.testing.assert_array_equal(sigs.num_tokens_N, [len(r) for r in rows])
    for i in (0, 4, 11):  # each sample alone, no padding: top-k counts per (layer, expert) / (k * tokens)
        model.eval()
        with torch.no_grad():
            h = model.embed(torch.tensor([rows[i]]))
            expected = []
            for moe in model.moes:
                ids_TK = moe.gate(h.reshape(-1, h.shape[-1]))[-1]
                expected.append(torch.bincount(ids_TK.reshape(-1), minlength=4).double() / (2 * len(rows[i])))
                h = h + moe(h)
                h = h + h.cumsum(1) / torch.arange(1, h.shape[1] + 1)[:, None]
        np.testing.assert_allclose(sigs.signatures_NS[i], torch.cat(expected).numpy(), atol=1e-6)
    assert not np.allclose(sigs.signatures_NS, RouterSignatures(model, ids, kind="router_topk")().signatures_NS)
    # cache: a hit without a forward; any changed weight (here not a router) is a miss
    calls = []
    real = signatures_mod.forward_signatures
    monkeypatch.setattr(signatures_mod, "forward_signatures", lambda *a: calls.append(1) or real(*a))
    again = source()
    assert again.key == sigs.key and not calls
    np.testing.assert_array_equal(again.signatures_NS, sigs.signatures_NS)
    with torch.no_grad():
        model.moes[0].experts.down_proj.mul_(3.0)
    changed = source()
    assert changed.key != sigs.key and calls == [1]
    assert not np.allclose(changed.signatures_NS, sigs.signatures_NS)
    # through the sampler (refresh path) and the config
    sampler = ExpertAwareSampler(source, 4, n_clusters=2, refresh_every=2)
    assert len(list(sampler)) == 3
    sampler.close()
    loader = build_dataloader(ListDataset(rows), {"loongforge": {"sampler": {"signature": "forward", "n_clusters": 2,
                                                                           "cache_dir": str(tmp_path)}}}, model, 4)
    assert loader.batch_sampler.source.kind == "forward" and len(list(loader)) == 3
