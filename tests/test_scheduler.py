from hybridkv.scheduling.output import SchedulerOutput
from hybridkv.scheduling.request import Request, RequestStatus, SampleGroup
from hybridkv.scheduling.sampling_params import SamplingParams
from hybridkv.scheduling.scheduler import Scheduler, SchedulerConfig
from hybridkv.scheduling.stopping import StopRules

from alloc_helpers import make_coordinator

BS = 4


def make_scheduler(num_blocks=400, windows=(None,), **config):
    return Scheduler(SchedulerConfig(**config), make_coordinator(list(windows), num_blocks, BS))


def add(scheduler, request_id, num_tokens, start=0, **params):
    request = Request(request_id, list(range(start, start + num_tokens)), SamplingParams(**params), BS)
    scheduler.add_request(request)
    return request


def step(scheduler, token=7, eos=()):
    """One engine step with a fake model: every request that reaches its last token samples `token`,
    and the engine's stop rules finish what they stop."""
    out = scheduler.schedule()
    scheduler.check_plan(out)
    sampling = out.sampling
    scheduler.update(out, [token] * len(sampling))
    finished = list(out.failed)
    stop_rules = StopRules(eos, scheduler.config.max_model_len)
    for request in sampling:
        status = stop_rules.check(request, token)
        if status is not None:
            scheduler.finish(request, status)
            finished.append(request)
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled], out, finished


def test_budget_and_long_prefill_threshold_chunk_three_long_prompts():
    scheduler = make_scheduler(
        num_blocks=2000, max_num_batched_tokens=1024, long_prefill_token_threshold=400, max_model_len=4096
    )
    for name, start in (("a", 0), ("b", 1000), ("c", 2000)):
        add(scheduler, name, 800, start, max_tokens=8)
    assert step(scheduler)[0] == [("a", 400), ("b", 400), ("c", 224)]
    assert step(scheduler)[0] == [("a", 400), ("b", 400), ("c", 224)]
    assert step(scheduler)[0] == [("a", 1), ("b", 1), ("c", 352)]
    assert step(scheduler)[0] == [("a", 1), ("b", 1), ("c", 1)]


def test_waiting_requests_are_admitted_first_come_first_served():
    scheduler = make_scheduler(num_blocks=9, max_model_len=64)  # 8 usable blocks
    add(scheduler, "big", 24, 0)  # 6 blocks
    add(scheduler, "second", 12, 100)  # 3 blocks: does not fit beside "big"
    add(scheduler, "small", 4, 200)  # 1 block: would fit, but must not jump the queue
    assert step(scheduler)[0] == [("big", 24)]
    assert [r.request_id for r in scheduler.waiting] == ["second", "small"]


def test_sequence_cap_limits_running_requests():
    scheduler = make_scheduler(max_num_seqs=2, max_model_len=64)
    for i in range(3):
        add(scheduler, f"r{i}", 5, 100 * i)
    assert step(scheduler)[0] == [("r0", 5), ("r1", 5)]
    assert step(scheduler)[0] == [("r0", 1), ("r1", 1)]


def test_newest_running_request_is_preempted_and_nothing_is_admitted_that_step():
    scheduler = make_scheduler(num_blocks=7, max_model_len=64)  # 6 usable blocks
    old = add(scheduler, "old", 12, 0, max_tokens=20)  # 3 blocks
    new = add(scheduler, "new", 12, 100, max_tokens=20)  # 3 blocks
    assert step(scheduler)[0] == [("old", 12), ("new", 12)]
    add(scheduler, "late", 3, 300)
    # Both now hold 13 tokens and need a 4th block each: only "new" can go.
    names, out, _ = step(scheduler)
    assert names == [("old", 1)]
    assert out.preempted == [new]
    assert [r.request_id for r in scheduler.waiting] == ["new", "late"]
    assert new.num_computed_tokens == 0 and new.num_tokens == 13 and new.num_preemptions == 1
    assert scheduler.coordinator.block_ids("new") == [[]]
    assert old.num_computed_tokens == 13


def test_preempted_request_comes_back_through_the_prefix_cache():
    scheduler = make_scheduler(num_blocks=8, max_model_len=64)  # 7 usable blocks
    add(scheduler, "old", 12, 0, max_tokens=2)
    new = add(scheduler, "new", 12, 100, max_tokens=20)
    step(scheduler)  # both prefill and sample: 13 tokens each, 3 blocks each
    # Both need a 4th block; "old" takes the last free one and "new" is preempted, its blocks
    # going back to the pool still cached.
    names, out, finished = step(scheduler)
    assert names == [("old", 1)] and out.preempted == [new]
    assert [r.request_id for r in finished] == ["old"]
    names, _, _ = step(scheduler)
    # Its 3 full prompt blocks are still cached: only the sampled token is recomputed.
    assert names == [("new", 1)]
    assert new.num_computed_tokens == 13 and new.num_tokens == 14


def test_prompt_longer_than_max_model_len_fails_at_once_with_the_fix():
    scheduler = make_scheduler(max_model_len=16)
    request = Request("long", list(range(17)), SamplingParams(), BS)
    assert not scheduler.add_request(request)
    assert request.status is RequestStatus.FINISHED_ERROR
    assert "prompt has 17 tokens but max_model_len is 16; raise max_model_len" in request.error
    assert not (scheduler.waiting or scheduler.running or scheduler.swapped)


def test_prompt_larger_than_the_pool_fails_at_once_with_the_fix():
    scheduler = make_scheduler(num_blocks=5, max_model_len=64)
    request = Request("huge", list(range(20)), SamplingParams(), BS)
    assert not scheduler.add_request(request)
    assert "needs 5 KV blocks but the pool has 4" in request.error


def test_sliding_window_prompt_is_checked_against_window_not_length():
    scheduler = make_scheduler(num_blocks=8, windows=(9,), max_model_len=256, max_num_batched_tokens=8)
    request = Request("long", list(range(200)), SamplingParams(), BS)
    assert scheduler.add_request(request)  # window 2 blocks + 1 + a chunk of 2 blocks
    while request.num_computed_tokens < 200:
        step(scheduler)
    assert scheduler.coordinator.pool.num_used_blocks <= 5


def test_request_outgrowing_the_whole_pool_fails_and_returns_its_blocks():
    scheduler = make_scheduler(num_blocks=3, max_model_len=64)  # 2 usable blocks = 8 tokens
    request = add(scheduler, "r", 6, max_tokens=20)
    for _ in range(4):
        _, _, finished = step(scheduler)
    assert finished == [request]
    assert request.status is RequestStatus.FINISHED_ERROR
    assert "more KV blocks than the whole pool" in request.error
    assert scheduler.coordinator.pool.num_used_blocks == 0
    assert not (scheduler.waiting or scheduler.running or scheduler.swapped)


def test_max_tokens_finishes_with_length():
    scheduler = make_scheduler(max_model_len=64)
    request = add(scheduler, "r", 5, max_tokens=3)
    finished = [f for _ in range(3) for f in step(scheduler)[2]]
    assert finished == [request]
    assert request.status is RequestStatus.FINISHED_LENGTH and request.output_token_ids == [7, 7, 7]
    assert scheduler.coordinator.pool.num_used_blocks == 0


def test_eos_stops_unless_ignored_and_not_before_min_tokens():
    scheduler = make_scheduler(max_model_len=64)
    stops = add(scheduler, "stops", 5, 0, max_tokens=5)
    waits = add(scheduler, "waits", 5, 100, max_tokens=5, min_tokens=2)
    ignores = add(scheduler, "ignores", 5, 200, max_tokens=3, ignore_eos=True)
    step(scheduler, eos=[7])
    assert stops.status is RequestStatus.FINISHED_STOPPED and stops.output_token_ids == [7]
    step(scheduler, eos=[7])
    assert waits.status is RequestStatus.FINISHED_STOPPED and waits.num_output_tokens == 2
    step(scheduler, eos=[7])
    assert ignores.status is RequestStatus.FINISHED_LENGTH and ignores.num_output_tokens == 3


def test_stop_token_ids_stop_the_request():
    scheduler = make_scheduler(max_model_len=64)
    request = add(scheduler, "r", 5, max_tokens=5, stop_token_ids=[7])
    step(scheduler)
    assert request.status is RequestStatus.FINISHED_STOPPED


def test_generation_stops_at_max_model_len():
    scheduler = make_scheduler(max_model_len=8)
    request = add(scheduler, "r", 6, max_tokens=10)
    step(scheduler)
    step(scheduler)
    assert request.status is RequestStatus.FINISHED_LENGTH and request.num_tokens == 8


def test_the_plan_carries_each_requests_block_table_rows_and_whether_it_samples():
    scheduler = make_scheduler(windows=(None, 9), max_model_len=64, max_num_batched_tokens=12)
    a = add(scheduler, "a", 6, 0)
    b = add(scheduler, "b", 10, 100)
    plan = scheduler.schedule()
    assert [(s.request, s.num_new_tokens, s.samples) for s in plan.scheduled] == [(a, 6, (a,)), (b, 6, ())]
    assert plan.sampling == [a]
    assert scheduler.block_tables(plan) == [
        [scheduler.coordinator.block_ids("a")[group], scheduler.coordinator.block_ids("b")[group]] for group in (0, 1)
    ]
    assert [len(row) for row in scheduler.block_tables(plan)[0]] == [2, 2]


def test_the_samples_of_one_prompt_wait_for_the_leader_are_forked_from_it_and_preempted_alone():
    scheduler = make_scheduler(num_blocks=9, max_model_len=64)  # 8 usable blocks
    other = add(scheduler, "other", 8, 100, max_tokens=20)
    step(scheduler)
    group = SampleGroup.of("r", list(range(9)), SamplingParams(n=3, max_tokens=20), BS)
    leader, *followers = group.members
    assert scheduler.add_request(leader)
    assert [m.status for m in followers] == [RequestStatus.WAITING_FOR_LEADER] * 2
    scheduled, plan, _ = step(scheduler)
    assert scheduled == [("other", 1), ("r#0", 9)]
    # The leader's last prompt row gave every sample its first token: the followers were forked from
    # it (all blocks shared, the partial last one included) and compute no prompt token of their own.
    assert plan.sampling == [other, leader, *followers]
    assert [m.status for m in followers] == [RequestStatus.RUNNING] * 2
    table = [list(row) for row in scheduler.coordinator.block_ids("r#0")]
    assert scheduler.coordinator.block_ids("r#1") == scheduler.coordinator.block_ids("r#2") == table
    scheduled, plan, _ = step(scheduler)
    assert scheduled == [("other", 1), ("r#0", 1), ("r#1", 1), ("r#2", 1)]
    # Writing token 9 into the shared partial block: the first two copy it, the last holder writes it.
    partial = table[0][2]
    assert [src for src, _ in plan.blocks_to_copy] == [partial, partial]
    assert scheduler.coordinator.block_ids("r#2")[0][2] == partial
    plan = SchedulerOutput()
    while not plan.preempted:
        _, plan, _ = step(scheduler)
    # The newest running requests are samples of the group: they are preempted alone, newest first, until
    # the rest fit (samples need not run together; only a beam search's beams are preempted as one).
    assert [r.request_id for r in plan.preempted] == ["r#2", "r#1"]
    assert [s.request for s in plan.scheduled] == [other, leader]
    assert leader.status is other.status is RequestStatus.RUNNING


def test_a_leader_that_fails_before_releasing_its_followers_takes_them_with_it():
    scheduler = make_scheduler(max_model_len=64)
    group = SampleGroup.of("r", list(range(8)), SamplingParams(n=2), BS)
    scheduler.add_request(group.leader)
    scheduler.finish_group(group, RequestStatus.FINISHED_ABORTED)
    assert [m.status for m in group.members] == [RequestStatus.FINISHED_ABORTED] * 2
    assert not scheduler.waiting and scheduler.coordinator.pool.num_used_blocks == 0
