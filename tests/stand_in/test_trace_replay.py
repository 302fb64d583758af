"""Replaying Mooncake's conversation trace (loadtest/trace.py): prompts that share what the trace says they share,
its arrival pattern scaled to a rate, and the ideal hit rate a router's is measured against."""

import pytest

from loadtest import load, trace


@pytest.fixture(scope="module")
def entries():
    return trace.read()


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from loadtest.tiny_model import write_tokenizer
    from router.tokenizer import LocalTokenizer
    return LocalTokenizer(write_tokenizer(tmp_path_factory.mktemp("tiny")))


def test_the_bundled_trace_is_the_hour_of_12031_requests(entries):
    assert len(entries) == 12031
    assert entries[0].at_s == 0 and 3530 < entries[-1].at_s < 3540
    assert all(len(e.hash_ids) == -(-e.input_tokens // trace.TRACE_BLOCK) for e in entries)


def test_sampling_keeps_whole_conversations(entries):
    kept = trace.sample(entries, 10)
    conversations = {e.conversation for e in kept if e.conversation >= 0}
    assert 0.05 < len(kept) / len(entries) < 0.15
    assert all(e in kept for e in entries if e.conversation in conversations)
    assert trace.sample(entries, 10, limit=50) == kept[:50]


def test_replayed_prompts_have_the_traced_length_in_tokens(entries, tok):
    texts = trace.Texts(load.VOCABULARIES["tiny-model"])
    for e in entries[:20]:
        assert len(tok.encode(texts.prompt(e), add_special_tokens=False)) == e.input_tokens


def test_replayed_prompts_share_exactly_their_common_blocks(entries):
    texts = trace.Texts(load.VOCABULARIES["tiny-model"])
    by = {}
    for e in trace.sample(entries, 10):
        if e.conversation >= 0:
            by.setdefault(e.conversation, []).append(e)
    a, b = next(v[:2] for v in by.values() if len(v) > 1 and len(v[0].hash_ids) > 2)
    common = next(i for i, (x, y) in enumerate(zip(a.hash_ids + (None,), b.hash_ids + (None,))) if x != y)
    pa, pb = texts.prompt(a), texts.prompt(b)
    shared = len(next(p for p in [pa[:i] for i in range(len(pa), -1, -1)] if pb.startswith(p)))
    # every word is a space and three to eight letters: the common blocks' words, and no whole word beyond
    assert pa[:shared].count(" ") in range(min(a.input_tokens, common * trace.TRACE_BLOCK),
                                            min(a.input_tokens, common * trace.TRACE_BLOCK) + 2)


def test_a_turn_resends_the_one_before_it_whole_including_its_partial_last_block(entries, tok):
    texts = trace.Texts(load.VOCABULARIES["tiny-model"])
    nxt: dict = {}
    pairs = []
    for e in reversed(entries):  # each turn with the next one of its conversation
        if e.conversation >= 0:
            if e.conversation in nxt:
                pairs.append((e, nxt[e.conversation]))
            nxt[e.conversation] = e
    extended = [(a, b) for a, b in pairs if a.input_tokens % trace.TRACE_BLOCK
                and b.hash_ids[:a.input_tokens // trace.TRACE_BLOCK] == a.hash_ids[:a.input_tokens // trace.TRACE_BLOCK]
                and len(b.hash_ids) > len(a.hash_ids) - 1]
    assert len(extended) > 3000  # as read from the file, 3,825 of them showed another id at the partial block
    carried = [(a, b) for a, b in extended if b.hash_ids[len(a.hash_ids) - 1] == a.hash_ids[-1]]
    assert len(carried) == len(extended)
    a, b = carried[0]
    assert texts.prompt(b).startswith(texts.prompt(a))


def test_a_partial_block_no_later_turn_resends_keeps_its_own_id():
    first = trace.Entry(0.0, 1200, 10, (7, 8, 9))     # two whole blocks and a partial one
    branch = trace.Entry(1.0, 1600, 10, (7, 5, 6, 4))  # the same system block, then another conversation
    assert trace.resent([first, branch]) == [first, branch]
    turn = trace.Entry(2.0, 2000, 10, (7, 8, 11, 12))  # holds both whole blocks of the first, goes on past them
    assert trace.resent([first, turn])[0].hash_ids == (7, 8, 11)


def test_trace_arrivals_keep_their_order_and_bursts_at_the_offered_rate():
    turns = [load.Turn([], 1, at_s=t) for t in (0.0, 0.0, 0.0, 3.0, 6.0, 6.0, 9.0)]
    at = list(load.arrivals(2.0, len(turns), 0, turns))
    assert at == sorted(at) and at[0] == at[1] == at[2] == 0 and at[4] == at[5]
    assert at[-1] == pytest.approx(len(turns) / 2.0)  # seven requests at 2 per second span 3.5 s


def test_the_ideal_hit_rate_counts_whole_cached_blocks_and_computes_the_last_token():
    a = list(range(10))            # 2 whole blocks of 4 and 2 tokens
    b = list(range(8)) + [50, 51]  # its first 2 blocks are a's
    c = list(range(8))             # all cached, but its last token is computed: 1 block hit
    assert trace.ideal_hit_rate([a, b, c], capacity_blocks=100, block_size=4) == pytest.approx((0 + 8 + 4) / 28)


def test_the_ideal_hit_rate_forgets_least_recently_used_blocks():
    a, b = list(range(9)), list(range(100, 109))
    # capacity 2: b's blocks evict a's, so a's second visit finds nothing
    assert trace.ideal_hit_rate([a, b, a], capacity_blocks=2, block_size=4) == 0.0
    assert trace.ideal_hit_rate([a, b, a], capacity_blocks=4, block_size=4) == pytest.approx(8 / 27)


def test_the_trace_verdicts_measure_kvroute_against_the_ideal_hit_rate_and_the_best_other_router():
    from loadtest.cluster_bench import trace_verdicts

    def run(name, hit, tok_s, p90):
        return {"router": name, "rows": [{"load_fraction": 1.0, "hit_rate": hit, "output_tokens_per_s": tok_s,
                                          "ttft_p90_ms": p90}]}
    lines = trace_verdicts([run("kvroute", 0.38, 1450, 2600), run("sglang-router", 0.36, 1400, 5000),
                            run("vllm-router", 0.35, 1380, 4900), {**run("pinned", 0.37, 1200, 9000), "pinned": True}],
                           ideal=0.4)
    assert len(lines) == 1
    assert "keeps 0.95 of the ideal hit rate" in lines[0] and "target >= 0.95: met" in lines[0]
    assert "1.036x the best other router's (sglang-router; target >= 1, 0.5% allowed for noise: met)" in lines[0]
    assert "TTFT p90 0.53x the best other router's (vllm-router; target < 1: met)" in lines[0]
    short = trace_verdicts([run("kvroute", 0.3, 1300, 2600), run("sglang-router", 0.36, 1400, 5000)], ideal=0.4)
    assert "0.75 of the ideal" in short[0] and short[0].count("NOT met") == 2
    # the same offered load served within the noise of a run counts as equal; a real shortfall does not
    level = trace_verdicts([run("kvroute", 0.38, 1397, 2600), run("sglang-router", 0.36, 1400, 5000)], ideal=0.4)
    assert "0.998x the best other router's (sglang-router; target >= 1, 0.5% allowed for noise: met)" in level[0]
    below = trace_verdicts([run("kvroute", 0.38, 1386, 2600), run("sglang-router", 0.36, 1400, 5000)], ideal=0.4)
    assert "0.990x the best other router's (sglang-router; target >= 1, 0.5% allowed for noise: NOT met)" in below[0]
