"""Parameter sets and helpers shared by the op, module and integration tests."""

from typing import Callable

import pytest
import torch

# the CPU kernel always; the CUDA kernel under the gpu marker (device machine)
IMPLS = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16"),
          pytest.param(torch.float16, id="fp16")]


def device_of(impl: str) -> str:
    """The device an impl's tensors live on: cuda for the CUDA kernel, the CPU for the CPU kernel and the reference."""
    return "cuda" if impl == "cuda" else "cpu"


def assert_checks(results):
    failed = [r.describe() for r in results if not r.passed]
    assert not failed, "\n".join(failed)


# Our fused top-k and a stock router (torch.softmax, then torch.topk of the fp32 probabilities) may order two experts
# otherwise where their logits lie within about an ulp of the probabilities apart: measured on the CPU with the k-th
# and (k+1)-th logits set a uniform gap apart, the choices differ with a probability that integrates to 4e-8 (E16k4)
# to 5e-8 (E4k2) over the gap in logit units, and never at a gap of 1e-6 or more (0 of 1M tokens). A changed expert is
# far beyond any tolerance, so tests comparing the two redraw their inputs where a gap is below MIN_ROUTER_GAP (ten
# times the 1e-6 past which none flipped): every choice compared is decided by a margin. The rates this removed are
# in the tests that use it.
MIN_ROUTER_GAP = 1e-5


def min_topk_gap(logits: list[torch.Tensor], k: int) -> float:
    """The smallest gap between the k-th and (k+1)-th logit of any row of any of ``logits`` (fp64; inf where no
    row has a (k+1)-th: k equal to the expert count, or no rows)."""
    gaps = [float("inf")]
    for layer in logits:
        top = layer.detach().double().cpu().sort(-1, descending=True).values
        if top.shape[-1] > k and top.numel():
            gaps.append(float((top[..., k - 1] - top[..., k]).min()))
    return min(gaps)


def draw_without_router_near_tie(draw: Callable[[], torch.Tensor],
                                 router_logits: Callable[[torch.Tensor], list[torch.Tensor]], k: int,
                                 gap: float = MIN_ROUTER_GAP) -> torch.Tensor:
    """``draw()`` again until the router logits of what it drew have no top-k gap below ``gap``."""
    for _ in range(100):
        x = draw()
        if min_topk_gap(router_logits(x), k) >= gap:
            return x
    raise AssertionError(f"100 draws all had a router near-tie below {gap}: degenerate router weights")


def adam_first_step_excess(before: torch.Tensor, after: torch.Tensor, lr: float, weight_decay: float) -> float:
    """How far 16-bit weights moved by one first (AdamW) step beyond what that step allows: each master moves by at
    most lr plus the decay lr * weight_decay * |w|, and the weights before and after are masters rounded to the
    16-bit dtype, each within half an ulp of its own (an ulp of the larger of the two, bf16's 8 significant bits).
    At most ~0 for a run that continued from the loaded weights; about the distance to the engine's initial weights
    for one whose masters were not the checkpoint's."""
    before, after = before.float(), after.float()
    big = torch.maximum(before.abs(), after.abs()).clamp_min(2.0**-126)
    ulp = torch.exp2(torch.floor(torch.log2(big)) - 7)
    return ((after - before).abs() - lr * (1 + weight_decay * before.abs()) - ulp).max().item()
