"""Where a replica publishes its KV-cache events: its /kv_event_sources answer, or the configuration."""

import json

import pytest

from router.config import ReplicaConfig
from router.kv_events.sources import NoSource, from_answer, from_config
from router.kv_events.subscriber import Endpoints
from support.paths import FIXTURES

FIXTURE = FIXTURES / "vllm-0.32" / "kv_event_sources.json"


def test_the_captured_answer_gives_the_replicas_host_for_a_star():
    answer = json.loads(FIXTURE.read_text())
    assert from_answer(answer, "http://10.0.0.7:8000") == [Endpoints("tcp://10.0.0.7:5591", None, 0)]


def test_data_parallel_ranks_with_one_setting_publish_on_consecutive_ports():
    one = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
           "replay_endpoint": "tcp://*:5600"}
    got = from_answer({"0": one, "1": one}, "http://gpu-3:8000")
    assert got == [Endpoints("tcp://gpu-3:5557", "tcp://gpu-3:5600", 0), Endpoints("tcp://gpu-3:5558", "tcp://gpu-3:5601", 1)]


def test_an_ipv6_replica_host_is_bracketed():
    answer = {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557"}}
    assert from_answer(answer, "http://[fd00::5]:8000")[0].live == "tcp://[fd00::5]:5557"


@pytest.mark.parametrize("setting, why", [
    ({"enable_kv_cache_events": False, "publisher": "zmq", "endpoint": "tcp://*:5557"}, "events are off"),
    ({"enable_kv_cache_events": True, "publisher": "null", "endpoint": "tcp://*:5557"}, "not zmq"),
    ({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://10.1.1.1:5557"}, "connects out"),
])
def test_a_source_the_router_cannot_subscribe_to_says_why(setting, why):
    with pytest.raises(NoSource, match=why):
        from_answer({"0": setting}, "http://r:8000")


def test_an_empty_answer_lists_no_publisher():
    with pytest.raises(NoSource, match="lists no publisher"):
        from_answer({}, "http://r:8000")


def test_configured_endpoints_win_and_ranks_add_to_both_ports():
    cfg = ReplicaConfig(url="http://node-2:8000", kv_events="tcp://*:6000", kv_events_replay="tcp://*:6100",
                        data_parallel_size=2)
    assert from_config(cfg) == [Endpoints("tcp://node-2:6000", "tcp://node-2:6100", 0),
                                Endpoints("tcp://node-2:6001", "tcp://node-2:6101", 1)]


def test_a_configured_endpoint_must_be_tcp_or_ipc():
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        ReplicaConfig(url="http://r:8000", kv_events="http://r:5557")
