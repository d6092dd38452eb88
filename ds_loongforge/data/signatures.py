"""Routing signatures: for each sample, the expert load its tokens are expected to put on the MoE layers.

Legend (shape suffixes): V vocabulary, H hidden, E experts per MoE layer, L MoE layers, S = L*E signature
entries (layer-major), N samples, T tokens.

For the first three kinds a signature is computed per vocabulary token first (a table_VS), then averaged
over each sample's tokens, so the pre-scan is one batched gather over the token ids (no model forward):

- ``"router"`` (default): softmax(rms_norm(embedding[v]) @ router_l.T) for every MoE layer l. The RMS
  normalization stands for the pre-norm the layer applies (its learned scale is ignored); the residual
  stream is approximated by the token embedding, which is exact in spirit for the first layer and a
  coarse guess deeper in the network.
- ``"router_topk"``: the same logits, but the token's top-k experts each get 1/k (expected top-k counts).
- ``"probe"``: a small MLP, fitted on routing observed in real forwards (:func:`collect_observed_routing`),
  maps the embedding of each vocabulary token to its per-layer routing distribution; it learns what the
  deeper layers actually do with each token.
- ``"forward"``: no table; a batched no-grad forward of the model itself over the whole dataset (on a private
  copy of the model loaded with a snapshot of all its parameters and buffers, see :func:`forward_signatures`),
  recording each MoE layer's actual top-k routing (1/k per chosen expert, the recording code of
  :func:`collect_observed_routing`) and averaging it over each sample's tokens: the sample's actual load in
  context, for the snapshot's weights. Cost: one forward pass over the dataset per (re)computation, plus a
  CPU copy and SHA-256 of all parameters per snapshot; run in the sampler's background refresh on a GPU it
  competes with training for the device, so use a refresh_every several times larger than for the other
  kinds (e.g. so that a refresh costs < 1% of the steps between refreshes).

A sample's signature is the mean of its tokens' rows (of their observed routing, for ``"forward"``); each
layer block sums to 1; the sampler multiplies it by the sample's token count to get the sample's expected
load.

Results are cached on disk under a key made of the dataset fingerprint (HF ``datasets`` ``_fingerprint``,
or a SHA-256 of the token ids for other datasets), a SHA-256 of the embedding and router weights (and of
the probe; of all parameters and buffers for ``"forward"``), and the signature settings: a changed router
(any changed weight, for ``"forward"``) is a cache miss.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch
from torch import nn

from ds_loongforge.integrations.zero3 import gathered, partitioned, whole_shape

logger = logging.getLogger("ds_loongforge")

SIGNATURE_KINDS = ("router", "router_topk", "probe", "forward")
DEFAULT_CACHE_DIR = Path(os.environ.get("LOONGFORGE_CACHE", Path.home() / ".cache" / "ds_loongforge")) / "signatures"
# tokens gathered per chunk of the pre-scan: bounds its memory to ~CHUNK_TOKENS * S * 4 bytes
CHUNK_TOKENS = 1 << 22


@dataclass
class TokenIds:
    """All token ids of a dataset, flat: sample i is ``ids_T[offsets_N1[i]:offsets_N1[i + 1]]``."""

    ids_T: np.ndarray
    offsets_N1: np.ndarray
    fingerprint: str

    def __len__(self) -> int:
        return len(self.offsets_N1) - 1

    @property
    def lengths_N(self) -> np.ndarray:
        return np.diff(self.offsets_N1)

    def sample(self, i: int) -> np.ndarray:
        return self.ids_T[self.offsets_N1[i]:self.offsets_N1[i + 1]]


@dataclass
class SignatureSet:
    """Per-sample signatures_NS (float32, each layer block sums to 1 for a non-empty sample), the token
    count of each sample, the number of experts per layer, and the cache key they were stored under."""

    signatures_NS: np.ndarray
    num_tokens_N: np.ndarray
    num_experts: int
    key: str = ""

    def __post_init__(self):
        if self.signatures_NS.ndim != 2 or len(self.signatures_NS) != len(self.num_tokens_N):
            raise ValueError(f"signatures must be [N, S] with one token count per sample, got "
                             f"{self.signatures_NS.shape} and {self.num_tokens_N.shape}")

    def __len__(self) -> int:
        return len(self.num_tokens_N)

    @property
    def loads_NS(self) -> np.ndarray:
        """Expected tokens each sample sends to each (layer, expert)."""
        return self.signatures_NS * self.num_tokens_N[:, None]


def _sample_ids(item: Any, column: str) -> np.ndarray:
    if isinstance(item, dict):
        if column not in item:
            raise ValueError(f"dataset samples are dicts without the token column {column!r} "
                             f"(keys: {sorted(item)}); pass column=")
        item = item[column]
    if isinstance(item, torch.Tensor):
        return item.detach().reshape(-1).cpu().numpy().astype(np.int64, copy=False)
    return np.asarray(item, dtype=np.int64).reshape(-1)


def dataset_token_ids(dataset, column: str = "input_ids") -> TokenIds:
    """Read every sample's token ids. HF ``datasets.Dataset``: straight from the Arrow column, keyed by the
    dataset's ``_fingerprint``. Other map-style datasets (``__len__`` + ``__getitem__`` returning ids, a
    tensor, or a dict holding ``column``): one pass, keyed by a SHA-256 of the ids."""
    n = len(dataset)
    if n == 0:
        raise ValueError("the dataset is empty: the expert-aware sampler needs at least one sample")
    fingerprint = getattr(dataset, "_fingerprint", None)
    if fingerprint is not None and hasattr(dataset, "data") and getattr(dataset, "_indices", None) is None:
        if column not in dataset.column_names:
            raise ValueError(f"the dataset has no token column {column!r} (columns: {dataset.column_names})")
        arrow = dataset.data.column(column).combine_chunks()
        if hasattr(arrow, "offsets"):  # list / large_list: variable-length samples
            offsets = np.asarray(arrow.offsets, dtype=np.int64)
            ids = np.asarray(arrow.values, dtype=np.int64)[offsets[0]:offsets[-1]]
            return TokenIds(ids, offsets - offsets[0], f"hf:{fingerprint}")
        size = getattr(arrow.type, "list_size", None)
        if size is not None:  # fixed_size_list (a Sequence feature with a length): no offsets
            ids = np.asarray(arrow.flatten(), dtype=np.int64)
            return TokenIds(ids, np.arange(n + 1, dtype=np.int64) * size, f"hf:{fingerprint}")
        raise ValueError(f"the dataset's token column {column!r} has Arrow type {arrow.type}, not a list of ids")
    pieces = [_sample_ids(dataset[i], column) for i in range(n)]
    lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=n)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ids = np.concatenate(pieces) if offsets[-1] else np.zeros(0, dtype=np.int64)
    if fingerprint is None:
        digest = hashlib.sha256(lengths.tobytes())
        digest.update(ids.tobytes())
        fingerprint = "ids:" + digest.hexdigest()
    else:
        fingerprint = f"hf:{fingerprint}"
    return TokenIds(ids, offsets, fingerprint)


def _is_router(module: nn.Module, hidden: int) -> bool:
    weight = getattr(module, "weight", None)
    shape = whole_shape(weight) if isinstance(weight, torch.Tensor) else None  # ZeRO-3: not its shard's
    return (shape is not None and len(shape) == 2 and shape[1] == hidden
            and isinstance(getattr(module, "top_k", None), int) and getattr(module, "num_experts", None) is not None)


@dataclass
class RoutingWeights:
    """CPU float32 copies of the weights that routing signatures read (a snapshot: training may go on).
    ``state``: for the ``"forward"`` kind, a CPU copy of the model's whole state_dict (dtypes kept)."""

    embedding_VH: torch.Tensor
    routers_LEH: list[torch.Tensor]
    top_k: int
    state: dict[str, torch.Tensor] | None = None

    @property
    def num_experts(self) -> int:
        return self.routers_LEH[0].shape[0]

    def fingerprint(self) -> str:
        digest = hashlib.sha256()
        for t in (self.embedding_VH, *self.routers_LEH):
            digest.update(str(tuple(t.shape)).encode())
            digest.update(t.contiguous().numpy().tobytes())
        digest.update(f"k={self.top_k}".encode())
        for name, t in (self.state or {}).items():  # every parameter and buffer: anything may move routing
            digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
            digest.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()


def _embedding_and_routers(model: nn.Module) -> tuple[nn.Module | None, list[nn.Module]]:
    """The input embedding (None if there is none) and the router modules whose weight is [E, its width]."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embedding is None:
        embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        return None, []
    return embedding, [m for m in model.modules() if _is_router(m, whole_shape(embedding.weight)[1])]


def has_moe_router(model: nn.Module) -> bool:
    """Whether ``model`` has a router :func:`routing_weights` can read (so routing signatures can be computed)."""
    return bool(_embedding_and_routers(model)[1])


def _checked_embedding_and_routers(model: nn.Module) -> tuple[nn.Module, list[nn.Module]]:
    """``_embedding_and_routers``, or an error naming what routing signatures need and the model lacks."""
    embedding, routers = _embedding_and_routers(model)
    if embedding is None:
        raise ValueError(f"{type(model).__name__} has no input embedding (nn.Embedding); routing signatures "
                         "need one")
    if not routers:
        raise ValueError(f"{type(model).__name__} has no MoE router (a module with weight "
                         f"[E, {whole_shape(embedding.weight)[1]}], top_k and num_experts); routing signatures "
                         "need an MoE model")
    experts = {whole_shape(m.weight)[0] for m in routers}
    if len(experts) != 1:
        raise ValueError(f"MoE layers with different expert counts {sorted(experts)} are not supported")
    return embedding, routers


def routing_weights(model: nn.Module) -> RoutingWeights:
    """Snapshot the input embedding and the router of every MoE layer (ExpertMaskedMoE's ``gate``, or any
    router module with a ``weight`` [E, H], ``top_k`` and ``num_experts``, like transformers' Mixtral). Under
    ZeRO-3 those weights are gathered for the copy: a collective, so every rank takes its snapshot at the same
    point (the sampler does, at the same batch on each rank, in the thread that iterates it)."""
    embedding, routers = _checked_embedding_and_routers(model)
    with torch.no_grad(), gathered([embedding.weight, *(m.weight for m in routers)]):
        return RoutingWeights(embedding.weight.detach().to("cpu", torch.float32, copy=True),
                              [m.weight.detach().to("cpu", torch.float32, copy=True) for m in routers],
                              int(routers[0].top_k))


def _rms_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def router_table(weights: RoutingWeights, kind: str = "router") -> torch.Tensor:
    """table_VS: each vocabulary token's expected routing, per MoE layer (see the module docstring)."""
    if kind not in ("router", "router_topk"):
        raise ValueError(f"router_table: kind must be 'router' or 'router_topk', got {kind!r}")
    x_VH = _rms_normalize(weights.embedding_VH)
    blocks = []
    for w_EH in weights.routers_LEH:
        probs_VE = torch.softmax(x_VH @ w_EH.t(), dim=-1)
        if kind == "router_topk":
            ids_VK = probs_VE.topk(weights.top_k, dim=-1).indices
            probs_VE = torch.zeros_like(probs_VE).scatter_(1, ids_VK, 1.0 / weights.top_k)
        blocks.append(probs_VE)
    return torch.cat(blocks, dim=1)


class RoutingProbe(nn.Module):
    """MLP from a token's (RMS-normalized) embedding to its routing distribution in each of L MoE layers."""

    def __init__(self, hidden_size: int, num_layers: int, num_experts: int, width: int = 128):
        super().__init__()
        self.num_layers, self.num_experts = num_layers, num_experts
        self.net = nn.Sequential(nn.Linear(hidden_size, width), nn.GELU(), nn.Linear(width, num_layers * num_experts))

    def forward(self, embedding_TH: torch.Tensor) -> torch.Tensor:
        logits = self.net(_rms_normalize(embedding_TH)).view(-1, self.num_layers, self.num_experts)
        return torch.softmax(logits, dim=-1).reshape(-1, self.num_layers * self.num_experts)

    def fit(self, embedding_VH: torch.Tensor, token_ids_T: torch.Tensor, targets_TS: torch.Tensor, *,
            steps: int = 300, lr: float = 3e-3, seed: int = 0) -> float:
        """Fit on observed routing (soft cross-entropy per layer); returns the final loss. Tokens are
        first averaged per vocabulary id (the probe is context-free), weighted by their frequency."""
        if len(token_ids_T) == 0:
            raise ValueError("RoutingProbe.fit: no observed tokens")
        vocab, counts = torch.unique(token_ids_T, return_counts=True, return_inverse=False)
        index = torch.searchsorted(vocab, token_ids_T)
        mean_VS = torch.zeros(len(vocab), targets_TS.shape[1]).index_add_(0, index, targets_TS.float())
        mean_VS /= counts[:, None]
        weight_V = counts.float() / counts.sum()
        x_VH = embedding_VH[vocab].float()
        gen = torch.Generator().manual_seed(seed)
        for p in self.parameters():  # deterministic init from the seed, whatever the global RNG
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * (0.02 if p.dim() == 1 else p.shape[-1] ** -0.5))
        opt = torch.optim.Adam(self.parameters(), lr=lr)
        loss = torch.zeros(())
        for _ in range(steps):
            pred = self(x_VH).clamp_min(1e-8).view(-1, self.num_layers, self.num_experts)
            target = mean_VS.view(-1, self.num_layers, self.num_experts)
            loss = -((target * pred.log()).sum(-1).mean(-1) * weight_V).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return float(loss.detach())

    @torch.no_grad()
    def table(self, embedding_VH: torch.Tensor) -> torch.Tensor:
        return self(embedding_VH.float())

    def fingerprint(self) -> str:
        digest = hashlib.sha256()
        for t in self.state_dict().values():
            digest.update(t.detach().cpu().float().contiguous().numpy().tobytes())
        return digest.hexdigest()


def observed_routing(model: nn.Module, batches: Iterable[dict]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Run ``model(input_ids=..., attention_mask=...)`` (no grad, eval mode) on each of ``batches`` (collator
    outputs) and yield, per batch, its real tokens (mask != 0, row-major) and their top-k experts in every
    MoE layer as 1/k entries: (token_ids_T, targets_TS), recorded by forward hooks on the routers."""
    _, routers = _checked_embedding_and_routers(model)  # not routing_weights: no copy (nor ZeRO-3 gather) of weights
    num_experts = whole_shape(routers[0].weight)[0]
    seen: list[list[torch.Tensor]] = [[] for _ in routers]
    hooks = [r.register_forward_hook(lambda mod, inp, out, i=i: seen[i].append(out[-1].detach().cpu()))
             for i, r in enumerate(routers)]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            ids = batch["input_ids"]
            mask = batch.get("attention_mask", torch.ones_like(ids))
            with torch.no_grad():
                model(input_ids=ids.to(device), attention_mask=mask.to(device))
            keep_T = mask.reshape(-1).bool().cpu()
            blocks = []
            for layer in seen:
                ids_TK = torch.cat(layer)
                layer.clear()
                k = ids_TK.shape[1]
                onehot = torch.zeros(ids_TK.shape[0], num_experts).scatter_(1, ids_TK, 1.0 / k)
                blocks.append(onehot[keep_T])
            yield ids.reshape(-1).cpu()[keep_T], torch.cat(blocks, dim=1)
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)


def collect_observed_routing(model: nn.Module, batches: Iterable[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`observed_routing` over all ``batches``, concatenated: (token_ids_T, targets_TS)."""
    tokens, targets = zip(*observed_routing(model, batches))
    return torch.cat(tokens), torch.cat(targets)


def forward_signatures(model: nn.Module, token_ids: TokenIds, batch_size: int = 32, pad_token_id: int = 0
                       ) -> tuple[np.ndarray, np.ndarray]:
    """The ``"forward"`` kind: every sample's actual routing in a no-grad forward of ``model`` (on its device),
    samples batched ``batch_size`` at a time in order of length (right-padded with ``pad_token_id``, with an
    attention mask), each sample's top-k counts per (layer, expert) divided by k and its token count:
    (signatures_NS float32, num_tokens_N). Empty samples get zero rows."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"forward_signatures: batch_size must be an integer >= 1, got {batch_size!r}")
    lengths = token_ids.lengths_N
    order = np.argsort(lengths, kind="stable")
    order = order[lengths[order] > 0]
    chunks = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]

    def batches():
        for chunk in chunks:
            width = int(lengths[chunk].max())
            ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, i in enumerate(chunk):
                ids[row, :lengths[i]] = torch.from_numpy(token_ids.sample(int(i)))
                mask[row, :lengths[i]] = 1
            yield {"input_ids": ids, "attention_mask": mask}

    out = None
    for b, (_, targets_TS) in enumerate(observed_routing(model, batches())):  # runs to the end: hooks removed
        chunk = chunks[b]
        if out is None:
            out = np.zeros((len(token_ids), targets_TS.shape[1]), dtype=np.float32)
        counts = torch.from_numpy(lengths[chunk])
        segment = torch.repeat_interleave(torch.arange(len(chunk)), counts)
        sums = torch.zeros(len(chunk), targets_TS.shape[1], dtype=torch.float64)
        sums.index_add_(0, segment, targets_TS.double())
        out[chunk] = (sums / counts[:, None].double()).numpy()
    if out is None:  # no non-empty sample: one layer block per router, all zero
        weights = routing_weights(model)
        out = np.zeros((len(token_ids), len(weights.routers_LEH) * weights.num_experts), dtype=np.float32)
    return out, lengths.astype(np.int64)


def signatures_from_table(token_ids: TokenIds, table_VS: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Mean of table rows over each sample's tokens, in chunks of ~CHUNK_TOKENS tokens (no grad, on the
    table's device): (signatures_NS float32, num_tokens_N)."""
    n = len(token_ids)
    lengths = token_ids.lengths_N
    vocab = table_VS.shape[0]
    if len(token_ids.ids_T) and (token_ids.ids_T.min() < 0 or token_ids.ids_T.max() >= vocab):
        raise ValueError(f"token ids must be in [0, {vocab}) (the embedding's rows), got "
                         f"[{token_ids.ids_T.min()}, {token_ids.ids_T.max()}]")
    out = np.zeros((n, table_VS.shape[1]), dtype=np.float32)
    start = 0
    with torch.no_grad():
        while start < n:
            end = int(np.searchsorted(token_ids.offsets_N1, token_ids.offsets_N1[start] + CHUNK_TOKENS, "right"))
            end = min(max(end - 1, start + 1), n)
            lo, hi = token_ids.offsets_N1[start], token_ids.offsets_N1[end]
            ids = torch.from_numpy(token_ids.ids_T[lo:hi]).to(table_VS.device)
            segment = torch.repeat_interleave(torch.arange(end - start, device=table_VS.device),
                                              torch.from_numpy(lengths[start:end]).to(table_VS.device))
            sums = torch.zeros(end - start, table_VS.shape[1], device=table_VS.device, dtype=torch.float64)
            sums.index_add_(0, segment, table_VS[ids].double())
            out[start:end] = (sums / torch.from_numpy(lengths[start:end]).clamp_min(1).to(sums)[:, None]).cpu().numpy()
            start = end
    return out, lengths.astype(np.int64)


class SignatureCache:
    """``<dir>/<key>.npz`` files; writes are atomic (temp file + rename), so readers never see half a file."""

    def __init__(self, directory: str | os.PathLike | None = None):
        self.directory = Path(directory) if directory is not None else DEFAULT_CACHE_DIR

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.npz"

    def get(self, key: str) -> SignatureSet | None:
        path = self.path(key)
        if not path.exists():
            return None
        with np.load(path) as f:
            return SignatureSet(f["signatures_NS"], f["num_tokens_N"], int(f["num_experts"]), key)

    def put(self, sigs: SignatureSet) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".npz.tmp")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, signatures_NS=sigs.signatures_NS, num_tokens_N=sigs.num_tokens_N,
                     num_experts=np.int64(sigs.num_experts))
        os.replace(tmp, self.path(sigs.key))


def _copy_model(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)``, where tensors left by the last training forward in module attributes (an aux
    loss, routing statistics: non-leaf tensors, which deepcopy refuses) are copied detached."""
    memo: dict[int, Any] = {}

    def scan(value: Any, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            if value.grad_fn is not None:
                memo[id(value)] = value.detach().clone()
        elif depth < 4 and not isinstance(value, nn.Module):
            if isinstance(value, dict):
                items = value.values()
            elif isinstance(value, (list, tuple, set)):
                items = value
            elif hasattr(value, "__dict__") and not isinstance(value, type):
                items = vars(value).values()
            else:
                return
            for item in items:
                scan(item, depth + 1)

    with torch.no_grad():
        for module in model.modules():
            for name, value in vars(module).items():
                if name not in ("_parameters", "_buffers", "_modules"):
                    scan(value, 0)
        return copy.deepcopy(model, memo)


class RouterSignatures:
    """Signature source for :class:`ExpertAwareSampler`: ``snapshot()`` copies the model's routing weights to
    the CPU (call it where the model may be read, e.g. between steps); ``compute(snapshot)`` touches only
    that copy, so it can run in a background thread while training goes on. ``kind`` and ``probe`` as in
    the module docstring; ``device`` runs the pre-scan gather there (default CPU).

    ``kind="forward"``: ``snapshot()`` also copies the model's whole state_dict to the CPU, and ``compute``
    loads it into a private copy of the model (made once, by ``copy.deepcopy`` in the first ``snapshot()``,
    moved to ``device``) and runs :func:`forward_signatures` there, ``forward_batch_size`` samples per
    forward. Memory: one more copy of the model on ``device`` and one on the CPU. The model must run as a
    whole in this process (``model(input_ids=, attention_mask=)``); expert-parallel shards are not supported."""

    def __init__(self, model: nn.Module, token_ids: TokenIds, *, kind: str = "router",
                 probe: RoutingProbe | None = None, cache: SignatureCache | None = None, device: str = "cpu",
                 forward_batch_size: int = 32, pad_token_id: int = 0):
        if kind not in SIGNATURE_KINDS:
            raise ValueError(f"signature must be one of {SIGNATURE_KINDS}, got {kind!r}")
        if kind == "probe" and probe is None:
            raise ValueError("signature='probe' needs a fitted RoutingProbe (see collect_observed_routing)")
        self.model, self.token_ids, self.kind, self.probe = model, token_ids, kind, probe
        self.cache, self.device = cache, device
        self.forward_batch_size, self.pad_token_id = forward_batch_size, pad_token_id
        self._worker: nn.Module | None = None  # the "forward" kind's private copy of the model

    def snapshot(self) -> RoutingWeights:
        if self.kind == "forward" and partitioned(self.model.parameters()):
            raise ValueError("expert-aware sampler: signature 'forward' runs a whole copy of the model, whose "
                             "parameters ZeRO-3 partitions; under ZeRO-3 set loongforge.sampler.signature to "
                             "'router' (the default) or 'probe'")
        weights = routing_weights(self.model)
        if self.kind == "forward":
            if self._worker is None:
                self._worker = _copy_model(self.model).to(self.device).eval()
                self._worker.requires_grad_(False)
                for param in self._worker.parameters():
                    param.grad = None
            with torch.no_grad():
                weights.state = {name: t.detach().to("cpu", copy=True)
                                 for name, t in self.model.state_dict().items()}
        return weights

    def compute(self, weights: RoutingWeights) -> SignatureSet:
        probe_fp = self.probe.fingerprint() if self.kind == "probe" else ""
        if self.kind == "forward" and weights.state is None:
            raise ValueError("signature='forward' needs a snapshot with the model state (this source's snapshot())")
        settings = f"bs={self.forward_batch_size},pad={self.pad_token_id}" if self.kind == "forward" else ""
        key = hashlib.sha256("|".join([self.token_ids.fingerprint, weights.fingerprint(), self.kind,
                                       probe_fp, settings, "v1"]).encode()).hexdigest()[:32]
        if self.cache is not None:
            hit = self.cache.get(key)
            if hit is not None:
                logger.info("[LoongForge] routing signatures: cache hit %s", self.cache.path(key))
                return hit
        if self.kind == "forward":
            self._worker.load_state_dict(weights.state)
            signatures, num_tokens = forward_signatures(self._worker, self.token_ids, self.forward_batch_size,
                                                        self.pad_token_id)
        else:
            table_VS = (self.probe.table(weights.embedding_VH) if self.kind == "probe"
                        else router_table(weights, self.kind))
            signatures, num_tokens = signatures_from_table(self.token_ids, table_VS.to(self.device))
        sigs = SignatureSet(signatures, num_tokens, weights.num_experts, key)
        if self.cache is not None:
            self.cache.put(sigs)
        return sigs

    def __call__(self) -> SignatureSet:
        return self.compute(self.snapshot())


__all__ = ["SIGNATURE_KINDS", "TokenIds", "SignatureSet", "RoutingWeights", "RoutingProbe", "RouterSignatures",
           "SignatureCache", "dataset_token_ids", "routing_weights", "router_table", "collect_observed_routing",
           "observed_routing", "forward_signatures", "signatures_from_table"]
