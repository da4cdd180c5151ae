"""``leave_together``: the exit barrier every worker passes after its last step."""

from __future__ import annotations

import pytest

from towers.cluster import free_ports, leave_together, resolve


def _jobs() -> dict[str, list[str]]:
    """Two local workers on ports of their own (the barrier's folder is named after them)."""
    return {"worker": [f"127.0.0.1:{p}" for p in free_ports(2)]}


def test_a_worker_waits_for_the_others_and_then_leaves() -> None:
    jobs = _jobs()
    first = resolve(jobs, "worker", 0)
    # alone, worker 0 waits out its limit and says the peer never came
    assert leave_together(first, limit=0.2) is False
    # worker 1 then finds worker 0's mark and leaves at once
    assert leave_together(resolve(jobs, "worker", 1), limit=5.0) is True
    assert leave_together(first, limit=5.0) is True


@pytest.mark.parametrize("limit", [0, -1.0])
def test_the_limit_must_be_positive(limit: float) -> None:
    jobs = _jobs()
    with pytest.raises(ValueError, match="limit"):
        leave_together(resolve(jobs, "worker", 0), limit=limit)


def test_a_client_outside_the_cluster_is_refused() -> None:
    jobs = _jobs()
    with pytest.raises(ValueError, match="leave_together"):
        leave_together(resolve(jobs), limit=1.0)
