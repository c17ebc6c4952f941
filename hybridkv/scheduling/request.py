"""Requests: the scheduler's (Request, which extends the memory manager's KVRequest: hybridkv/memory/kv_request.py), and
the n samples of one prompt (SampleGroup)."""

from __future__ import annotations

import enum
from collections.abc import Sequence

from hybridkv.lora.request import AdapterRef
from hybridkv.memory.block_pool import cdiv
from hybridkv.memory.kv_request import KVRequest
from hybridkv.memory.prompt_images import PromptImages
from hybridkv.scheduling.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    WAITING_FOR_LEADER = "waiting_for_leader"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    def __init__(self, value: str) -> None:
        # A plain attribute, read for every request in every step (a property over `.value` costs 3 lookups).
        self.is_finished = value in ("stop", "length", "abort", "error")


class Request(KVRequest):
    """A request as the scheduler and engine see it: KV state plus how to generate and when to stop.

    One sample of a user request: `group` holds every sample of the same prompt (a group of one when
    n == 1) and `sample_index` is this one's place in it.
    """

    __slots__ = (
        "error",
        "greedy_alone",
        "group",
        "lora",
        "num_cached_tokens",
        "num_preemptions",
        "overlaps",
        "params",
        "prefix_cache_miss",
        "prefix_cache_tiers",
        "sample_index",
        "spec_length",
        "spec_misses",
        "spec_skips",
        "spec_token_ids",
        "speculates",
        "status",
        "stop_reason",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        block_size: int | None,
        multimodal: PromptImages | None = None,
        model_key: bytes = b"",
        lora: AdapterRef | None = None,
    ) -> None:
        adapter_key = b"" if lora is None else lora.key
        super().__init__(
            request_id, prompt_token_ids, block_size, params.cache_salt, multimodal, model_key, adapter_key
        )
        self.params = params
        self.lora = lora  # its LoRA adapter (enable_lora), None for the model alone
        if lora is not None:
            self.adapter_id = (lora.request.lora_int_id, lora.request.lora_name)
        self.reads_prefix_cache = params.prompt_logprobs is None
        self.status = RequestStatus.WAITING
        self.error: str | None = None
        self.stop_reason: str | int | None = None
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens taken from the prefix cache at first admission
        # Of those, the tokens each tier's blocks gave ("device", "host", "disk"), and where and why the hit stopped
        # (`KVCacheCoordinator.explain_miss`; None for a whole hit).
        self.prefix_cache_tiers: dict[str, int] = {}
        self.prefix_cache_miss: dict[str, int | str] | None = None
        self.group = SampleGroup(request_id, [self])
        self.sample_index = 0
        # What the sampler reads for this sample and the output's record of it are the engine's, by request
        # (`OutputProcessor.samples`). Plainly greedy (its sampling row's argmax is its token) and alone in its group:
        # set with the sampling row. A step of such requests only takes the engine's one-pass update
        # (`OutputProcessor.record_alone`).
        self.greedy_alone = False
        # Its next step may be scheduled before its sampled token reaches the host (async scheduling): nothing in
        # its sampling or output reads that token first (no grammar, penalty, logprobs, beam or other sample).
        # Every `greedy_alone` request overlaps.
        self.overlaps = False
        # Speculative decoding (hybridkv/engine/speculation.py): whether its tokens may be proposed and checked several
        # at a step (set when it is added), and the tokens proposed for its next step.
        self.speculates = False
        self.spec_token_ids: list[int] = []
        # How many tokens it is proposed at most (0: num_speculative_tokens, until its first check), its checks in a
        # row that kept no proposal, and the steps it still skips proposing for (a backoff).
        self.spec_length = 0
        self.spec_misses = 0
        self.spec_skips = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def finish(self, status: RequestStatus, error: str | None = None) -> None:
        self.status = status
        self.error = error


class SampleGroup:
    """The sequences of one prompt (a user request's n or best_of samples, or a beam search's beams),
    and the rules they follow together.

    The first sample (the leader) computes the prompt; the others wait for it with status
    WAITING_FOR_LEADER, and in the step the leader samples its first token they are forked from it (its
    blocks shared) and draw their own first tokens from the same logits. A failure fails every unfinished
    member; a leader that ends before its followers were forked takes them with it. A beam search's
    members change every step (`beam`), and are preempted together (`runs_together`)."""

    __slots__ = ("beam", "members", "request_id")

    def __init__(self, request_id: str, members: list[Request], first_index: int = 0) -> None:
        self.request_id = request_id
        self.members = members
        self.beam = None  # a BeamSearch (hybridkv/sampling/beam_search.py) when the group is a beam search
        for index, member in enumerate(members, start=first_index):
            member.group = self
            member.sample_index = index

    @classmethod
    def of(
        cls,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        block_size: int | None,
        multimodal: PromptImages | None = None,
        model_key: bytes = b"",
        lora: AdapterRef | None = None,
    ) -> SampleGroup:
        """The params.best_of samples of a prompt, named `request_id#index`, hashed under `model_key` (and `lora`'s
        adapter)."""
        count = params.num_samples
        members = [
            Request(f"{request_id}#{i}", prompt_token_ids, params, block_size, multimodal, model_key, lora)
            for i in range(count)
        ]
        return cls(request_id, members)

    def parts(self, max_seats: int) -> list[SampleGroup]:
        """The group itself, or, with more samples than `max_seats` (max_num_seqs), groups of at most that many and
        of near-equal sizes, in order, the samples keeping their indices. Each part's leader computes the prompt (a
        prefix-cache hit after the first, where caching is on); the parts queue as requests of their own and run as
        seats free (vLLM runs every sample as a request of its own)."""
        count = len(self.members)
        if count <= max_seats:
            return [self]
        size = cdiv(count, cdiv(count, max_seats))
        return [SampleGroup(self.request_id, self.members[i : i + size], first_index=i) for i in range(0, count, size)]

    @property
    def leader(self) -> Request:
        return self.members[0]

    @property
    def finished(self) -> bool:
        return all(m.status.is_finished for m in self.members)

    @property
    def seats(self) -> int:
        """The sequences the group runs at once at most (of max_num_seqs): its unfinished samples, or a
        beam search's width."""
        if self.beam is not None:
            return self.beam.width
        return sum(1 for m in self.members if not m.status.is_finished)

    @property
    def runs_together(self) -> bool:
        """Whether the members only make progress together (a beam search's step needs every beam)."""
        return self.beam is not None

    def hold_followers(self) -> None:
        """The followers wait until the leader has computed the prompt."""
        for member in self.members[1:]:
            member.status = RequestStatus.WAITING_FOR_LEADER

    def running(self) -> list[Request]:
        """Members that hold blocks and run."""
        return [m for m in self.members if m.status is RequestStatus.RUNNING]

    def unfinished(self) -> list[Request]:
        return [m for m in self.members if not m.status.is_finished]

    def held_followers(self, request: Request) -> list[Request]:
        """The followers still waiting for `request` to compute the prompt (none unless it leads)."""
        if request is not self.members[0] or len(self.members) == 1:
            return []
        return [m for m in self.members[1:] if m.status is RequestStatus.WAITING_FOR_LEADER]
