"""exl3rt.kernels.routing: route packing against a brute-force Python packer."""

from __future__ import annotations

import random

import pytest
import torch

from exl3rt.moe import NO_EXPERT, RoutePack, max_route_blocks, pack_routes, route_capacity


def brute_force(ids: list[list[int]], E: int, b: int, cap: int, expert_map=None):
    """Per expert (ascending), its routes in flat order, padded with numel to a multiple of b."""
    flat = [e for row in ids for e in row]
    numel = len(flat)
    if expert_map is not None:
        flat = [expert_map[e] if 0 <= e < len(expert_map) else -1 for e in flat]
    routes, blocks, counts = [], [], []
    for e in range(E):
        mine = [r for r, x in enumerate(flat) if x == e]
        counts.append(len(mine))
        while len(mine) % b:
            mine.append(numel)
        routes += mine
        blocks += [e] * (len(mine) // b)
    n_padded = len(routes)
    assert n_padded <= cap
    return (routes + [numel] * (cap - n_padded), blocks + [NO_EXPERT] * (cap // b - len(blocks)), n_padded, counts)


def check(ids: torch.Tensor, E: int, b: int, *, expert_map=None, out=None, cap_numel=None):
    emap = None if expert_map is None else torch.tensor(expert_map, dtype=torch.int32)
    pack = pack_routes(ids, E, b, expert_map=emap, out=out)
    cap = route_capacity(cap_numel if cap_numel is not None else max(ids.numel(), 1), E, b)
    want = brute_force(ids.tolist(), E, b, cap, expert_map)
    assert pack.sorted_routes.dtype == torch.int32 and pack.block_experts.dtype == torch.int32
    assert pack.sorted_routes.tolist() == want[0]
    assert pack.block_experts.tolist() == want[1]
    assert pack.num_padded.tolist() == [want[2]]
    assert pack.expert_counts.tolist() == want[3]
    assert int(pack.num_blocks()) * b == want[2]
    return pack


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("seed", range(12))
def test_random_routes_match_brute_force(seed, dtype):
    rng = random.Random(seed)
    E = rng.choice([1, 3, 8, 17])
    k = rng.randint(1, min(E, 4))
    T = rng.choice([1, 2, 7, 33])
    b = rng.choice([1, 2, 8, 16])
    used = rng.sample(range(E), rng.randint(1, E))  # some experts get no routes at all
    ids = torch.tensor([rng.sample(used, min(k, len(used))) + [used[0]] * (k - min(k, len(used)))
                        for _ in range(T)], dtype=dtype)
    check(ids, E, b)


@pytest.mark.parametrize("b", [1, 8, 64])
def test_all_routes_to_one_expert_and_single_token(b):
    check(torch.full((9, 2), 5, dtype=torch.int64), 8, b)
    check(torch.tensor([[3, 0, 7]], dtype=torch.int32), 8, b)  # T = 1


def test_expert_map_renames_and_drops_routes():
    # global -> combined (tier order), expert 4 is not local (-1); router id 6 is an expert-parallel sentinel
    expert_map = [2, 0, 3, 1, -1, 4]
    ids = torch.tensor([[0, 4], [3, 6], [5, 0], [1, 2]], dtype=torch.int64)
    pack = check(ids, 5, 2, expert_map=expert_map)
    live = pack.sorted_routes[: int(pack.num_padded)].tolist()
    assert 1 not in live and 3 not in live  # the dropped routes appear nowhere
    assert int(pack.expert_counts.sum()) == 6


def test_preallocated_buffers_have_fixed_sizes_and_are_reused():
    out = RoutePack.allocate(32 * 4, 8, 8)
    ptr = out.sorted_routes.data_ptr()
    shapes = None
    for T in (1, 5, 32):
        ids = torch.randint(0, 8, (T, 4), generator=torch.Generator().manual_seed(T))
        pack = check(ids, 8, 8, out=out, cap_numel=128)
        assert pack is out and pack.sorted_routes.data_ptr() == ptr
        now = (pack.sorted_routes.shape, pack.block_experts.shape, pack.num_padded.shape)
        assert shapes in (None, now)
        shapes = now
    with pytest.raises(ValueError, match=r"buffers are for <= 128 routes.*132 routes"):
        pack_routes(torch.zeros(33, 4, dtype=torch.int64), 8, 8, out=out)


def test_capacity_bound_is_reached_and_never_exceeded():
    # every expert gets exactly one route: the padded length is the bound numel + E·(b−1)
    ids = torch.arange(8).reshape(4, 2)
    assert int(pack_routes(ids, 8, 16).num_padded) == route_capacity(8, 8, 16) == 8 + 8 * 15
    # fewer routes than experts: at most numel experts can be hit
    assert route_capacity(3, 256, 8) == 3 + 3 * 7
    assert max_route_blocks(8, 8, 16) == 8
    rng = random.Random(1)
    for _ in range(50):
        E, b, T, k = rng.randint(1, 20), rng.randint(1, 20), rng.randint(1, 10), 1
        ids = torch.tensor([[rng.randrange(E)] for _ in range(T)])
        assert int(pack_routes(ids, E, b).num_padded) <= route_capacity(T * k, E, b)


def test_rejects_non_integer_ids_and_bad_shapes():
    with pytest.raises(TypeError, match="not int32 or int64"):
        pack_routes(torch.zeros(2, 2), 4, 8)
    with pytest.raises(ValueError, match=r"\[tokens, top_k\]"):
        pack_routes(torch.zeros(4, dtype=torch.int64), 4, 8)
