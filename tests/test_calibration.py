"""The simulated engine's ``cpu`` profile against this machine's real vLLM CPU replicas, on one workload."""

import pytest

from loadtest import calibrate

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]


def test_the_cpu_profile_reproduces_real_vllms_prefix_cache_hit_rate_on_the_same_workload(tmp_path):
    res = calibrate.check(tmp_path, runs=1)
    real, sim = res["real vLLM"], res["simulated cpu profile"]
    assert abs(real["hit_rate"] - sim["hit_rate"]) <= 0.02, res
