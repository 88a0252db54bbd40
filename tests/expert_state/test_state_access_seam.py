"""The STATE_ACCESS seam holds for a container moescale does not know: experts kept in a dict
of plain tensors, written in this file only, are saved to a sharded expert checkpoint, loaded
back into another such layer (weights and AdamW moments exactly), cross-loaded with resident
GroupedExperts of the same shapes, and exported by consolidated_state_dict, with no library
change. A container without the capability gets a ValueError naming it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moescale.dispatch.protocol import STATE_ACCESS, STREAMED
from moescale.expert_state import load_expert_shards, save_expert_shards
from moescale.layers.experts import GroupedExperts
from moescale.layers.moe import MoE
from moescale.models.checkpoint import consolidated_state_dict

D, F, E = 8, 16, 4
NAMES = (("w1_EDF", (D, F)), ("w2_EFD", (F, D)))


class DictState:
    """ExpertState over {e: {name: tensor}} masters and {e: (exp_avg, exp_avg_sq, step)}."""

    tier, store, engine, stacked = "resident", None, None, True

    def __init__(self, owner: "DictExperts") -> None:
        self.owner, self.spec = owner, list(NAMES)

    def read(self, l):
        return self.owner.master[l], self.owner.moments.get(l)

    def masters(self, l):
        return {n: t.clone() for n, t in self.owner.master[l].items()}

    def write(self, l, master, moments):
        self.owner.master[l] = {n: master[n].clone() for n, _ in NAMES}
        if moments is None:
            self.owner.moments.pop(l, None)
        else:
            self.owner.moments[l] = ({n: moments[0][n].clone() for n, _ in NAMES},
                                     {n: moments[1][n].clone() for n, _ in NAMES}, moments[2])

    def finish(self):
        pass


class DictExperts(nn.Module):
    """E FFN experts as plain tensors in dicts (no parameters), computed by plain ops."""

    capabilities = frozenset({STREAMED, STATE_ACCESS})

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.num_experts = E
        self.master = {e: {n: torch.randn(s, generator=g) for n, s in NAMES} for e in range(E)}
        self.moments = {e: ({n: torch.rand(s, generator=g) for n, s in NAMES},
                            {n: torch.rand(s, generator=g) for n, s in NAMES}, float(e + 1))
                        for e in range(E)}

    @property
    def expert_ids(self) -> range:
        return range(E)

    def expert_forward(self, e, x_ND):
        w = self.master[e]
        return torch.relu(x_ND @ w["w1_EDF"]) @ w["w2_EFD"]

    def forward_rows(self, x_RD, counts):
        parts, start = [], 0
        for e, n in enumerate(counts):
            parts.append(self.expert_forward(e, x_RD[start:start + n]))
            start += n
        return torch.cat(parts)

    def state_access(self, key, optimizer=None, engine=None):
        return DictState(self)


def _layer(experts) -> nn.Module:
    model = nn.Module()
    model.ffn = MoE(D, E, 2, d_ff=F, experts=experts)
    return model


def test_a_foreign_container_saves_loads_and_exports_through_state_access(tmp_path):
    source = _layer(DictExperts(seed=0))
    entry = save_expert_shards(source, str(tmp_path), rank=0, tag="00000001")
    target = _layer(DictExperts(seed=1))
    assert not torch.equal(target.ffn.experts.master[2]["w1_EDF"],
                           source.ffn.experts.master[2]["w1_EDF"])
    load_expert_shards(target, str(tmp_path), [entry])
    for e in range(E):
        for n, _ in NAMES:
            assert torch.equal(target.ffn.experts.master[e][n], source.ffn.experts.master[e][n])
            for i in (0, 1):
                assert torch.equal(target.ffn.experts.moments[e][i][n],
                                   source.ffn.experts.moments[e][i][n])
        assert target.ffn.experts.moments[e][2] == source.ffn.experts.moments[e][2]
    target.ffn.router.load_state_dict(source.ffn.router.state_dict())
    x = torch.randn(5, D)
    assert torch.equal(target.ffn(x), source.ffn(x))
    state = consolidated_state_dict(source)
    want = torch.stack([source.ffn.experts.master[e]["w1_EDF"] for e in range(E)])
    assert torch.equal(state["ffn.experts.w1_EDF"], want)


def test_resident_grouped_experts_load_the_foreign_containers_weights(tmp_path):
    source = _layer(DictExperts(seed=0))
    entry = save_expert_shards(source, str(tmp_path), rank=0, tag="00000001")
    resident = _layer(GroupedExperts(E, D, F, activation="relu"))
    load_expert_shards(resident, str(tmp_path), [entry])
    x = torch.randn(6, D)
    for e in range(E):
        assert torch.equal(resident.ffn.experts.w1_EDF[e], source.ffn.experts.master[e]["w1_EDF"])
        torch.testing.assert_close(resident.ffn.experts.expert_forward(e, x),
                                   source.ffn.experts.expert_forward(e, x))


def test_a_container_without_state_access_is_refused_by_name(tmp_path):
    class Bare(DictExperts):
        capabilities = frozenset({STREAMED})

    with pytest.raises(ValueError, match="Bare does not declare the STATE_ACCESS capability"):
        save_expert_shards(_layer(Bare(seed=0)), str(tmp_path), rank=0, tag="00000001")
