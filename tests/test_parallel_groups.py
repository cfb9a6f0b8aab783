"""Process groups (``moeflow.parallel.groups.make_groups``) on 4 gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moeflow.parallel import make_groups

from helpers import spawn_ranks

pytestmark = pytest.mark.distributed


def _case_groups(rank: int, world: int) -> None:
    groups = make_groups(2)
    assert groups.expert_size == 2 and groups.data_size == world // 2
    members = [torch.zeros(1, dtype=torch.long) for _ in range(2)]
    dist.all_gather(members, torch.tensor([rank]), group=groups.expert)
    assert [int(m) for m in members] == [rank - rank % 2, rank - rank % 2 + 1]
    data = [torch.zeros(1, dtype=torch.long) for _ in range(world // 2)]
    dist.all_gather(data, torch.tensor([rank]), group=groups.data)
    assert [int(m) for m in data] == list(range(rank % 2, world, 2))
    with pytest.raises(ValueError, match="expert_size"):
        make_groups(3)


CASES = {  # looked up by the spawned ranks
    "groups": _case_groups,
}


def test_make_groups_on_4_ranks():
    spawn_ranks(4, __name__, "groups")
