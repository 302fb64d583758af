"""The line a replica's times to first token follow (router.replicas.timing): measured = fixed + slope x the
model's prefill, fitted for the least relative error."""

import random

from router.config import PredictionConfig
from router.replicas.timing import TimingEstimate

CFG = PredictionConfig(min_samples=10)
RATE = 10_000.0  # prompt tokens per second, as the model prices them


def fed(samples):
    t = TimingEstimate()
    for model_s, measured_s in samples:
        t.add_ttft(model_s, measured_s, measured_s, RATE, CFG)
    return t


def slope(fit):
    return fit[1] * RATE


def test_the_line_recovers_a_fixed_part_and_a_slope():
    rng = random.Random(1)
    xs = [rng.choice([0.001, 0.2]) for _ in range(100)]  # hits and misses
    fixed, per_token = fed([(x, 0.03 + 1.5 * x) for x in xs]).ttft_fit(CFG, RATE)
    assert abs(fixed - 0.03) < 1e-3 and abs(per_token * RATE - 1.5) < 0.01


def test_answers_alike_keep_the_slope_at_one_and_the_fixed_part_takes_the_difference():
    fit = fed([(0.005, 0.2)] * 30).ttft_fit(CFG, RATE)
    assert slope(fit) == 1.0 and abs(fit[0] - 0.195) < 1e-6


def test_a_prefill_the_replica_does_not_take_keeps_the_fixed_part_every_answer_showed():
    rng = random.Random(2)  # the model prices queued prefill of up to 3 s; the answers take 25-30 ms whatever it says
    fit = fed([(rng.uniform(0, 3.0), rng.uniform(0.025, 0.03)) for _ in range(100)]).ttft_fit(CFG, RATE)
    assert 0.02 < fit[0] + slope(fit) * 0.001 < 0.035  # a hit is predicted about as it came


def test_no_line_before_min_samples_or_with_correction_off():
    t = fed([(0.01, 0.05)] * 9)
    assert t.ttft_fit(CFG, RATE) is None
    t = fed([(0.01, 0.05)] * 30)
    assert t.ttft_fit(PredictionConfig(correct=False), RATE) is None


def test_the_line_is_in_tokens_so_a_prefill_rate_learned_later_does_not_bend_it():
    t = TimingEstimate()
    for i in range(40):  # the same prompts (1,000 uncached tokens) taking 0.1 s, priced at a guess, then as learned
        rate = 200.0 if i < 20 else 10_000.0
        t.add_ttft(1000 / rate, 0.1, 0.1, rate, CFG)
    fixed, per_token = t.ttft_fit(CFG, 10_000.0)
    assert abs(fixed + per_token * 1000 - 0.1) < 1e-6
