"""The simulated engine's ``cpu`` profile against this machine's real vLLM CPU replicas, on one workload."""

import pytest

from loadtest import calibrate

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    results, _ = calibrate.check(tmp_path_factory.mktemp("calibration"))
    return results


@pytest.mark.parametrize("profile", ["stored cpu profile", "cpu profile measured in this run"])
def test_the_cpu_profile_reproduces_real_vllms_prefix_cache_hit_rate_on_the_same_workload(compared, profile):
    real, sim = compared["real vLLM"], compared[profile]
    assert abs(real["hit_rate"] - sim["hit_rate"]) <= 0.02, compared


def test_the_cpu_profile_measured_on_this_machine_reproduces_real_vllms_median_time_to_first_token(compared, figure):
    sim = compared["cpu profile measured in this run"]
    figure({name: {k: round(v, 3) for k, v in r.items()} for name, r in compared.items()})
    assert 0.75 <= sim["ttft_p50_vs_real"] <= 1.25, compared  # turn by turn: the machine's speed moves
