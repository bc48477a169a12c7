"""exl3rt.moe.tiers: bitrate tiers, the combined namespace, descriptors, rotations, geometry checks."""

from __future__ import annotations

import random

import pytest
import torch

from exl3rt.format import EncodedLinear
from exl3rt.format.bits import words16_per_tile
from exl3rt.moe import (TierError, tier_rotations, tiers_from_bitrates, tiers_from_experts,
                        tiers_from_partition)

VALID_K = (2, 2.5, 3, 3.5, 4, 5, 6, 8)


def test_two_tier_example_maps_and_descriptors():
    lay = tiers_from_bitrates([4, 3, 4, 3], layer="model.layers.3.mlp.experts")
    assert lay.signature == ((3, 2), (4, 2))
    assert [t.expert_ids for t in lay.tiers] == [(1, 3), (0, 2)]
    assert [t.offset for t in lay.tiers] == [0, 2]
    assert lay.combined_to_global == (1, 3, 0, 2)
    assert lay.global_to_combined == (2, 0, 3, 1)
    assert lay.descriptors == (0, 1, 256, 257)
    assert lay.descriptor_shift == 8
    assert lay.global_to_combined_tensor().dtype == torch.int32
    assert lay.descriptor_tensor().tolist() == [0, 1, 256, 257]


@pytest.mark.parametrize("seed", range(6))
def test_random_partitions_against_brute_force(seed):
    rng = random.Random(seed)
    E = rng.randint(1, 40)
    ks = rng.sample(VALID_K, rng.randint(1, 4))
    bits = [rng.choice(ks) for _ in range(E)]
    lay = tiers_from_bitrates(bits)
    # brute force: combined order = experts sorted by (K, global id)
    order = sorted(range(E), key=lambda g: (float(bits[g]), g))
    assert list(lay.combined_to_global) == order
    assert [lay.global_to_combined[g] for g in order] == list(range(E))
    assert [k for k, _ in lay.signature] == sorted(set(bits), key=float)
    assert [n for _, n in lay.signature] == [bits.count(k) for k in sorted(set(bits), key=float)]
    for c, g in enumerate(order):
        tier, local = lay.decode_descriptor(lay.descriptors[c])
        assert (tier, local) == lay.locate(c)
        assert lay.tiers[tier].bits == bits[g] and lay.tiers[tier].expert_ids[local] == g
        assert lay.bits_of(g) == bits[g]
    # the same partition given as {K: ids}, ids in any order, gives the same layout
    part = {k: rng.sample([g for g in range(E) if bits[g] == k], bits.count(k)) for k in set(bits)}
    lay2 = tiers_from_partition(part, E)
    assert lay2.combined_to_global == lay.combined_to_global and lay2.descriptors == lay.descriptors


def test_descriptor_widens_when_a_tier_exceeds_256_experts():
    lay = tiers_from_bitrates([3] * 300 + [4] * 2)
    assert lay.descriptor_shift == 16
    assert lay.descriptors[299] == 299 and lay.descriptors[300] == (1 << 16)
    assert lay.decode_descriptor(lay.descriptors[301]) == (1, 1)
    assert tiers_from_bitrates([3] * 256 + [4]).descriptors[256] == 256  # 256 still fits the narrow form


@pytest.mark.parametrize("bad", [7.5, 0, 9, 4.25, "x", None])
def test_invalid_bitrate_names_layer_and_expert(bad):
    with pytest.raises(TierError, match=r"layers\.5\.mlp.*expert 2 bitrate") as e:
        tiers_from_bitrates([3, 4, bad, 3], layer="layers.5.mlp")
    assert "1..8" in str(e.value)


def test_partition_must_cover_experts_exactly_once():
    with pytest.raises(TierError, match=r"L: 2 expert\(s\) are in no tier \(1, 3\).*exactly once"):
        tiers_from_partition({3: [0], 4: [2]}, 4, layer="L")
    with pytest.raises(TierError, match=r"expert 1 is listed twice \(K=3 and K=4\)"):
        tiers_from_partition([(3, [0, 1]), (4, [1, 2, 3])], 4, layer="L")
    with pytest.raises(TierError, match=r"expert 4 .* out of range for 4 experts"):
        tiers_from_partition({3: [0, 1, 2, 3, 4]}, 4, layer="L")
    with pytest.raises(TierError, match=r"tier bitrate 9"):
        tiers_from_partition({9: [0, 1]}, 2, layer="L")
    merged = tiers_from_partition([(3, [0]), (3.0, [2]), (4, [1])], 3)  # equal K entries form one tier
    assert merged.signature == ((3, 2), (4, 1))


def test_reorder_rows_per_expert_and_broadcast():
    lay = tiers_from_bitrates([4, 3, 5, 3, 4])
    table = torch.arange(5.0)[:, None] * torch.ones(1, 8)
    reordered, broadcast = lay.reorder_rows(table, "down_proj.svh")
    assert not broadcast
    assert reordered[:, 0].tolist() == [float(g) for g in lay.combined_to_global]
    one = torch.randn(1, 8)
    same, broadcast = lay.reorder_rows(one, "down_proj.svh")
    assert broadcast and same is one
    with pytest.raises(TierError, match=r"down_proj\.svh.*3 rows; expected 1 .*or 5"):
        lay.reorder_rows(torch.zeros(3, 8), "down_proj.svh")


def test_tier_rotations_concatenate_intermediate_side_and_check_broadcast():
    E, H, I = 4, 8, 6
    lay = tiers_from_bitrates([4, 3, 4, 3])
    g = torch.Generator().manual_seed(0)
    gate_svh, up_svh, down_suh = (torch.randn(E, I, generator=g) for _ in range(3))
    down_svh = torch.randn(1, H, generator=g)
    shared = torch.randn(1, H, generator=g)
    rot = tier_rotations(lay, gate_suh=shared, up_suh=shared.clone(), gate_svh=gate_svh, up_svh=up_svh,
                         down_suh=down_suh, down_svh=down_svh)
    assert rot.broadcast_suh and rot.broadcast_svh
    for c, gid in enumerate(lay.combined_to_global):
        assert torch.equal(rot.intermediate[c], torch.cat([gate_svh[gid], up_svh[gid], down_suh[gid]]))
    per = torch.randn(E, H, generator=g)
    rot2 = tier_rotations(lay, gate_suh=per, up_suh=per, gate_svh=gate_svh, up_svh=up_svh, down_suh=down_suh,
                          down_svh=per)
    assert not rot2.broadcast_suh and torch.equal(rot2.up_suh[0], per[lay.combined_to_global[0]])
    with pytest.raises(TierError, match="gate_proj.suh is broadcast but up_proj.suh is per expert"):
        tier_rotations(lay, gate_suh=shared, up_suh=per, gate_svh=gate_svh, up_svh=up_svh, down_suh=down_suh,
                       down_svh=down_svh)
    ungated = tier_rotations(lay, up_suh=per, up_svh=up_svh, down_suh=down_suh[:1], down_svh=down_svh)
    assert ungated.gate_suh is None and ungated.intermediate.shape == (E, 2 * I)
    assert torch.equal(ungated.intermediate[:, I:], down_suh[:1].expand(E, I))


def _trellis(in_f: int, out_f: int, k) -> torch.Tensor:
    return torch.zeros(in_f // 16, out_f // 16, words16_per_tile(k), dtype=torch.int16)


def _expert(k, H=128, I=256):
    return {"gate_proj": _trellis(H, I, k), "up_proj": _trellis(H, I, k), "down_proj": _trellis(I, H, k)}


def test_tiers_from_experts_derives_k_from_trellis_and_checks_geometry():
    lay = tiers_from_experts([_expert(4), _expert(2), _expert(4), _expert(6)], layer="blk.0")
    assert lay.signature == ((2, 1), (4, 2), (6, 1))
    assert lay.combined_to_global == (1, 0, 2, 3)

    odd = [_expert(4), _expert(2), _expert(4, I=384)]
    with pytest.raises(TierError, match=r"blk\.0: geometry mismatch in tier K=4: expert 2 gate_proj trellis"):
        tiers_from_experts(odd, layer="blk.0")
    across = [_expert(4), _expert(2, I=384)]
    with pytest.raises(TierError, match="geometry mismatch between tiers"):
        tiers_from_experts(across, layer="blk.0")
    mixed = [_expert(4), dict(_expert(4), down_proj=_trellis(256, 128, 5))]
    with pytest.raises(TierError, match=r"expert 1 mixes bitrates across projections"):
        tiers_from_experts(mixed, layer="blk.0")
    bad_width = [_expert(4), dict(_expert(4), up_proj=torch.zeros(8, 16, 33, dtype=torch.int16))]
    with pytest.raises(TierError, match=r"expert 1 up_proj trellis.*33"):
        tiers_from_experts(bad_width, layer="blk.0")


def test_check_geometry_rejects_width_that_disagrees_with_declared_k():
    lay = tiers_from_bitrates([3, 4])
    with pytest.raises(TierError, match=r"expert 1 down_proj trellis width 48 does not encode the tier's K=4"):
        lay.check_geometry({"down_proj": [(16, 8, 48), (16, 8, 48)]})
    assert lay.check_geometry({"down_proj": [(16, 8, 48), (16, 8, 64)]}) == {"down_proj": (16, 8)}


def test_tiers_from_encoded_linears_with_half_integer_bitrates():
    def enc(k, cb):
        tr = _trellis(128, 128, k)
        return EncodedLinear(trellis=tr, suh=torch.ones(128, dtype=torch.float16),
                             svh=torch.ones(128, dtype=torch.float16), codebook=cb)

    experts = [{p: enc(k, "mul1") for p in ("up_proj", "down_proj")} for k in (3.5, 2.5, 3.5, 2)]
    lay = tiers_from_experts(experts)
    assert lay.signature == ((2, 1), (2.5, 1), (3.5, 2)) and lay.codebooks == ("mul1",) * 3
    clash = [{"up_proj": enc(3, "mcg")}, {"up_proj": enc(3, "mul1")}]
    with pytest.raises(TierError, match=r"expert 1 uses codebook 'mul1' but tier K=3 uses 'mcg'"):
        tiers_from_experts(clash)
