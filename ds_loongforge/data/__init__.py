"""Data side of LoongForge: the expert-aware batch sampler, routing signatures, the padding collator, and the
side-stream device prefetcher.

    loader = build_dataloader(dataset, ds_config, model, batch_size=8)   # rank/world size from torch.distributed
    batches = DevicePrefetcher(loader, engine.device)                   # next batch's copy in flight

With the config block, ``deepspeed.initialize(training_data=...)`` (through ``ds_loongforge.initialize`` or
config-only enablement) returns the loader ``build_dataloader`` makes instead of DeepSpeed's own
(``integrations/deepspeed_hook.py``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from ds_loongforge.data.collator import PadCollator
from ds_loongforge.data.prefetch import DevicePrefetcher
from ds_loongforge.data.sampler import BucketPlan, ExpertAwareSampler, batch_loads, cluster_signatures, max_load_cv
from ds_loongforge.data.signatures import (SIGNATURE_KINDS, RouterSignatures, RoutingProbe, RoutingWeights,
                                           SignatureCache, SignatureSet, TokenIds, collect_observed_routing,
                                           dataset_token_ids, forward_signatures, observed_routing, router_table,
                                           routing_weights, signatures_from_table)

logger = logging.getLogger("ds_loongforge")


def _sampler_config(config: Any):
    from ds_loongforge.config import LoongForgeConfig, SamplerConfig, parse_config

    if config is None:
        return SamplerConfig()
    if isinstance(config, SamplerConfig):
        return config
    if isinstance(config, LoongForgeConfig):
        return config.sampler
    if isinstance(config, dict):
        return parse_config(config if "loongforge" in config else {"loongforge": config}).sampler
    raise TypeError(f"build_dataloader: config must be a DeepSpeed config dict, a LoongForgeConfig or a "
                    f"SamplerConfig, got {type(config).__name__}")


def fit_probe(model: nn.Module, dataset, collator, *, num_batches: int = 8, batch_size: int = 8, seed: int = 0) -> RoutingProbe:
    """Fit a RoutingProbe on the routing observed in forwards of ``num_batches`` evenly spaced batches."""
    n = len(dataset)
    picks = torch.linspace(0, n - 1, min(n, num_batches * batch_size)).long().tolist()
    batches = [collator([dataset[i] for i in picks[j:j + batch_size]]) for j in range(0, len(picks), batch_size)]
    token_ids_T, targets_TS = collect_observed_routing(model, batches)
    weights = routing_weights(model)
    probe = RoutingProbe(weights.embedding_VH.shape[1], len(weights.routers_LEH), weights.num_experts)
    loss = probe.fit(weights.embedding_VH, token_ids_T, targets_TS, seed=seed)
    logger.info("[LoongForge] routing probe fitted on %d tokens (soft cross-entropy %.3f)", len(token_ids_T), loss)
    return probe


def build_dataloader(dataset, config: Any, model: nn.Module, batch_size: int, rank: int | None = None,
                     world_size: int | None = None, *, collate_fn=None, pad_token_id: int = 0,
                     column: str = "input_ids", drop_last: bool = False, shuffle: bool = True,
                     signature_device: str = "cpu", **loader_kwargs) -> DataLoader:
    """A DataLoader over ``dataset`` following the ``"loongforge.sampler"`` section: ExpertAwareSampler batches
    (signatures from ``model``) when ``expert_aware``, else a DistributedSampler; PadCollator by default.
    ``config``: DeepSpeed config dict, LoongForgeConfig or SamplerConfig. ``loader_kwargs`` go to DataLoader
    (num_workers, pin_memory, ...). The sampler is ``loader.batch_sampler`` (``set_epoch``, ``state_dict``)."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"build_dataloader: batch_size must be an integer >= 1, got {batch_size!r}")
    cfg = _sampler_config(config)
    collate_fn = collate_fn or PadCollator(pad_token_id, cfg.pad_to_multiple_of, column=column)
    if not cfg.expert_aware:
        sampler = DistributedSampler(dataset, num_replicas=world_size or 1, rank=rank or 0, shuffle=shuffle,
                                     seed=cfg.seed, drop_last=drop_last)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                          drop_last=drop_last, **loader_kwargs)
    token_ids = dataset_token_ids(dataset, column)
    probe = fit_probe(model, dataset, collate_fn, seed=cfg.seed) if cfg.signature == "probe" else None
    source = RouterSignatures(model, token_ids, kind=cfg.signature, probe=probe, cache=SignatureCache(cfg.cache_dir),
                              device=signature_device, pad_token_id=pad_token_id)
    sampler = ExpertAwareSampler(source, batch_size, n_clusters=cfg.n_clusters, num_replicas=world_size, rank=rank,
                                 shuffle=shuffle, seed=cfg.seed, drop_last=drop_last, refresh_every=cfg.refresh_every)
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_fn, **loader_kwargs)


__all__ = ["ExpertAwareSampler", "BucketPlan", "cluster_signatures", "batch_loads", "max_load_cv", "PadCollator",
           "SIGNATURE_KINDS", "RouterSignatures", "RoutingProbe", "RoutingWeights", "SignatureCache",
           "SignatureSet", "TokenIds", "collect_observed_routing", "dataset_token_ids", "router_table",
           "routing_weights", "signatures_from_table", "forward_signatures", "observed_routing", "fit_probe",
           "build_dataloader", "DevicePrefetcher"]
