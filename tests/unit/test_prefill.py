"""A replica's prefill speed, learned from what its counters moved by between scrapes."""

import random

import pytest

from router.replicas.prefill import PrefillEstimate


def feed(est, samples, fixed_s=0.015, per_token_s=100e-6):
    """Samples of a replica whose step takes fixed_s plus per_token_s per prompt token, one request a step."""
    for requests, tokens_each in samples:
        est.add(requests, requests * tokens_each, requests * (fixed_s + tokens_each * per_token_s))


def test_the_fit_tells_a_steps_fixed_part_from_what_each_token_adds():
    est = PrefillEstimate()
    rng = random.Random(1)
    feed(est, [(rng.randint(4, 20), rng.choice([64, 300, 2048])) for _ in range(12)])
    assert est.marginal_s == pytest.approx(100e-6, rel=0.01)
    assert est.fixed_s == pytest.approx(0.015, rel=0.01)


def test_samples_all_alike_do_not_tell_the_parts_apart():
    est = PrefillEstimate()
    feed(est, [(8, 1000)] * 10)
    assert est.rate == pytest.approx(1000 / (0.015 + 0.1))
    assert est.marginal_s is None


def test_a_sample_with_too_little_in_it_is_not_taken():
    est = PrefillEstimate()
    assert not est.add(requests=2, uncached=5000, seconds=1.0)
    assert not est.add(requests=10, uncached=100, seconds=1.0)
    assert (est.rate, est.samples) == (None, 0)


def test_the_rate_is_a_running_average_of_the_samples():
    est = PrefillEstimate()
    est.add(4, 1000, 1.0)
    est.add(4, 2000, 1.0)
    assert est.rate == pytest.approx(0.7 * 1000 + 0.3 * 2000)


def test_without_a_fixed_part_every_second_is_the_tokens():
    est = PrefillEstimate()
    feed(est, [(4, 600), (10, 2000), (6, 64), (8, 900)], fixed_s=0.0)
    assert est.fixed_s == pytest.approx(0.0, abs=1e-9)
    assert est.marginal_s == pytest.approx(100e-6, rel=0.01)
