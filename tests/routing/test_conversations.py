"""Conversations between turns: which replica should expect which requests back."""

import random
import time

import pytest

from support.processes import FAST
from loadtest.cluster import HTTP
from support.state import wait_keyed_by_tokens
from support.traffic import chat, text
from loadtest.tiny_model import write_tokenizer
from router.conversations import PRIOR_ENDED, Continuation, Conversations


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def chain(*blocks: int) -> list[int]:
    """A prompt's chain of block hashes."""
    return list(blocks)


def come_back(c: Conversations, tail: int, grows: bool = True) -> None:
    """The next prompt holding ``tail`` is routed (``grows``: it goes on for a block past it)."""
    found = c.find([chain(tail, -1) if grows else chain(tail)])
    assert found is not None and found.tail == tail
    c.resume(found)


def test_a_prompt_that_extends_an_answered_one_continues_its_conversation_where_it_was_answered():
    c = Conversations()
    c.answered("a", [3])
    assert c.find([chain(1, 2, 3, 4, 5)]) == Continuation(3, "a", grows=True)


def test_a_prompt_that_shares_only_a_system_prompt_continues_nothing():
    c = Conversations()
    c.answered("a", [3])
    assert c.find([chain(1, 2, 7, 8)]) is None


def test_a_prompt_that_ends_in_the_same_block_continues_without_growing():
    c = Conversations()
    c.answered("a", [3])
    assert c.find([chain(1, 2, 3)]) == Continuation(3, "a", grows=False)


def test_the_deepest_waiting_tail_is_the_one_continued():
    c = Conversations()
    c.answered("a", [3])
    c.answered("b", [5])
    assert c.find([chain(1, 2, 3, 4, 5, 6)]) == Continuation(5, "b", grows=True)


def test_nothing_is_expected_back_until_a_conversation_has_come_back():
    c = Conversations()
    c.answered("a", [3, 13, 23])
    assert c.waiting() == {"a": 3}
    assert c.expected() == {}


def test_requests_expected_back_are_the_waiting_conversations_times_the_share_that_came_back():
    c = Conversations()
    for tail in range(100, 120):  # 20 conversations answered at a, and every one came back
        c.answered("a", [tail])
        come_back(c, tail)
    c.answered("a", [1, 2])
    c.answered("b", [3])
    share = 20 / (20 + PRIOR_ENDED)
    assert c.continued_share() == pytest.approx(share, rel=0.02)
    assert c.expected() == {"a": pytest.approx(2 * share, rel=0.02), "b": pytest.approx(share, rel=0.02)}


def test_a_new_conversation_is_expected_to_send_as_many_more_turns_as_the_share_that_came_back_implies():
    c = Conversations()
    assert c.turns_ahead() == 0  # nothing came back yet
    for tail in range(100, 120):
        c.answered("a", [tail])
        come_back(c, tail)
    share = c.continued_share()
    assert c.turns_ahead() == pytest.approx(share / (1 - share))  # s + s^2 + ...
    assert c.turns_ahead() == pytest.approx(20 / PRIOR_ENDED, rel=0.02)


def test_prompts_that_come_back_without_growing_are_not_counted_as_conversations():
    c = Conversations()
    for _ in range(20):  # a group's prompts: the same last whole block each time, the question after it
        c.answered("a", [3])
        come_back(c, 3, grows=False)
    c.answered("a", [3])
    assert c.continued_share() == 0.0
    assert c.expected() == {}


def waiting_at_a_and_b() -> Conversations:
    """One conversation came back (so some are expected back), one now waits at "a", one at "b"."""
    c = Conversations()
    c.answered("x", [100])
    come_back(c, 100)
    c.answered("a", [1])
    c.answered("b", [2])
    return c


def test_the_asking_request_does_not_count_against_the_replica_its_own_conversation_waits_at():
    assert set(waiting_at_a_and_b().expected(own="a")) == {"b"}


def test_one_shot_prompts_teach_that_nothing_comes_back():
    clock = Clock()
    c = Conversations(window_s=10, clock=clock)
    c.answered("a", [1])
    come_back(c, 1)
    before = c.continued_share()
    c.answered("a", list(range(10, 60)))
    clock.now += 11
    assert c.waiting() == {}
    assert c.continued_share() < before / 4


def test_a_conversation_stops_waiting_after_the_window():
    clock = Clock()
    c = Conversations(window_s=10, clock=clock)
    c.answered("a", [1])
    clock.now += 9
    c.answered("a", [2])
    clock.now += 2
    assert c.waiting() == {"a": 1}
    assert c.find([chain(1, 5)]) is None
    assert c.find([chain(2, 5)]) == Continuation(2, "a", grows=True)


def test_a_turn_answered_elsewhere_moves_its_conversation():
    c = Conversations()
    c.answered("a", [7])
    come_back(c, 7)
    c.answered("b", [9])
    assert c.waiting() == {"b": 1}


def test_an_identical_prompt_sent_again_is_one_conversation():
    c = Conversations()
    c.answered("a", [7])
    c.answered("a", [7])
    assert c.waiting() == {"a": 1}


def test_the_table_is_bounded():
    c = Conversations(max_tracked=100)
    c.answered("a", range(1000))
    assert c.waiting() == {"a": 100}
    assert c.find([[0]]) is None and c.find([[999]]) == Continuation(999, "a", grows=False)


def test_a_prompt_holding_the_tail_of_one_routed_before_it_extends_it_even_before_that_one_is_answered():
    c = Conversations()
    c.routed([3])
    assert c.extends([chain(1, 2, 3, 4)]) and c.find([chain(1, 2, 3, 4)]) is None  # nothing waits yet
    assert c.waiting() == {}


def test_a_prompt_sharing_only_a_prefix_with_earlier_ones_extends_none_of_them():
    c = Conversations()
    c.routed([3])  # a prompt 1, 2, 3 under the system prompt 1, 2
    assert not c.extends([chain(1, 2, 7, 8)])


def test_routed_tails_are_forgotten_after_the_window_and_bounded():
    clock = Clock()
    c = Conversations(window_s=60, max_tracked=100, clock=clock)
    c.routed([3])
    clock.now += 61
    assert not c.extends([chain(1, 2, 3, 4)])
    c.routed(range(1000))
    assert not c.extends([[0]]) and c.extends([[999]])


def test_a_replica_that_leaves_takes_its_conversations_with_it():
    c = Conversations()
    c.answered("a", [1, 2])
    c.answered("b", [3])
    c.forget("a")
    assert c.waiting() == {"b": 1}
    assert c.find([[1, 2]]) is None


# -- through the router --------------------------------------------------------------------

SYSTEM = {"role": "system", "content": "You answer questions about the fleet. " * 6}


def turns(conversation: int, n: int) -> list[list[dict[str, str]]]:
    history = [SYSTEM]
    out = []
    for t in range(n):
        history.append({"role": "user", "content": f"conversation {conversation}, question {t}: " + "why? " * 20})
        out.append(list(history))
        history.append({"role": "assistant", "content": f"answer {t} of conversation {conversation}. " * 4})
    return out


def two_replicas(cluster, **config):
    sims = [cluster.sim(*FAST) for _ in range(2)]
    return cluster.router([], config={**config, "replicas": [
        {"name": n, "url": s.url, "block_size": 16} for n, s in zip("ab", sims)]})


def served_by(rt, messages) -> str:
    r = chat(HTTP, rt.url, messages)
    assert r.status_code == 200
    return r.headers["x-kvroute-replica"]


def first_turns_by_replica(rt, conversations=10, n=3) -> dict[str, int]:
    """Conversations one after the other, each turn once the previous was answered; where each began."""
    began: dict[str, int] = {}
    for c in range(conversations):
        for t, messages in enumerate(turns(c, n)):
            served = served_by(rt, messages)
            if t == 0:
                began[served] = began.get(served, 0) + 1
    return began


def test_the_router_expects_each_conversation_back_where_its_last_turn_was_answered(cluster):
    rt = two_replicas(cluster)
    last = {}
    for c in range(12):
        for messages in turns(c, 2):
            last[c] = served_by(rt, messages)
    out = HTTP.post(rt.url + "/admin/explain/v1/chat/completions",
                     json={"model": "tiny", "messages": turns(99, 1)[0]}, timeout=10).json()
    returning = {c["replica"]: c["returning"] for c in out["candidates"]}
    share = 12 / (12 + PRIOR_ENDED)  # every conversation came back once, a turn longer
    for replica in "ab":
        waiting = sum(1 for r in last.values() if r == replica)
        assert returning[replica] == pytest.approx(waiting * share, rel=0.05)


def test_new_conversations_under_one_cached_system_prompt_spread_once_conversations_wait_at_its_replica(cluster):
    began = first_turns_by_replica(two_replicas(cluster))
    assert sorted(began) == ["a", "b"], began


def test_without_the_waiting_conversations_every_new_one_follows_the_cached_system_prompt(cluster):
    began = first_turns_by_replica(two_replicas(cluster, cache_aware={"returning_weight": 0}))
    assert len(began) == 1, began


def test_a_first_turn_is_told_the_turns_expected_after_it_and_a_next_turn_none(cluster):
    rt = two_replicas(cluster)
    for c in range(4):
        for messages in turns(c, 2):
            served_by(rt, messages)

    def explain(messages):
        return HTTP.post(rt.url + "/admin/explain/v1/chat/completions", json={"model": "tiny", "messages": messages},
                         timeout=10).json()
    first = explain(turns(99, 1)[0])
    assert (first["extends_earlier"], first["turns_ahead"]) == (False, pytest.approx(4 / PRIOR_ENDED, rel=0.05))
    later = explain(turns(3, 3)[2])  # the third turn of a conversation answered twice
    assert (later["extends_earlier"], later["turns_ahead"]) == (True, 0)


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory):
    """The tiny model's tokenizer, one token per word: prompts of a known number of blocks."""
    return str(write_tokenizer(tmp_path_factory.mktemp("tiny")))


def one_replica_by_tokens(cluster, root):
    sim = cluster.sim(*FAST, "--root", root)
    rt = cluster.router([], config={"replicas": [{"name": "a", "url": sim.url, "block_size": 16}]})
    wait_keyed_by_tokens(rt, 10)  # the tokenizer is found in the folder the replica reports
    return rt, lambda: HTTP.get(rt.url + "/admin/replicas", timeout=2).json()["conversations"]


def complete(rt, prompt: str) -> None:
    r = HTTP.post(rt.url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2}, timeout=10)
    assert r.status_code == 200


def test_a_groups_prompts_under_one_system_prompt_are_not_counted_as_a_conversation(cluster, tiny_root):
    rt, conversations_seen = one_replica_by_tokens(cluster, tiny_root)
    rng = random.Random(5)
    system = text(rng, 47)  # with the BOS token, 3 whole blocks of 16
    for _ in range(4):  # each question fits in the block after the system prompt's last
        complete(rt, system + " " + text(rng, 5))
    seen = conversations_seen()
    # prompts 2-4 came back to the tail the one before left, without growing it: nothing is expected back
    assert seen["next_turns"] == 0 and seen["ended"] == pytest.approx(3, abs=0.01)
    assert seen["waiting"] == {"a": 1} and seen["continued_share"] == 0


def test_a_conversations_turns_that_grow_its_history_are_counted(cluster, tiny_root):
    rt, conversations_seen = one_replica_by_tokens(cluster, tiny_root)
    rng = random.Random(5)
    history = text(rng, 47)
    for _ in range(3):  # each turn adds more than a block
        history += " " + text(rng, 20)
        complete(rt, history)
    seen = conversations_seen()
    assert seen["next_turns"] == pytest.approx(2, abs=0.01) and seen["ended"] == 0
    assert seen["waiting"] == {"a": 1}
    assert seen["continued_share"] == pytest.approx(2 / (2 + PRIOR_ENDED), abs=0.01)


def test_requests_expected_back_can_be_asked_for_a_few_replicas_only():
    assert set(waiting_at_a_and_b().expected(among=["b", "z"])) == {"b"}


# -- across routers (router.shared_conversations) ---------------------------------------------------


def test_what_another_router_answered_waits_here_too_and_what_it_continued_waits_no_more():
    here, there = Conversations(journal=True), Conversations(journal=True)
    there.answered("a", [3])
    for change in there.take_journal():
        here.heard(change)
    assert here.waiting() == {"a": 1}
    found = there.find([chain(1, 3, 4)])  # the next turn came to the other router
    there.resume(found)
    for change in there.take_journal():
        here.heard(change)
    assert here.waiting() == {} and here.describe()["next_turns"] == pytest.approx(1)


def test_an_answer_heard_after_the_window_is_not_kept():
    from router.conversations import Answered
    c = Conversations(window_s=60)
    c.heard(Answered("a", (3,), time.time() - 61))
    assert c.waiting() == {}


def test_without_a_journal_nothing_is_kept_for_other_routers():
    c = Conversations()
    c.answered("a", [3])
    assert c.take_journal() == []


def test_entries_of_the_shared_stream_round_trip_and_anything_else_is_refused():
    from router.conversations import Answered, Resumed
    from router.shared_conversations import decode, encode
    for change in (Answered("replica-é", (1, 2**64 - 1), 1234.5), Resumed(7, True), Resumed(8, False)):
        assert decode(encode(change)) == change
    for raw in (b"", b"x", b"c\x01", b"a" + b"\x00" * 10, encode(Answered("r", (1,), 1.0))[:-3], b"\xff" * 40):
        assert decode(raw) is None


def test_a_conversations_next_turn_through_another_router_is_known_to_both(cluster, tiny_root, shared_url):
    sim = cluster.sim(*FAST, "--root", tiny_root)
    config = {"replicas": [{"name": "a", "url": sim.url, "block_size": 16}], "index": {"backend": shared_url}}
    one, two = cluster.router([], config=config), cluster.router([], config=config)
    for rt in (one, two):
        wait_keyed_by_tokens(rt, 10)

    def seen(rt):
        return HTTP.get(rt.url + "/admin/replicas", timeout=2).json()["conversations"]
    rng = random.Random(5)
    history = text(rng, 47)
    for rt in (one, two, one):  # each turn through the other router, each adds more than a block
        history += " " + text(rng, 20)
        complete(rt, history)
        time.sleep(0.5)  # a user's think time: several syncs
    for rt in (one, two):  # one conversation waits, and both saw its two next turns
        assert seen(rt)["waiting"] == {"a": 1}, seen(rt)
        assert seen(rt)["next_turns"] == pytest.approx(2, abs=0.01), seen(rt)
