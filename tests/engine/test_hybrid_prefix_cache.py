"""A hybrid model's prefix cache as the scheduler keeps it (no model: the step's state copies
are what the worker would make): a prompt's chunk ends at its save point and the step
saves the state there; a later prompt with the same blocks is served up to a block with a
state, its step loads it; a state goes with its block, and the least recently used goes
when the cache is full."""

from __future__ import annotations

from rlserve.engine.kv_cache import KVCacheManager
from rlserve.engine.request import FinishReason, Request
from rlserve.engine.scheduler import Scheduler
from rlserve.engine.state import EngineState
from rlserve.engine.state_pool import StateCache, StatePool
from rlserve.sampling_params import SamplingParams

BS = 4
SEQS = 4


def scheduler(num_blocks: int = 64, cache_slots: int = SEQS, budget: int = 64) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, True, StatePool(SEQS), StateCache(SEQS, cache_slots))
    return Scheduler(kv, SEQS, budget, EngineState())


def run_prompt(s: Scheduler, rid: str, prompt: list[int]):
    """Schedule `rid` until its prompt is computed, then end it; every step's (chunk sizes,
    state loads, state saves)."""
    req = Request(rid, prompt, SamplingParams(max_tokens=4), max_model_len=1024)
    s.add(req)
    steps = []
    while req.num_computed_tokens < req.num_prompt_tokens:
        out = s.schedule()
        steps.append(([it.num_new_tokens for it in out.scheduled], out.state_loads, out.state_saves))
        s.advance(out)
        del req.token_ids[req.num_prompt_tokens:]  # the placeholder: no token sampled here
    s.finish(req, FinishReason.LENGTH)
    return req, steps


def test_a_prompt_saves_its_state_at_the_last_full_block_a_repeat_can_hit_and_a_repeat_loads_it():
    s = scheduler()
    prompt = list(range(1, 4 * BS + 3))  # 18 tokens: the state at 16 is kept
    _, steps = run_prompt(s, "a", prompt)
    assert steps == [([16], [], [(0, SEQS)]), ([2], [], [])]  # running slot 0 into the first cached slot
    again, steps = run_prompt(s, "b", prompt)
    assert again.num_cached_tokens == 16
    assert steps == [([2], [(SEQS, 0)], [])]
    extended, steps = run_prompt(s, "c", prompt + [7] * (2 * BS))  # 26 tokens: its own state at 24
    assert extended.num_cached_tokens == 16
    assert steps == [([8], [(SEQS, 0)], [(0, SEQS + 1)]), ([2], [], [])]


def test_a_hit_ends_at_the_last_block_with_a_state():
    """Blocks cached without a state at their end (a shorter prompt's tail) are not served
    to a hybrid model: its layers would have no state to start from."""
    s = scheduler()
    run_prompt(s, "a", list(range(1, 3 * BS + 2)))  # 13 tokens: blocks 0-2 cached, the state at 12
    longer, _ = run_prompt(s, "b", list(range(1, 3 * BS + 2)) + [9] * (2 * BS))
    assert longer.num_cached_tokens == 3 * BS
    shorter, steps = run_prompt(s, "c", list(range(1, 2 * BS + 2)))  # shares blocks 0-1: no state at 8
    assert shorter.num_cached_tokens == 0
    assert steps[0][2], "its own state at 8 is saved"


def test_an_evicted_block_takes_its_state_with_it():
    s = scheduler(num_blocks=6)
    prompt = list(range(1, 2 * BS + 2))  # 9 tokens, 3 blocks; the state at 8
    run_prompt(s, "a", prompt)
    assert len(s.kv.state_cache) == 1
    run_prompt(s, "b", list(range(50, 50 + 5 * BS + 2)))  # 6 blocks: every block of `a` evicted
    assert len(s.kv.state_cache) == 1  # `b`'s own: `a`'s went with its block...
    again, _ = run_prompt(s, "c", prompt)
    assert again.num_cached_tokens == 0  # ...and so did the hit


def test_a_full_state_cache_gives_the_least_recently_used_slot_to_a_new_state():
    s = scheduler(cache_slots=2)
    one, two, three = ([k] * (2 * BS) + [1] for k in (3, 4, 5))
    run_prompt(s, "one", one)
    run_prompt(s, "two", two)
    assert run_prompt(s, "one-again", one)[0].num_cached_tokens == 2 * BS  # `one` is now the most recent
    run_prompt(s, "three", three)  # takes `two`'s slot
    assert run_prompt(s, "one-third", one)[0].num_cached_tokens == 2 * BS
    assert run_prompt(s, "two-again", two)[0].num_cached_tokens == 0


def test_a_prefix_cache_reset_drops_every_state():
    s = scheduler()
    prompt = list(range(1, 2 * BS + 2))
    run_prompt(s, "a", prompt)
    s.kv.reset_prefix_cache()
    assert len(s.kv.state_cache) == 0
    assert run_prompt(s, "b", prompt)[0].num_cached_tokens == 0


def test_two_requests_computing_one_prompt_keep_one_state():
    """Admitted together, both save; the cache serves the first one's block, whose state
    stays, and the second's slot is free again."""
    s = scheduler()
    prompt = list(range(1, 2 * BS + 2))
    reqs = [Request(rid, prompt, SamplingParams(max_tokens=4), max_model_len=1024) for rid in "ab"]
    for r in reqs:
        s.add(r)
    out = s.schedule()
    assert [it.num_new_tokens for it in out.scheduled] == [8, 8] and len(out.state_saves) == 2
    s.advance(out)
    assert len(s.kv.state_cache) == 1
    assert s.kv.state_cache.slot(s.kv.block_table(reqs[0])[1]) == out.state_saves[0][1]
