"""The load generator (loadtest/load.py): seeded workloads, open-loop arrivals, and its report."""

import statistics

from loadtest import load


def test_arrivals_are_seeded_and_poisson_at_the_offered_rate():
    a = list(load.arrivals(50.0, 4000, seed=3))
    assert a == list(load.arrivals(50.0, 4000, seed=3))
    gaps = [b - x for x, b in zip([0.0] + a, a)]
    assert abs(statistics.mean(gaps) - 1 / 50) < 0.002
    assert abs(statistics.pstdev(gaps) - 1 / 50) < 0.003  # exponential: the spread equals the mean


def test_shared_prefix_interleaves_groups_whose_prompts_share_the_system_prompt():
    turns = load.shared_prefix(groups=3, prompts_per_group=4, system_tokens=10, question_tokens=2, output_tokens=5)
    systems = {t.messages[0]["content"] for t in turns}
    assert len(turns) == 12 and len(systems) == 3
    assert all(len(s) == 40 for s in systems)  # 10 tokens of 4 bytes
    assert {t.messages[0]["content"] for t in turns[:3]} == systems  # each round visits every group


def test_a_multi_turn_conversation_resends_its_history():
    turns = load.multi_turn(conversations=2, turns=3, system_tokens=4, user_tokens=2, output_tokens=3, think_s=0.5)
    first = [t for t in turns if t.conversation == 0]
    assert [len(t.messages) for t in first] == [2, 4, 6]
    for earlier, later in zip(first, first[1:]):
        assert later.messages[:len(earlier.messages)] == earlier.messages
        assert later.messages[len(earlier.messages)]["role"] == "assistant"
    assert all(t.think_s == 0.5 for t in turns)


def test_an_open_loop_run_through_a_router_reports_latencies_hit_rate_and_shares(cluster):
    sims = [cluster.sim("--engine", "--block-size", "16", "--step-base-ms", "2") for _ in range(2)]
    rt = cluster.router(sims)
    args = load.parser().parse_args(["--target", rt.url, "--replicas", ",".join(s.url for s in sims),
                                     "--rates", "20,40", "--requests", "40", "--groups", "4",
                                     "--prompts-per-group", "10", "--system-tokens", "64", "--question-tokens", "8",
                                     "--output-tokens", "4"])
    out = load.asyncio.run(load.run(args))
    rows = out["rows"]
    assert [r["offered_rate"] for r in rows] == [20.0, 40.0]
    for r in rows:
        assert r["requests"] == 40 and r["errors"] == 0
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p90_ms"] <= r["ttft_p99_ms"]
        assert 0 < r["hit_rate"] < 1 and sum(r["share"].values()) == 40 and len(r["share"]) == 2
    assert "| 20 req/s |" in out["markdown"]


def test_several_targets_take_turns(cluster):
    sims = [cluster.sim("--engine", "--block-size", "16", "--step-base-ms", "1") for _ in range(2)]
    urls = ",".join(s.url for s in sims)
    args = load.parser().parse_args(["--target", urls, "--replicas", urls, "--rates", "50", "--requests", "10",
                                     "--groups", "2", "--prompts-per-group", "5", "--system-tokens", "32",
                                     "--question-tokens", "4", "--output-tokens", "2"])
    row = load.asyncio.run(load.run(args))["rows"][0]
    assert row["errors"] == 0 and sorted(row["share"].values()) == [5, 5]


def test_the_tiny_model_vocabulary_makes_one_token_per_word(tmp_path):
    from loadtest.tiny_model import write_tokenizer
    from router.tokenizer import LocalTokenizer
    tok = LocalTokenizer(write_tokenizer(tmp_path / "tiny"))
    text = load.words(load.random.Random(3), 300, load.VOCABULARIES["tiny-model"])
    assert len(tok.encode(text)) in (300, 301)  # and the beginning-of-sequence token, if the tokenizer adds it


def test_pinned_sends_each_group_to_the_target_its_number_names(cluster):
    sims = [cluster.sim("--engine", "--block-size", "16", "--step-base-ms", "1") for _ in range(2)]
    urls = ",".join(s.url for s in sims)
    args = load.parser().parse_args(["--target", urls, "--replicas", urls, "--pin", "--rates", "50",
                                     "--groups", "3", "--prompts-per-group", "5", "--system-tokens", "32",
                                     "--question-tokens", "4", "--output-tokens", "2"])
    row = load.asyncio.run(load.run(args))["rows"][0]
    # groups 0 and 2 on the first replica, group 1 on the second; in turn it would be 8 and 7
    served = [row["share"][s.url.split("//")[-1]] for s in sims]
    assert row["errors"] == 0 and served == [10, 5]
