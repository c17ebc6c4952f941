"""Speculative decoding: tokens proposed for a request and checked, several at a step, in the same forward.

After each step, every running request that speculates (`Speculator.speculates`: a request whose tokens depend on
its logits alone: no penalty, bias, beam or best_of; logprobs are read off the same rows, a grammar masks them) gets
up to k proposals (hybridkv/execution/speculative_config.py): n-gram prompt lookup, or a draft model's greedy
continuation (a grammar keeps those it would accept). Its next step computes its unseen tokens as usual and, after
its last one, one row per proposal (`SchedulerOutput.spec_tokens`, within the step's token budget); the k + 1 rows'
logits decide which proposals it keeps and one more token of the model's own (hybridkv/sampling/acceptance.py):
`generate`'s tokens for a greedy request, the model's distribution for a sampled one.

By default nothing a proposal computes is kept, so nothing has to be rolled back, on any layer kind:

- a proposal's row stores no K/V (slot -1: `StepInputs.unstored_rows`); the rows after it read its keys in flight, as
  every layer reads the step's own keys, and no block is allocated for it, so a sliding window's blocks follow the
  kept tokens only and no prefix-cache block is ever made from a proposal;
- a state layer (Gated DeltaNet, Mamba, a short convolution) runs the proposals' rows from a copy of the state in the
  scratch slot (hybridkv/execution/state_layers.py): the request's own slot holds the state of its kept tokens.

The tokens a step keeps are appended like sampled ones (stop strings, EOS, max_tokens and min_tokens are checked
token by token, so a stop inside a kept run ends the request there), and the next step computes them as the request's
unseen tokens: a kept proposal is computed twice, once as a proposal and once kept. That costs rows, not forwards,
and is what lets every layer kind stay exact without snapshots of states or windows.

On a model of full-attention groups only (`Scheduler.stores_proposals`, vLLM's way) the proposals' rows store their K/V
into blocks allocated for them, and a kept proposal's stays: `finish` counts it computed, and a step is the last token
and the proposals. Latent attention is served this way only (it reads a step's rows back from the pages). A rejected
proposal's K/V lies past the computed tokens and is overwritten before its block can fill and be hashed.

What trying costs is bounded, per request: its proposals shorten by one after each check that did not keep them all
and lengthen by two (up to k) after one that did (transformers' "heuristic" schedule for `assistant_model`), and a
request whose checks keep nothing n times in a row skips proposing for 2^n - 1 steps (at most `MAX_SKIPS`); one kept
proposal ends the backoff.

The draft model runs in an engine of its own (its own pages, prefix caching on), where each request that speculates has
a request of its own, kept from round to round while it speculates: a round sets it to go on from the request's
tokens (`LLMEngine.continue_from`: cut where the two part, the kept tokens appended) and steps the draft's engine
until it holds k greedy tokens more; the next round computes only what the model kept since. Where the draft's layers
are not all full attention (a window or a state cannot go back), or the cut would reach into a computed block, the
draft's request is added again each round, and its prefix cache holds most of what it computed. A request's end
(a stop, an abort, a failure, a closed stream: `Scheduler.on_finish`) ends its draft's request at once, and `sleep`
gives back the draft's pages and prefix cache with the model's.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from hybridkv.execution.sizing import context_length
from hybridkv.execution.speculative_config import SpeculativeConfig
from hybridkv.patches import attention
from hybridkv.sampling.acceptance import accept
from hybridkv.sampling.prompt_lookup import ngram_proposal
from hybridkv.sampling.sampler import SampledLogprobs, SamplingRow, token_logprobs
from hybridkv.sampling.structured_outputs import mask_along
from hybridkv.scheduling.output import SchedulerOutput
from hybridkv.scheduling.request import Request, RequestStatus
from hybridkv.scheduling.sampling_params import SamplingParams
from hybridkv.scheduling.scheduler import Scheduler

# The most steps a request whose proposals keep failing skips proposing for (`Speculator.verify`'s backoff).
MAX_SKIPS = 15


class DraftEngine(Protocol):
    """What a draft model's engine gives the speculator: an `LLMEngine` (hybridkv/engine/llm_engine.py, which builds on
    this module: named here, not imported), through its public calls."""

    max_model_len: int
    max_num_batched_tokens: int

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> str: ...

    def abort(self, request_id: str) -> Any: ...

    def abort_all(self) -> Any: ...

    def step(self) -> list[Any]: ...

    def continue_from(self, request_id: str, token_ids: Sequence[int], known: int = 0) -> bool: ...

    def sample_request(self, request_id: str) -> Request: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def close(self) -> None: ...


# What the front does with each kept token after a request's first (`Speculator.finish`): records it and ends the
# request where it stops.
RecordToken = Callable[[Request, int, SampledLogprobs | None], None]


class Speculator:
    """The engine's proposals and their check (module docstring), with the counts `stats()` reports."""

    def __init__(
        self,
        config: SpeculativeConfig,
        rows_of: Callable[[Sequence[Request]], list[SamplingRow | None]],
        draft_engine: Callable[[torch.nn.Module], DraftEngine] | None = None,
    ) -> None:
        self.config = config
        self.rows_of = rows_of  # what the sampler reads for each request (its engine's records)
        self.k = config.num_speculative_tokens
        self.draft = None
        if config.method == "draft_model" and draft_engine is not None:  # None: a tensor-parallel worker's
            self.draft = draft_engine(config.model)
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * self.k
        self.propose_seconds = 0.0
        self.num_skipped = 0
        # The requests whose check failed in the last `verify` (a grammar that cannot go on), with the error.
        self.errors: dict[Request, Exception] = {}
        # Each speculating request's request in the draft's engine (its id, and how many of the request's tokens it
        # was last given), kept from round to round, and the settings of them all (greedy, to the end of the model's
        # length; a round stops them).
        self._drafting: dict[Request, tuple[str, int]] = {}
        self._draft_ids = itertools.count()
        self._draft_params = None
        if self.draft is not None:
            self._draft_params = SamplingParams(temperature=0, max_tokens=self.draft.max_model_len, ignore_eos=True)
        self._stored = False
        self._kept: list[tuple[Request, list[tuple[int, SampledLogprobs | None]]]] = []

    @staticmethod
    def speculates(params: Any) -> bool:
        """Whether a request's tokens may be proposed: it did not turn speculation off (`SamplingParams.speculative`)
        and its tokens depend on its rows' logits alone (logprobs are read off the same rows)."""
        return (
            isinstance(params, SamplingParams)
            and params.speculative
            and not params.has_penalties
            and not params.logit_bias
            and params.num_samples == params.n
        )

    def propose(self, requests: Sequence[Request]) -> None:
        """Proposals for each running request that speculates and has sampled its first token (`spec_token_ids`, which
        its next step checks), at most as many as it may still generate after the token its step adds."""
        start = time.perf_counter()
        wanted: list[tuple[Request, int]] = []
        for request in requests:
            if not request.speculates or request.status is not RequestStatus.RUNNING or request.num_output_tokens < 1:
                continue
            if request.spec_skips:
                request.spec_skips -= 1
                self.num_skipped += 1
                continue
            max_tokens = request.params.max_tokens
            k = request.spec_length or self.k
            if max_tokens is not None:
                k = min(k, max_tokens - request.num_output_tokens - 1)
            if k > 0:
                wanted.append((request, k))
        if self.draft is None:
            config = self.config
            for request, k in wanted:
                request.spec_token_ids = ngram_proposal(
                    request.token_ids, k, config.prompt_lookup_min, config.prompt_lookup_max
                )
        else:
            self._draft_round(wanted)
        rows = self.rows_of([request for request, _ in wanted])
        for (request, _), row in zip(wanted, rows, strict=True):  # a grammar keeps the proposals it would accept
            matcher = row.matcher
            if matcher is not None and request.spec_token_ids:
                del request.spec_token_ids[matcher.valid_prefix(request.spec_token_ids) :]
        self.propose_seconds += time.perf_counter() - start

    def _draft_round(self, wanted: list[tuple[Request, int]]) -> None:
        """The draft model's proposals (module docstring): the draft's requests of those that do not speculate in this
        round end; each of `wanted` goes on from its request's tokens (or is added), and the draft's engine steps until
        each holds its k tokens after them."""
        draft = self.draft
        drafting, self._drafting = self._drafting, {}
        wanting = {request for request, _ in wanted}
        for request, (draft_id, _) in drafting.items():
            if request not in wanting:
                draft.abort(draft_id)
        goals = []
        for request, k in wanted:
            context = request.token_ids
            draft_id, known = drafting.get(request, (None, 0))
            if draft_id is None or not draft.continue_from(draft_id, context, known):
                if draft_id is not None:
                    draft.abort(draft_id)
                draft_id = draft.add_request(f"draft-{next(self._draft_ids)}", list(context), self._draft_params)
            self._drafting[request] = (draft_id, len(context))
            own = draft.sample_request(draft_id)
            goals.append((request, own, len(context), len(context) + k))
        # Each step gives every running draft request a token once it has computed what it was given (in chunks of
        # max_num_batched_tokens). A request that reached its goal runs on while others catch up; the steps are
        # bounded, so a draft's engine short of blocks (preempting) ends the round with shorter proposals.
        pending = sum(len(own.token_ids) - own.num_computed_tokens for _, own, _, _ in goals)
        steps = self.k + len(goals) + pending // draft.max_num_batched_tokens + 1
        for _ in range(steps):
            if not any(len(own.token_ids) < goal and not own.status.is_finished for _, own, _, goal in goals):
                break
            draft.step()
        for request, own, start, goal in goals:
            request.spec_token_ids = own.token_ids[start:goal]

    def verify(
        self, plan: SchedulerOutput, logits: torch.Tensor
    ) -> tuple[list[int], dict[Request, list[tuple[int, SampledLogprobs | None]]]]:
        """Split a step's logits rows: the rows of the requests that sample as usual (one per sample, in
        `plan.sampling`'s order), and for each request that checked proposals, the tokens it keeps with their
        logprobs where it asks for them (the first is its step's token; the rest `finish` appends)."""
        normal: list[int] = []
        kept: dict[Request, list[tuple[int, SampledLogprobs | None]]] = {}
        self.errors = {}
        row = 0
        for request, _, samples in plan.scheduled:
            proposed = plan.spec_tokens.get(request.request_id)
            if not proposed:
                normal.extend(range(row, row + len(samples)))
                row += len(samples)
                continue
            count = len(proposed)
            rows = logits[row : row + count + 1]
            row += count + 1
            (sampling,) = self.rows_of([request])
            matcher = sampling.matcher
            try:
                if matcher is not None:  # checked against the grammar's rows up to its first refused proposal
                    proposed = proposed[: matcher.valid_prefix(proposed)]
                    rows = rows[: len(proposed) + 1]
                masked = rows if matcher is None else mask_along(rows, proposed, matcher)
                tokens = accept(masked, proposed, sampling)
            except Exception as error:  # the request fails alone, as a row of the sampler does (`_verify`)
                self.errors[request] = error
                continue
            entries: list[SampledLogprobs | None] = [None] * len(tokens)
            wanted = request.params.logprobs
            if wanted is not None:  # each kept token's from its own row, the model's raw distribution
                raw = torch.log_softmax(rows[: len(tokens)], dim=-1)
                entries = [token_logprobs(raw[i], token, wanted) for i, token in enumerate(tokens)]
            kept[request] = list(zip(tokens, entries, strict=True))
            accepted = len(tokens) - 1
            # The next proposals' length: one less after a check that kept not all of them, two more (up to k) after
            # one that kept them all. Backoff: after n checks in a row that kept nothing, the request skips 2^n - 1
            # steps (at most MAX_SKIPS) before its next proposals; one kept proposal ends it.
            length = request.spec_length or self.k
            request.spec_length = min(self.k, length + 2) if accepted == count else max(1, length - 1)
            request.spec_misses = 0 if accepted else request.spec_misses + 1
            request.spec_skips = min(2**request.spec_misses - 1, MAX_SKIPS)
            self.num_drafts += 1
            self.num_draft_tokens += count
            self.num_accepted_tokens += accepted
            for position in range(accepted):
                self.accepted_per_position[position] += 1
        self._kept = [(request, pairs[1:]) for request, pairs in kept.items() if len(pairs) > 1]
        self._stored = plan.spec_stored
        return normal, kept

    def finish(self, scheduler: Scheduler, record: RecordToken) -> int:
        """Append the step's kept tokens after each request's first (`verify`), each recorded and checked for a stop
        as a sampled token is (`record`: the request ends at the first that stops it); returns how many were
        appended."""
        appended = 0
        kept, self._kept = self._kept, []
        for request, pairs in kept:
            for token, entry in pairs:
                if request.status.is_finished:
                    break
                request.append_token(token)
                appended += 1
                record(request, token, entry)
            if self._stored and not request.status.is_finished:
                # The kept proposals' K/V are in their blocks: computed (the model's own last token is not yet).
                request.num_computed_tokens += len(pairs)
                scheduler.coordinator.update_computed(request)
        return appended

    def drop(self) -> None:
        """A failed step's kept tokens are not appended."""
        self._kept = []

    def end_draft(self, request: Request) -> None:
        """A request ended (`Scheduler.on_finish`: a stop, an abort, a failure, a closed stream): its draft's request
        ends now, every block it held back in the draft's pool."""
        drafting = self._drafting.pop(request, None)
        if drafting is not None:
            self.draft.abort(drafting[0])

    def sleep(self) -> None:
        """The draft's engine gives its pages back too (`LLMEngine.sleep`: its prefix cache goes with them), once every
        request of it has ended."""
        if self.draft is not None:
            self._drafting.clear()
            self.draft.abort_all()
            self.draft.sleep()

    def wake_up(self) -> None:
        """The draft's engine takes its pages again (`LLMEngine.wake_up`)."""
        if self.draft is not None:
            self.draft.wake_up()

    def close(self) -> None:
        """Release the draft model's engine and give the draft its own attention back."""
        if self.draft is not None:
            self._drafting.clear()
            self.draft.close()
            attention.uninstall(self.config.model)
            self.draft = None


def check_draft(
    draft: torch.nn.Module, target: torch.nn.Module, target_vocab: int, draft_text_config: Any, max_model_len: int
) -> None:
    """A draft model hybridkv can run beside `target` (served up to `max_model_len`): another module, not patched,
    running none of the model's own layers, of the same vocabulary and a context at least `max_model_len` long."""
    if not isinstance(draft, torch.nn.Module):
        raise TypeError(f"speculative_config's model must be a transformers causal LM, got {type(draft).__name__}")
    if draft is target:
        raise ValueError("speculative_config's draft model is the model itself; give a smaller model (or use 'ngram')")
    if "_hybridkv_engine" in draft.__dict__:
        raise ValueError("speculative_config's draft model is patched already; hybridkv.unpatch(draft) first")
    draft_vocab = getattr(draft_text_config, "vocab_size", None)
    if draft_vocab != target_vocab:
        raise ValueError(
            f"the draft model's vocabulary ({draft_vocab} tokens) is not the model's ({target_vocab}); a draft must "
            "share the model's tokenizer"
        )
    # A layer's attention reads its implementation from the config it was built with: the model's, for one of the
    # model's layers, which the draft's engine cannot switch to its own steps.
    model_modules = {id(module) for module in target.modules()}
    shared = [
        name
        for name, module in draft.named_modules()
        if id(module) in model_modules and hasattr(module, "config") and hasattr(module, "layer_idx")
    ]
    if shared:
        names = ", ".join(shared[:2]) + (", ..." if len(shared) > 2 else "")
        raise ValueError(
            f"speculative_config's draft model runs the model's own attention layers ({names}), which read their "
            "attention implementation from the model's config, not the draft's; give the draft copies of them "
            "(copy.deepcopy, as benchmarks/speculative.py's draft of the model's first layers)"
        )
    context = context_length(draft_text_config) if draft_text_config is not None else None
    if context is not None and context[0] < max_model_len:
        length, source = context
        raise ValueError(
            f"the draft model's context ({source}) is shorter than the model's max_model_len={max_model_len}, and "
            f"it proposes at every length the model serves; pass max_model_len <= {length}, or give a draft of a "
            "longer context"
        )


def speculation_stats(speculator: Speculator | None, stores_proposals: bool) -> dict[str, Any]:
    """`stats()`'s speculative decoding counts (zeros without it): the method, proposals checked (drafts: a request's
    step that checked any), proposed and kept tokens, per position how many drafts kept their proposal there (vLLM's
    num_accepted_tokens_per_pos), and the seconds spent proposing."""
    if speculator is None:
        return {
            "spec_method": None,
            "spec_proposals_stored": False,
            "spec_num_drafts": 0,
            "spec_num_draft_tokens": 0,
            "spec_num_accepted_tokens": 0,
            "spec_acceptance_rate": 0.0,
            "spec_accepted_per_position": [],
            "spec_propose_seconds": 0.0,
            "spec_skipped_steps": 0,
        }
    drafts = speculator.num_draft_tokens
    return {
        "spec_method": speculator.config.method,
        # Whether a kept proposal's K/V stays where its row stored them (full-attention groups only), else it is
        # computed again in the next step.
        "spec_proposals_stored": stores_proposals,
        "spec_num_drafts": speculator.num_drafts,
        "spec_num_draft_tokens": drafts,
        "spec_num_accepted_tokens": speculator.num_accepted_tokens,
        "spec_acceptance_rate": speculator.num_accepted_tokens / drafts if drafts else 0.0,
        "spec_accepted_per_position": list(speculator.accepted_per_position),
        "spec_propose_seconds": speculator.propose_seconds,
        # Steps a request made without proposals because its last checks kept none (the backoff).
        "spec_skipped_steps": speculator.num_skipped,
    }
