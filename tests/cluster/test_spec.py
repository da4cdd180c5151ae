"""towers.cluster.spec and .local: a cluster, its chief and its tower names (no processes)."""

from __future__ import annotations

import json
import socket

import pytest
import tensorflow as tf

from towers.cluster import TOWERS_ENV, Cluster, free_ports, local_cluster, resolve, tf_config
from towers.cluster.spec import towers_per_task

JOBS = {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"], "ps": ["127.0.0.1:2224"]}


def test_tf_config_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": JOBS,
                                                "task": {"type": "worker", "index": 1}}))
    c = resolve()
    assert (c.task_type, c.task_index) == ("worker", 1)
    assert c.jobs["worker"] == ("127.0.0.1:2222", "127.0.0.1:2223")
    assert c.chief == ("worker", 0) and not c.is_chief
    assert c.num_workers == 2
    assert c.task_name() == "/job:worker/replica:0/task:1"


def test_every_description_gives_the_same_cluster() -> None:
    spec = tf.train.ClusterSpec(JOBS)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        spec, task_type="worker", task_id=1)
    config = {"cluster": JOBS, "task": {"type": "worker", "index": 1}}
    expected = Cluster({k: tuple(v) for k, v in JOBS.items()}, "worker", 1)
    assert resolve(json.dumps(config)) == expected
    assert resolve(config) == expected
    assert resolve(JOBS, "worker", 1) == expected
    assert resolve(spec, "worker", 1) == expected
    assert resolve(resolver) == expected
    assert resolve(expected) == expected
    assert resolve(JOBS).task_type is None  # a client: no task
    assert resolve(tf_config(expected, "worker", 1)) == expected


def test_chief_job_wins_over_worker_0() -> None:
    c = resolve({"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}, "chief", 0)
    assert c.chief == ("chief", 0) and c.is_chief and c.num_workers == 2
    assert resolve(JOBS, "worker", 0).is_chief


def test_tower_devices_task_major() -> None:
    c = resolve(JOBS)
    assert c.tower_devices(2) == [
        "/job:worker/replica:0/task:0/device:CPU:0",
        "/job:worker/replica:0/task:0/device:CPU:1",
        "/job:worker/replica:0/task:1/device:CPU:0",
        "/job:worker/replica:0/task:1/device:CPU:1",
    ]
    assert c.tower_devices(1, job="ps") == ["/job:ps/replica:0/task:0/device:CPU:0"]
    with pytest.raises(ValueError, match="towers_per_task"):
        c.tower_devices(0)
    with pytest.raises(ValueError, match="job 'chief' is not in the cluster"):
        c.tower_devices(1, job="chief")


@pytest.mark.parametrize(("config", "message"), [
    ("{not json", "TF_CONFIG is not valid JSON"),
    ('["worker"]', "TF_CONFIG must be a JSON object"),
    ('{"task": {"type": "worker", "index": 0}}', "TF_CONFIG has no 'cluster'"),
    ('{"cluster": {"worker": "127.0.0.1:1"}}', r"TF_CONFIG\['cluster'\]\['worker'\] must be"),
    ('{"cluster": {"worker": ["nohost"]}}', "'nohost' is not 'host:port'"),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 3}}',
     r"TF_CONFIG\['task'\]: task index 3 is out of range: job 'worker' has 1 task"),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "chief", "index": 0}}',
     r"TF_CONFIG\['task'\]: task type 'chief' is not a job of the cluster; jobs: worker"),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": "0"}}',
     "task index must be an int"),
])
def test_malformed_tf_config_names_the_problem(
    monkeypatch: pytest.MonkeyPatch, config: str, message: str
) -> None:
    monkeypatch.setenv("TF_CONFIG", config)
    with pytest.raises(ValueError, match=message):
        resolve()


def test_missing_tf_config_and_bad_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match="TF_CONFIG is not set"):
        resolve()
    with pytest.raises(TypeError, match="got int"):
        resolve(3)
    with pytest.raises(ValueError, match="cluster must map job names"):
        resolve({})
    with pytest.raises(ValueError, match="task index 2 is out of range"):
        resolve(JOBS, "worker", 2)
    with pytest.raises(ValueError, match="a client"):
        resolve(JOBS).task_name()


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = free_ports(5)
    assert len(set(ports)) == 5
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    c = local_cluster(3, ps=1, chief=True)
    assert [len(c.jobs[j]) for j in ("chief", "worker", "ps")] == [1, 3, 1]
    assert all(a.startswith("127.0.0.1:") for a in sum(c.jobs.values(), ()))
    with pytest.raises(ValueError, match="workers must be an int >= 1"):
        local_cluster(0)


def test_towers_per_task_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOWERS_ENV, raising=False)
    assert towers_per_task(default=3) == 3
    monkeypatch.setenv(TOWERS_ENV, "4")
    assert towers_per_task() == 4
    monkeypatch.setenv(TOWERS_ENV, "zero")
    with pytest.raises(ValueError, match=f"{TOWERS_ENV} must be a positive integer"):
        towers_per_task()
