"""Router configuration: plain data, validated on construction.

The router kind names one of the routers in `moescale.routing.routers`. This file holds no
tensors and no modules; it only checks that the numbers make sense and says how to fix them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ROUTER_KINDS = ("topk", "noisy_topk", "switch", "gshard")


@dataclass(kw_only=True)
class RouterConfig:
    """How tokens choose experts.

    kind:          "topk" (softmax then top-k, Mixtral), "noisy_topk" (Shazeer et al. 2017:
                   top-k of noisy logits, softmax over the k kept), "switch" (top-1 with
                   multiplicative input jitter), "gshard" (top-2, second expert routed at random
                   in proportion to its gate).
    top_k:         experts per token (switch requires 1, gshard requires 2).
    renormalize:   divide the k scores by their sum (None: True for topk with top_k > 1,
                   fixed by the method for the other kinds).
    jitter_eps:    switch only: input multiplied by U(1 - eps, 1 + eps) while training.
    noise_std_min: noisy_topk only: floor added to softplus(noise logits) while training.
    random_routing: gshard only: drop the second expert with probability 1 - min(1, 2 * g2).

    An MoEConfig holds one (moescale.layers.moe); under flat keys (`MoE(router="switch")`,
    `--model.router`, config.json) `kind` is called `router` (FLAT_NAMES, moescale.config_tree).
    """

    FLAT_NAMES = {"kind": "router"}    # field -> flat key; not a field (no annotation)

    kind: str = "topk"
    num_experts: int = 8
    top_k: int = 2
    renormalize: bool | None = None
    jitter_eps: float = 0.01
    noise_std_min: float = 0.0
    random_routing: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ROUTER_KINDS:
            raise ValueError(
                f"router kind={self.kind!r} is unknown; use one of {', '.join(ROUTER_KINDS)}"
            )
        if not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise ValueError(
                f"num_experts={self.num_experts!r} must be an integer >= 1; "
                "give at least one expert"
            )
        if not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"top_k={self.top_k!r} must be an integer >= 1")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"top_k={self.top_k} is larger than num_experts={self.num_experts}; "
                f"use top_k <= {self.num_experts} or add experts"
            )
        if self.kind == "switch" and self.top_k != 1:
            raise ValueError(f"the switch router sends each token to one expert, got "
                             f"top_k={self.top_k}: set top_k=1 (moescale train: --model.top_k "
                             f"1), or keep top_k={self.top_k} with router kind 'topk'")
        if self.kind == "gshard" and self.top_k != 2:
            raise ValueError(f"the gshard router sends each token to two experts, got "
                             f"top_k={self.top_k}: set top_k=2 (moescale train: --model.top_k "
                             f"2), or keep top_k={self.top_k} with router kind 'topk'")
        if not (0.0 <= self.jitter_eps < 1.0) or math.isnan(self.jitter_eps):
            raise ValueError(f"jitter_eps={self.jitter_eps!r} must lie in [0, 1)")
        if self.noise_std_min < 0:
            raise ValueError(f"noise_std_min={self.noise_std_min!r} must be >= 0")

    @property
    def renormalize_scores(self) -> bool:
        """Whether the k scores are divided by their sum (resolves the None default)."""
        if self.kind == "topk":
            return self.top_k > 1 if self.renormalize is None else bool(self.renormalize)
        if self.kind == "gshard":
            return True if self.renormalize is None else bool(self.renormalize)
        return False if self.renormalize is None else bool(self.renormalize)


def expert_capacity(capacity_factor: float | None, num_tokens: int, top_k: int,
                    num_experts: int) -> int | None:
    """Slots per expert: ceil(capacity_factor * T * K / E); None means dropless.

    The product is shrunk by a relative 1e-12 before the ceiling so that float rounding of an
    exact integer (1.1 * 50 = 55.00000000000001) does not grant one slot too many. A product
    past 2**62 (or infinite) is T: no expert can receive more tokens than there are.
    """
    if capacity_factor is None:
        return None
    slots = capacity_factor * num_tokens * top_k / num_experts * (1 - 1e-12)
    if not slots < 2 ** 62:      # a factor so large that the product overflows int64 or
        return num_tokens        # float: no expert gets a token twice, so nothing is dropped
    return int(math.ceil(slots))
