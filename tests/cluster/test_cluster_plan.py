"""What `kvfork cluster` decides before it starts anything: ports, one model, the KV budget split, a disk tier
folder per replica, smg's command line; and the flags it refuses. No process starts here (test_cluster.py
runs a real one)."""

from __future__ import annotations

import os
import sys

import pytest

from kvfork.server.generate.isolated import module_command
from kvfork.tools import cluster


def test_the_plan_splits_one_budget_and_gives_each_replica_its_port_and_folder(tiny_model_dir, kvfork_home,
                                                                             monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    model = tiny_model_dir("llama")
    p = cluster.plan(["--replicas", "3", "--port", "9000", "--model", model, "--kv-budget-bytes", "3000000",
                      "--inference-slots", "2"])
    assert p.gateway_url == "http://127.0.0.1:9000" and p.metrics_port == 9004
    assert [p.replica_url(i) for i in range(3)] == ["http://127.0.0.1:9001", "http://127.0.0.1:9002",
                                                    "http://127.0.0.1:9003"]
    for i, argv in enumerate(p.replicas):
        command = module_command("kvfork.server")
        assert argv[:len(command)] == command
        flags = dict(zip(argv[len(command)::2], argv[len(command) + 1::2]))
        assert flags == {"--inference-slots": "2", "--model": model, "--kv-budget-bytes": "1000000",
                         "--host": "127.0.0.1", "--port": str(9001 + i)}
    assert p.homes == [kvfork_home / "cluster" / f"replica-{i}" for i in (1, 2, 3)]
    assert p.replica_env == {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // 3))}  # a share of the cores
    gateway = p.gateway
    assert gateway[:1] == ["launch"]  # smg's argv, sent on its stdin (cluster.SMG_LAUNCH)
    assert gateway[gateway.index("--worker-urls") + 1:gateway.index("--worker-urls") + 4] == [
        p.replica_url(i) for i in range(3)]
    for flag, value in (("--host", "127.0.0.1"), ("--port", "9000"), ("--policy", "cache_aware"),
                        ("--prometheus-host", "127.0.0.1"), ("--prometheus-port", "9004")):
        assert gateway[gateway.index(flag) + 1] == value
    assert "--sticky-sessions" in gateway and gateway[gateway.index("--assignment-mode") + 1] == "min_group"


def test_policy_and_sticky_sessions_are_the_cluster_flags(tiny_model_dir):
    p = cluster.plan(["--model", tiny_model_dir("llama"), "--policy", "round_robin", "--no-sticky-sessions"])
    assert p.gateway[p.gateway.index("--policy") + 1] == "round_robin" and "--sticky-sessions" not in p.gateway
    assert "--assignment-mode" not in p.gateway
    assert "--policy" not in p.replicas[0]


@pytest.mark.parametrize("argv, says", [
    (["--replicas", "0"], "--replicas"),
    (["--host", "0.0.0.0"], "--host"),
    (["--inference-slots", "0"], "--inference-slots"),
    (["--no-such-flag"], "--no-such-flag"),
    (["--port", "65535"], "ports"),
])
def test_bad_flags_exit_2_before_anything_starts(tiny_model_dir, capsys, argv, says):
    with pytest.raises(SystemExit) as exit_:
        cluster.plan(["--model", tiny_model_dir("llama"), *argv])
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err


def test_without_smg_it_says_how_to_install_it(tiny_model_dir, monkeypatch, capsys):
    monkeypatch.setattr(cluster.importlib.util, "find_spec", lambda name: None)
    assert cluster.main(["--model", tiny_model_dir("llama")]) == 1
    assert "pip install smg" in capsys.readouterr().err


def test_each_replica_publishes_kv_events_on_ports_of_its_own(tiny_model_dir):
    p = cluster.plan(["--model", tiny_model_dir("llama"), "--kv-events-endpoint", "tcp://127.0.0.1:5557"])
    sockets = [(argv[argv.index("--kv-events-endpoint") + 1], argv[argv.index("--kv-events-replay-endpoint") + 1])
               for argv in p.replicas]
    assert sockets == [("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"), ("tcp://127.0.0.1:5559", "tcp://127.0.0.1:5560")]
    assert all(argv.count("--kv-events-endpoint") == 1 for argv in p.replicas)



def test_kv_events_beyond_loopback_are_refused_as_host_is(tiny_model_dir, capsys):
    for endpoint in ("tcp://0.0.0.0:5557", "tcp://10.1.2.3:5557"):
        with pytest.raises(SystemExit):
            cluster.plan(["--model", tiny_model_dir("llama"), "--kv-events-endpoint", endpoint])
        assert "loopback" in capsys.readouterr().err


def test_smgs_control_plane_is_keyed_and_no_command_line_holds_the_key(tiny_model_dir):
    p = cluster.plan(["--model", tiny_model_dir("llama")])
    other = cluster.plan(["--model", tiny_model_dir("llama")])
    assert len(p.control_key) >= 32 and p.control_key != other.control_key  # made for each run
    argv = p.gateway_argv()
    assert argv[argv.index("--control-plane-api-keys") + 1].endswith(":admin:" + p.control_key)
    assert not any(p.control_key in arg for arg in [*p.gateway, *cluster.SMG_LAUNCH.split(), *sum(p.replicas, [])])
    # every child imports only kvfork's code: isolated mode, kvfork's folder by its absolute path
    for replica in p.replicas:
        assert replica[:2] == [sys.executable, "-I"] and os.path.isabs(replica[4])


def test_keys_reach_the_replicas_in_their_environment_never_on_a_command_line(tiny_model_dir, capsys):
    p = cluster.plan(["--replicas", "2", "--model", tiny_model_dir("llama"), "--api-key", "k-one", "--api-key=k-two",
                      "--metrics-key", "m-key"])
    for argv in [*p.replicas, p.gateway]:
        assert not [arg for arg in argv if any(k in arg for k in ("k-one", "k-two", "m-key"))]
        assert "--api-key" not in argv and "--metrics-key" not in argv
    assert p.replica_env["KVFORK_API_KEY"] == "k-one,k-two" and p.replica_env["KVFORK_METRICS_KEY"] == "m-key"
    # given on the cluster's own command line, they work, with a warning that every local user can read them
    assert "--api-key is on the command line" in capsys.readouterr().err


def test_without_a_budget_each_replica_gets_its_share_of_what_the_weights_leave(tiny_model_dir):
    from kvfork.backends.device_memory import weights_on_disk
    from kvfork.server.engine.policy.memory_plan import shared_host_plan

    model = tiny_model_dir("llama")
    p = cluster.plan(["--replicas", "2", "--model", model])
    budget = int(p.replicas[0][p.replicas[0].index("--kv-budget-bytes") + 1])
    assert budget == shared_host_plan(weights_on_disk(model), 2).kv_budget_bytes > 0
    assert budget < shared_host_plan(weights_on_disk(model), 1).kv_budget_bytes / 2 + 1
