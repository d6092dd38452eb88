"""ExpertAwareSampler: a distributed batch sampler that keeps each batch's expert load near uniform.

Legend (shape suffixes): N samples, S signature entries (MoE layers x experts), C buckets (clusters).

Every sample has a routing signature (signatures.py): the load it is expected to put on each expert. The
signatures are clustered into C buckets (scikit-learn MiniBatchKMeans, seeded). An epoch is one global
sequence of micro-batches, micro-batch m going to rank m % world_size (so ranks get disjoint samples, and
all ranks compute the same sequence without communicating). It is built in two stages, both deterministic
given the seed and the epoch:

1. stratify: the seeded-shuffled samples are ordered so that the buckets interleave in proportion to their
   sizes; every stretch of the order then holds each kind of sample at its share of the dataset, and the
   last batches of an epoch are drawn from the same mix as the first;
2. partition: each chunk of that order (``CHUNK_BATCHES`` micro-batches' worth, whole steps) is split into
   micro-batches whose summed expected load is closest to the dataset's load profile scaled to their
   tokens, i.e. as uniform as the data allows (rounds of one sample per batch; see ``_partition``).

On text with a content-dependent router (benchmarks/bench_sampler.py) the coefficient of variation of the
per-batch peak expert load falls by ~75% when signatures are the exact loads, and by what the signature
predicts of them otherwise (router < probe < forward; "forward" measures each sample's routing in a forward
pass over the dataset, so it is exact for the snapshot's weights and drifts only between refreshes).

``drop_last=False`` pads the epoch (like DistributedSampler) by repeating samples, so every rank gets the
same number of full batches; ``drop_last=True`` leaves out the samples the last full batches do not take.

Refresh (``refresh_every`` > 0, with a signature ``source``): routing drifts while the model trains. At
every ``refresh_every``-th batch this rank yields, the sampler (1) applies the signatures computed since
the previous boundary, re-bucketing the samples not yet drawn in this epoch, and (2) takes a CPU copy of
the router weights (all weights for the "forward" signature; ``source.snapshot()``, in the iterating thread) and starts recomputing signatures and
clusters from that copy in a background thread. The device is never waited on beyond that copy, and the
result is applied at a fixed batch index, so the batch sequence does not depend on thread timing: all
ranks (and a resumed run) draw the same batches. If the computation is not done by the next boundary the
sampler waits for it there. A "forward" refresh is one forward pass over the whole dataset: on a GPU it
competes with training, so give it a refresh_every several times larger than the table-based kinds need.

``state_dict()`` holds the epoch, the batches yielded, the bucket plans applied in this epoch (with the
batch each was applied at) and the pending refresh result, so ``load_state_dict`` + iterating continues
with exactly the batches the interrupted run would have drawn. It counts batches yielded by the sampler:
with a prefetching DataLoader, save ``state_dict(consumed=<batches the trainer consumed this epoch>)``.
Loaded by a sampler of another number of ranks, the state goes on with the epoch's samples not drawn yet, dealt
over the new ranks (``load_state_dict``); later epochs are the new world's own.
"""

from __future__ import annotations

import logging
import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from ds_loongforge.data.signatures import RoutingWeights, SignatureSet

logger = logging.getLogger("ds_loongforge")

# Micro-batches (all ranks together, whole steps, at least one step) balanced together: more gives the
# partition more samples to pair off (64 vs 16: CV of the peak load down 50% instead of 27% vs random on
# pydoc text); the cost is O(samples * CHUNK_BATCHES * S) per epoch.
CHUNK_BATCHES = 64


class SignatureSource(Protocol):
    def snapshot(self) -> RoutingWeights: ...

    def compute(self, weights: RoutingWeights) -> SignatureSet: ...


@dataclass
class BucketPlan:
    """Bucket of every sample and each sample's expected load (one signature version)."""

    assignment_N: np.ndarray  # int64
    loads_NS: np.ndarray  # float32: each sample's expected tokens per (layer, expert)
    num_experts: int

    def profile(self) -> tuple[np.ndarray, np.ndarray]:
        """(tokens_N, profile_S): each sample's token count and the dataset's expected load per token."""
        tokens_N = self.loads_NS[:, :self.num_experts].sum(1).astype(np.float64)
        return tokens_N, self.loads_NS.sum(0, dtype=np.float64) / max(tokens_N.sum(), 1.0)

    def to_state(self) -> dict:
        return {"assignment": torch.from_numpy(self.assignment_N.astype(np.int32)),
                "loads": torch.from_numpy(self.loads_NS), "num_experts": self.num_experts}

    @classmethod
    def from_state(cls, state: dict) -> "BucketPlan":
        return cls(state["assignment"].numpy().astype(np.int64), state["loads"].numpy(), int(state["num_experts"]))


def cluster_signatures(sigs: SignatureSet, n_clusters: int, seed: int) -> BucketPlan:
    """MiniBatchKMeans (seeded) over the per-sample signatures -> BucketPlan."""
    from sklearn.cluster import MiniBatchKMeans

    n = len(sigs)
    if n_clusters > n:
        raise ValueError(f"n_clusters={n_clusters} is more than the {n} samples of the dataset; use at most {n}")
    if n_clusters == 1:
        assignment = np.zeros(n, dtype=np.int64)
    else:
        km = MiniBatchKMeans(n_clusters=n_clusters, random_state=seed, n_init=3, batch_size=min(n, 4096))
        assignment = km.fit_predict(sigs.signatures_NS.astype(np.float64)).astype(np.int64)
    return BucketPlan(assignment, sigs.loads_NS.astype(np.float32), sigs.num_experts)


class ExpertAwareSampler(Sampler[list[int]]):
    """Batch sampler (use as ``DataLoader(batch_sampler=...)``) yielding this rank's micro-batches of
    ``batch_size`` dataset indices, balanced in expected expert load (see the module docstring).

    ``signatures``: a SignatureSet, or a source (RouterSignatures) whose snapshot+compute gives one and
    which is also used for refreshes. ``num_replicas``/``rank`` default to torch.distributed's world
    size and rank (1 and 0 without a process group). ``seed`` must be the same on every rank.
    """

    def __init__(self, signatures: SignatureSet | SignatureSource, batch_size: int, *, n_clusters: int = 16,
                 num_replicas: int | None = None, rank: int | None = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, refresh_every: int = 0):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"ExpertAwareSampler: batch_size must be an integer >= 1, got {batch_size!r}")
        if not isinstance(n_clusters, int) or n_clusters < 1:
            raise ValueError(f"ExpertAwareSampler: n_clusters must be an integer >= 1, got {n_clusters!r}")
        if refresh_every < 0:
            raise ValueError(f"ExpertAwareSampler: refresh_every must be >= 0 (0 = never), got {refresh_every}")
        if num_replicas is None:
            num_replicas = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"ExpertAwareSampler: need num_replicas >= 1 and 0 <= rank < num_replicas, got "
                             f"rank={rank}, num_replicas={num_replicas}")
        self.source: SignatureSource | None = None
        if not isinstance(signatures, SignatureSet):
            self.source = signatures
            signatures = signatures.compute(signatures.snapshot())
        if refresh_every and self.source is None:
            raise ValueError("ExpertAwareSampler: refresh_every > 0 needs a signature source (RouterSignatures) "
                             "to recompute from, not a fixed SignatureSet")
        self.num_samples = len(signatures)
        if self.num_samples == 0:
            raise ValueError("ExpertAwareSampler: the dataset is empty")
        if n_clusters > self.num_samples:
            raise ValueError(f"ExpertAwareSampler: n_clusters={n_clusters} is more than the {self.num_samples} "
                             f"samples; use n_clusters <= {self.num_samples}")
        self.batch_size, self.n_clusters = batch_size, n_clusters
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.refresh_every = refresh_every
        self.num_global_batches = self._segment_steps(self.num_samples, num_replicas)
        if self.num_global_batches == 0:
            raise ValueError(f"ExpertAwareSampler: {self.num_samples} samples give no full batch of {batch_size} "
                             f"on each of {num_replicas} ranks with drop_last=True")
        self.epoch = 0
        self.plan = cluster_signatures(signatures, n_clusters, seed)
        self._steps = 0                    # batches this rank has yielded, all epochs
        self._pending: Future | BucketPlan | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._epoch_versions: dict[int, BucketPlan] = {}  # step -> plan applied there, this epoch
        self._epoch_start: int | None = None  # step at which the epoch in progress began
        self._resume: tuple[int, int] | None = None  # (epoch, batches of it already yielded)
        self._segments: list[tuple[int, int]] = []  # (ranks, steps) that ran this epoch at other world sizes

    def __len__(self) -> int:
        return self.num_global_batches

    def set_epoch(self, epoch: int) -> None:
        """Like DistributedSampler.set_epoch; keeps a loaded resume point only for its own epoch. Another epoch
        ends the one in progress: a loop that takes exactly ``len(sampler)`` batches (or breaks early) never runs
        the iterator to its end, and a state saved after this call must not carry the old epoch's position."""
        if self._resume is not None and self._resume[0] != epoch:
            self._resume = None
        if epoch != self.epoch and self._resume is None:
            self._epoch_start, self._epoch_versions, self._segments = None, {}, []
        self.epoch = epoch

    # ---- refresh -------------------------------------------------------------------------------------

    def _recompute(self, weights: RoutingWeights) -> BucketPlan:
        return cluster_signatures(self.source.compute(weights), self.n_clusters, self.seed)

    def _boundary(self, step: int) -> BucketPlan | None:
        """At a refresh boundary: take the pending result (the plan to apply now) and start the next one."""
        applied = None
        if self._pending is not None:
            applied = self._pending.result() if isinstance(self._pending, Future) else self._pending
            self._pending = None
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lf-signatures")
        self._pending = self._executor.submit(self._recompute, self.source.snapshot())
        logger.info("[LoongForge] expert-aware sampler: step %d, %s; refreshing signatures in the background",
                    step, "applied refreshed buckets" if applied is not None else "no refresh pending")
        return applied

    # ---- the epoch's batch sequence ------------------------------------------------------------------

    def __iter__(self) -> Iterator[list[int]]:
        if self._resume is not None and self._resume[0] == self.epoch:
            start, skip = self._epoch_start, self._resume[1]
        else:
            start, skip = self._steps, 0
            if self._is_boundary(start):
                applied = self._boundary(start)
                if applied is not None:
                    self.plan = applied
            self._epoch_start = start
            self._epoch_versions = {start: self.plan}
            self._segments = []
        self._resume = None
        for step, batch in self._micro_batches(start, start + skip):
            if step < start + skip:
                continue
            self._steps = step + 1
            yield batch
        self._epoch_start = None
        self._epoch_versions = {}
        self._segments = []

    def _is_boundary(self, step: int) -> bool:
        return bool(self.refresh_every) and step > 0 and step % self.refresh_every == 0

    def _segment_steps(self, free: int, world: int) -> int:
        """Global steps (one micro-batch a rank) that ``free`` samples give ``world`` ranks."""
        per_step = self.batch_size * world
        return free // per_step if self.drop_last else math.ceil(free / per_step)

    def _micro_batches(self, start: int, live_from: int) -> Iterator[tuple[int, list[int]]]:
        """(global step, micro-batch) of this rank for the epoch beginning at step ``start``; plans recorded
        for steps before ``live_from`` are replayed, later boundaries run the refresh.

        An epoch is one or more segments, each at its number of ranks: a run resumed at another world size
        (``load_state_dict``) replays the earlier segments' steps to find the samples they used, and deals the
        rest of the epoch over its own ranks. A segment's own length is what the samples not yet drawn give its
        ranks (padded with repeats of them, or cut, as ``drop_last`` says)."""
        b = self.batch_size
        rng = np.random.default_rng([self.seed, self.epoch])
        pool = rng.permutation(self.num_samples) if self.shuffle else np.arange(self.num_samples)
        taken = np.zeros(len(pool), dtype=bool)
        plan = self.plan = self._epoch_versions[start]
        step = start
        for world, used in [*self._segments, (self.num_replicas, None)]:
            taken[self.num_samples:] = True  # an earlier segment's padding: repeats, dealt anew for this one
            free = np.flatnonzero(~taken)
            seg_steps = self._segment_steps(len(free), world)
            pad = seg_steps * b * world - len(free)
            if pad > 0:
                pool = np.concatenate([pool, np.resize(pool[free], pad)])
                taken = np.concatenate([taken, np.zeros(pad, dtype=bool)])
            if used is not None and used > seg_steps:
                raise ValueError(f"ExpertAwareSampler: the saved state says {used} steps of epoch {self.epoch} ran "
                                 f"on {world} ranks, but that segment has only {seg_steps}: a state of another "
                                 "dataset or batch size?")
            end = step + seg_steps  # the segment's full length: it sets the chunks, as in the run that made it
            stop = end if used is None else step + used
            order = None
            while step < stop:
                new_plan = None
                if step != start:
                    if step < live_from:
                        new_plan = self._epoch_versions.get(step)
                    elif self._is_boundary(step):
                        new_plan = self._boundary(step)
                        if new_plan is not None:
                            self._epoch_versions[step] = new_plan
                if new_plan is not None:
                    plan = self.plan = new_plan
                if new_plan is not None or order is None:
                    order = self._stratified_order(plan, pool, taken)
                steps = min(max(1, CHUNK_BATCHES // world), end - step)
                if self.refresh_every:
                    steps = min(steps, self.refresh_every - step % self.refresh_every)
                chunk, order = order[:steps * world * b], order[steps * world * b:]
                batches = self._partition(plan, pool[chunk], steps * world,
                                          np.random.default_rng([self.seed, self.epoch, step - start]))
                if used is None:
                    taken[chunk] = True
                    for m in range(self.rank, len(batches), world):
                        yield step + m // world, pool[chunk[batches[m]]].tolist()
                else:  # an earlier segment, replayed: only the steps it ran used their samples
                    ran = min(steps, stop - step) * world
                    taken[chunk[np.concatenate(batches[:ran])]] = True
                step = min(step + steps, stop)

    def _stratified_order(self, plan: BucketPlan, pool: np.ndarray, taken: np.ndarray) -> np.ndarray:
        """Pool positions not yet taken, buckets interleaved in proportion to their sizes: the i-th of a
        bucket's n members (pool order) sits at (i + 0.5) / n, so every stretch of the order holds each
        bucket at its share."""
        if len(plan.assignment_N) != self.num_samples:
            raise ValueError(f"bucket plan covers {len(plan.assignment_N)} samples, the sampler "
                             f"{self.num_samples}: signatures of a different dataset?")
        remaining = np.flatnonzero(~taken)
        bucket = plan.assignment_N[pool[remaining]]
        sizes_C = np.bincount(bucket, minlength=self.n_clusters)
        by_bucket = np.argsort(bucket, kind="stable")
        rank_in_bucket = np.empty(len(remaining), dtype=np.int64)
        rank_in_bucket[by_bucket] = np.arange(len(remaining)) - np.repeat(np.cumsum(sizes_C) - sizes_C, sizes_C)
        key = (rank_in_bucket + 0.5) / sizes_C[bucket]
        return remaining[np.lexsort((bucket, key))]

    @staticmethod
    def _partition(plan: BucketPlan, samples: np.ndarray, num_batches: int,
                   rng: np.random.Generator) -> list[np.ndarray]:
        """Split ``samples`` into ``num_batches`` equal batches (of positions in ``samples``) whose loads are
        closest to the dataset's load profile scaled to their tokens. In rounds of one sample per batch,
        samples by decreasing deviation from the profile: each round is an optimal assignment (scipy's
        linear_sum_assignment) of its samples to the batches minimising the summed squared deviation of the
        batches after the round, so a sample goes where it cancels a batch's summed deviation best. The
        deviations are ranked after a seeded random scaling (x0.5..1.5), so that epochs (and seeds) differ even
        where one chunk holds the whole epoch. One C call per round (not one Python step per batch): ~10x
        cheaper than a greedy loop."""
        from scipy.optimize import linear_sum_assignment

        tokens_N, profile_S = plan.profile()
        dev_XS = plan.loads_NS[samples].astype(np.float64) - tokens_N[samples, None] * profile_S
        order = np.argsort(-(dev_XS ** 2).sum(1) * rng.uniform(0.5, 1.5, len(samples)), kind="stable")
        batch_dev_GS = np.zeros((num_batches, dev_XS.shape[1]))
        members_GR = np.empty((num_batches, len(samples) // num_batches), dtype=np.int64)
        for r in range(members_GR.shape[1]):
            round_X = order[r * num_batches:(r + 1) * num_batches]
            dev_RS = dev_XS[round_X]
            # ||b_g + d_x||^2 = ||b_g||^2 + 2 b_g.d_x + ||d_x||^2; the last term is the same for every
            # assignment, the first for every choice of g's sample: only the cross term decides
            _, pick_G = linear_sum_assignment(batch_dev_GS @ dev_RS.T)
            batch_dev_GS += dev_RS[pick_G]
            members_GR[:, r] = round_X[pick_G]
        return list(members_GR)

    # ---- checkpointing -------------------------------------------------------------------------------

    def state_dict(self, consumed: int | None = None) -> dict:
        """Resume point: by default after the batches yielded in the epoch in progress (or at the start of
        the next epoch); ``consumed`` = the batches of this epoch the trainer actually used, when a
        prefetching loader has pulled more. Waits for a refresh in flight, to include its result."""
        in_epoch = self._epoch_start is not None
        yielded = self._steps - self._epoch_start if in_epoch else 0
        if consumed is not None and not 0 <= consumed <= yielded:
            raise ValueError(f"state_dict: consumed={consumed} must be in [0, {yielded}] (batches yielded)")
        offset = yielded if consumed is None else consumed
        pending = self._pending.result() if isinstance(self._pending, Future) else self._pending
        self._pending = pending
        versions = dict(self._epoch_versions)
        if in_epoch and self.refresh_every:
            # boundaries at or after the resume point run again live. If the iterator has passed the first of
            # them, what was pending at the resume point is what that boundary applied: a plan, or nothing (a
            # boundary with nothing pending, such as the run's first, records no version); the refreshes
            # launched there and later are recomputed by the resumed run
            cut = self._epoch_start + offset
            first = cut + (-cut) % self.refresh_every
            if first == self._epoch_start:  # the epoch's own start boundary ran before any batch of it
                first += self.refresh_every
            if first < self._steps:
                pending = versions.get(first)
                versions = {s: p for s, p in versions.items() if s < cut or s == self._epoch_start}
        return {
            "version": 1, "seed": self.seed, "epoch": self.epoch, "num_samples": self.num_samples,
            "num_replicas": self.num_replicas, "batch_size": self.batch_size, "n_clusters": self.n_clusters,
            "in_epoch": in_epoch, "epoch_start": self._epoch_start if in_epoch else self._steps,
            "offset": offset, "segments": [list(seg) for seg in self._segments] if in_epoch else [],
            "versions": {int(s): p.to_state() for s, p in versions.items()},
            "plan": self.plan.to_state(), "pending": None if pending is None else pending.to_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue where ``state`` was saved. At another number of ranks (``num_replicas``) the epoch in
        progress goes on over this sampler's ranks with the samples its earlier steps did not use: the saved
        steps are replayed (no batch yielded) to find them, and the rest of the epoch is dealt as one more
        segment; every later epoch is planned for this number of ranks from its start."""
        for key in ("seed", "num_samples", "batch_size", "n_clusters"):
            if state[key] != getattr(self, key):
                raise ValueError(f"load_state_dict: the checkpoint has {key}={state[key]}, this sampler "
                                 f"{getattr(self, key)}; a resumed run must use the same settings")
        self.epoch = state["epoch"]
        self.plan = BucketPlan.from_state(state["plan"])
        self._pending = None if state["pending"] is None else BucketPlan.from_state(state["pending"])
        if state["in_epoch"]:
            self._epoch_versions = {int(s): BucketPlan.from_state(p) for s, p in state["versions"].items()}
            self._epoch_start = state["epoch_start"]
            self._steps = self._epoch_start + state["offset"]
            self._resume = (self.epoch, state["offset"])
            self._segments = [(int(w), int(n)) for w, n in state.get("segments", [])]
            ran = state["offset"] - sum(n for _, n in self._segments)  # steps at the saving run's world size
            if ran < 0:
                raise ValueError(f"load_state_dict: the state's segments {self._segments} hold more steps than "
                                 f"its offset {state['offset']}")
            if state["num_replicas"] != self.num_replicas:
                if ran:
                    self._segments.append((int(state["num_replicas"]), ran))
                logger.info("[LoongForge] expert-aware sampler: epoch %d resumed at step %d on %d ranks (saved on "
                            "%d): the rest of its samples are dealt over %d ranks", self.epoch, state["offset"],
                            self.num_replicas, state["num_replicas"], self.num_replicas)
        else:
            self._epoch_versions, self._epoch_start, self._resume, self._segments = {}, None, None, []
            self._steps = state["epoch_start"]

    def close(self) -> None:
        """Stop the background refresh thread (a refresh in flight finishes first)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def batch_loads(batches: list[list[int]], loads_NS: np.ndarray) -> np.ndarray:
    """Summed per-sample loads of each batch: [num_batches, S]."""
    return np.stack([loads_NS[b].sum(0) for b in batches])


def max_load_cv(loads_BS: np.ndarray) -> float:
    """Coefficient of variation (std / mean) of the per-batch max load."""
    peak_B = loads_BS.max(1)
    return float(peak_B.std() / peak_B.mean())


__all__ = ["ExpertAwareSampler", "BucketPlan", "cluster_signatures", "batch_loads", "max_load_cv"]
