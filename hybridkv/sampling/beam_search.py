"""Beam search in the engine: `BeamSearchParams`, the outputs, and `BeamSearch`, one search's state.

A beam search is a group of requests (hybridkv/scheduling/request.py's SampleGroup with `beam` set), one per live beam,
in the same continuous batch as every other request. It starts as one request, the prompt. Each beam
that samples leaves its row of next-token log-probabilities here (`deposit`); when every live beam has
one, `advance` applies transformers' rule (`generate(num_beams=..., do_sample=False)`, its
`_beam_search`) to choose the next beams and the finished hypotheses:

- the K = max(2, 1 + number of EOS ids) x beam_width best continuations of all beams by cumulative
  log-probability;
- a continuation "hits" when its token is an EOS id (unless ignore_eos) or it reaches max_tokens or the
  engine's max_model_len; the first beam_width continuations that do not hit are the next beams;
- a hitting continuation among the first beam_width becomes a finished hypothesis, scored cumulative
  log-probability / generated length ** length_penalty, and the beam_width best hypotheses are kept;
- the search ends when every continuation hits, when early_stopping=True and beam_width hypotheses are
  finished, or when no running beam can beat the worst kept hypothesis (transformers' heuristic: the best
  running beam's score at its current length, or at max_tokens with early_stopping="never" and a
  positive length_penalty).

The next beams fork their parent's blocks (the scheduler's `fork`: everything shared, the diverging
partial block copied on write), a beam with no continuation is finished and returns its blocks. A
search preempted by recompute starts again from its prompt (`restart`): it is deterministic, so the
result is the same; swapped out, it comes back as a whole.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hybridkv.lora.request import AdapterRef
from hybridkv.outputs import CompletionOutput, Logprob, RequestOutput
from hybridkv.scheduling.request import Request, RequestStatus, SampleGroup
from hybridkv.scheduling.sampling_params import SamplingParams
from hybridkv.scheduling.validation import check_bool, check_float, check_int

if TYPE_CHECKING:
    from hybridkv.memory.prompt_images import PromptImages
    from hybridkv.scheduling.scheduler import Scheduler

EARLY_STOPPING = (True, False, "never")


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's names: beam_width beams, at most max_tokens new tokens each, EOS ends a beam unless
    ignore_eos. length_penalty and early_stopping (True, False or "never") mean what they mean in
    transformers' `generate`. temperature > 0 divides the logits before the log-softmax that scores
    continuations; 0 (the default) scores them by the model's own log-probabilities, as 1 does."""

    beam_width: int
    max_tokens: int = 16
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        check_int("beam_width", self.beam_width, 1)
        check_int("max_tokens", self.max_tokens, 1)
        check_bool("ignore_eos", self.ignore_eos)
        check_float("temperature", self.temperature)
        check_float("length_penalty", self.length_penalty)
        if self.temperature < 0:
            raise ValueError(
                f"temperature must be >= 0 (0 scores by the model's log-probabilities), got {self.temperature}"
            )
        if not any(self.early_stopping is choice for choice in EARLY_STOPPING):
            raise ValueError(
                f"early_stopping must be True, False or 'never' (transformers' meaning), got {self.early_stopping!r}"
            )


@dataclass
class BeamSearchSequence:
    """One hypothesis, best first in its output, vLLM's fields: `tokens` are the prompt's ids then the generated ones;
    `logprobs` one dict per generated token, the token -> its `Logprob` (the log-probability the search scored it
    by); `cum_logprob` their sum; `text` the whole sequence's (prompt and generated, special tokens kept, as vLLM
    decodes it); finish_reason "stop" (an EOS token ends it) or "length". hybridkv's: `score`, the ranking score
    (cum_logprob / generated length ** length_penalty), and the prompt's length (`output_token_ids`)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    score: float = 0.0
    num_prompt_tokens: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


@dataclass
class BeamSearchOutput:
    """The result of one prompt's beam search: its beam_width best sequences, best first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)
    request_id: str = ""

    @classmethod
    def of(cls, output: RequestOutput, params: BeamSearchParams, tokenizer: Any = None) -> BeamSearchOutput:
        """The beam search's result from its finished RequestOutput (whose outputs are its hypotheses)."""
        prompt = output.prompt_token_ids
        sequences = []
        for c in output.outputs:
            tokens = [*prompt, *c.token_ids]
            sequences.append(
                BeamSearchSequence(
                    tokens=tokens,
                    logprobs=c.logprobs or [],
                    cum_logprob=c.cumulative_logprob,
                    text=tokenizer.decode(tokens) if tokenizer is not None else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    score=c.cumulative_logprob / len(c.token_ids) ** params.length_penalty,
                    num_prompt_tokens=len(prompt),
                )
            )
        return cls(sequences, output.request_id)


@dataclass(slots=True)
class _Hypothesis:
    """A finished hypothesis while the search runs: its tokens (prompt and generated), each generated token's
    log-probability and their sum, why it ended and its ranking score."""

    tokens: list[int]
    logprobs: list[float]
    cum_logprob: float
    finish_reason: str
    score: float
    num_prompt_tokens: int

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


@dataclass(slots=True)
class _Beam:
    """A live beam: its request, the summed log-probability of its generated tokens and each one's."""

    request: Request
    cum_logprob: float
    logprobs: list[float]


class BeamSearch:
    """The state of one beam search: live beams, the rows they have deposited, finished hypotheses."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: BeamSearchParams,
        eos_token_ids: Iterable[int],
        max_model_len: int,
        block_size: int | None,
        multimodal: PromptImages | None = None,
        model_key: bytes = b"",
        lora: AdapterRef | None = None,
    ) -> None:
        self.request_id = request_id
        self.lora = lora  # every beam's LoRA adapter
        self.model_key = model_key  # the prompt's key when the search was added (a later model's is taken at admission)
        self.multimodal = multimodal  # the prompt's images: every beam carries them (a restart recomputes them)
        self.params = params
        self.width = params.beam_width
        self.prompt_token_ids = list(prompt_token_ids)
        eos = () if params.ignore_eos else tuple(dict.fromkeys(eos_token_ids))
        self.eos = frozenset(eos)
        self.num_candidates = max(2, 1 + len(eos)) * self.width
        self.max_model_len = max_model_len
        self.block_size = block_size
        # The request every beam is: greedy, never stopped by the engine's stop rules (beams leave through
        # `advance`), max_tokens only for the scheduler's bookkeeping.
        self.request_params = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True)
        self.group = SampleGroup(request_id, [])
        self.group.beam = self
        self._next_id = 0
        self.restart()

    def restart(self) -> Request:
        """Start (again) from the prompt: one new request that holds nothing; returns it."""
        prompt = self._new_request(self.prompt_token_ids)
        self.group.members = [prompt]
        self.beams = [_Beam(prompt, 0.0, [])]
        self.finished: list[_Hypothesis] = []
        self.improvable = True
        self.pending: dict[str, torch.Tensor] = {}
        return prompt

    def _new_request(self, token_ids: Sequence[int], parent: Request | None = None) -> Request:
        """A beam's request (a fork of `parent` takes its tokens' block hashes instead of hashing again)."""
        block_size = self.block_size if parent is None else None
        request = Request(
            f"{self.request_id}#beam{self._next_id}",
            token_ids,
            self.request_params,
            block_size,
            self.multimodal,
            self.model_key,
            self.lora,
        )
        if parent is not None:
            request.share_hashes(parent)
        request.num_prompt_tokens = len(self.prompt_token_ids)
        request.group = self.group
        request.sample_index = self._next_id
        self._next_id += 1
        return request

    def deposit(self, request: Request, logits: torch.Tensor) -> None:
        """Keep a beam's next-token log-probabilities (from its logits row) until every beam has one."""
        temperature = self.params.temperature
        if temperature > 0 and temperature != 1.0:
            logits = logits / temperature
        self.pending[request.request_id] = torch.log_softmax(logits.float(), dim=-1)

    @property
    def ready(self) -> bool:
        return len(self.pending) == len(self.beams) and all(b.request.request_id in self.pending for b in self.beams)

    def advance(self, scheduler: Scheduler) -> bool:
        """One beam-search step (the module docstring's rule) once every beam has deposited: forks the
        next beams from their parents and finishes the rest. True when the search is done (every beam
        finished and returned its blocks)."""
        params = self.params
        rows = torch.stack([self.pending.pop(b.request.request_id) for b in self.beams])
        scores = rows + torch.tensor([b.cum_logprob for b in self.beams], dtype=rows.dtype).unsqueeze(1)
        vocab = rows.shape[1]
        k = min(self.num_candidates, scores.numel())
        values, indices = scores.flatten().topk(k)
        values, indices = values.tolist(), indices.tolist()
        generated = self.beams[0].request.num_output_tokens + 1
        at_length = generated >= params.max_tokens or len(self.prompt_token_ids) + generated >= self.max_model_len
        penalty = generated**params.length_penalty
        full = len(self.finished) == self.width
        may_finish = self.improvable and not (full and params.early_stopping is True)
        survivors: list[tuple[_Beam, int, float]] = []
        new_finished = []
        for rank, (value, index) in enumerate(zip(values, indices, strict=True)):
            parent, token = self.beams[index // vocab], index % vocab
            hits = at_length or token in self.eos
            if not hits:
                if len(survivors) < self.width:
                    survivors.append((parent, token, value))
            elif rank < self.width and may_finish:
                new_finished.append(
                    _Hypothesis(
                        tokens=[*parent.request.token_ids, token],
                        logprobs=[*parent.logprobs, value - parent.cum_logprob],
                        cum_logprob=value,
                        finish_reason="stop" if token in self.eos else "length",
                        score=value / penalty,
                        num_prompt_tokens=len(self.prompt_token_ids),
                    )
                )
        if new_finished:
            merged = self.finished + new_finished
            order = sorted(range(len(merged)), key=lambda i: merged[i].score, reverse=True)
            self.finished = [merged[i] for i in order[: self.width]]
        done = not survivors or (len(self.finished) == self.width and params.early_stopping is True)
        if not done and len(self.finished) == self.width:
            never = params.early_stopping == "never" and params.length_penalty > 0
            best_length = params.max_tokens if never else generated
            best_possible = survivors[0][2] / best_length**params.length_penalty
            self.improvable = best_possible > min(h.score for h in self.finished)
            done = not self.improvable
        if done:
            for beam in self.beams:
                scheduler.finish(beam.request, RequestStatus.FINISHED_STOPPED)
            self.beams = []
            return True
        self.beams = self._fork_survivors(scheduler, survivors)
        self.group.members = [b.request for b in self.beams]
        return False

    def _fork_survivors(self, scheduler: Scheduler, survivors: list[tuple[_Beam, int, float]]) -> list[_Beam]:
        """The next beams: a parent's first continuation goes on in the parent's request, each other one
        is a fork of it (forked before the parent takes its token); parents without one finish first, so that
        the group never holds more than its seats' state slots (hybridkv/memory/state_slots.py)."""
        children: dict[int, list[int]] = {}
        for position, (parent, _, _) in enumerate(survivors):
            children.setdefault(id(parent), []).append(position)
        for parent in self.beams:
            if id(parent) not in children:
                scheduler.finish(parent.request, RequestStatus.FINISHED_STOPPED)
        beams: list[_Beam | None] = [None] * len(survivors)
        for parent in self.beams:
            positions = children.get(id(parent))
            if positions is None:
                continue
            for position in positions[1:]:
                _, token, value = survivors[position]
                child = self._new_request(parent.request.token_ids, parent.request)
                scheduler.fork(parent.request, child)
                child.append_token_ids([token])
                beams[position] = _Beam(child, value, [*parent.logprobs, value - parent.cum_logprob])
            _, token, value = survivors[positions[0]]
            parent.request.append_token_ids([token])
            parent.logprobs.append(value - parent.cum_logprob)
            parent.cum_logprob = value
            beams[positions[0]] = parent
        return [beam for beam in beams if beam is not None]

    def outputs(self, tokenizer: Any) -> list[CompletionOutput]:
        """The hypotheses, best first, as completions: the generated tokens, their text (decoded when a tokenizer is
        given), and each token's logprob as vLLM's dict."""
        completions = []
        for index, sequence in enumerate(self.finished):
            generated = sequence.output_token_ids
            completions.append(
                CompletionOutput(
                    index=index,
                    text=tokenizer.decode(generated, skip_special_tokens=True) if tokenizer is not None else "",
                    token_ids=generated,
                    cumulative_logprob=sequence.cum_logprob,
                    logprobs=[
                        {token: Logprob(value, None, tokenizer.decode([token]) if tokenizer is not None else None)}
                        for token, value in zip(generated, sequence.logprobs, strict=True)
                    ],
                    finish_reason=sequence.finish_reason,
                )
            )
        return completions
