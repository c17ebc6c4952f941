"""When a sample stops: every stop rule, token and text, decided in one place after each new token."""

from __future__ import annotations

from collections.abc import Iterable

from hybridkv.scheduling.detokenizer import IncrementalDetokenizer
from hybridkv.scheduling.request import Request, RequestStatus
from hybridkv.scheduling.sampling_params import SamplingParams


class StopRules:
    """The engine-wide stop rules (the model's EOS ids and max_model_len) applied with each request's
    own (max_tokens, min_tokens, stop_token_ids, ignore_eos and, through its detokenizer, stop strings)."""

    def __init__(self, eos_token_ids: Iterable[int], max_model_len: int) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def held_until_min_tokens(self, params: SamplingParams) -> tuple[int, ...]:
        """The ids a sample of `params` may not draw before its min_tokens-th output token (the sampler masks them,
        hybridkv/sampling/sampler.py): its stop token ids and, unless ignore_eos, the EOS ids; none without
        min_tokens. vLLM's MinTokensLogitsProcessor's ids; transformers' MinNewTokensLengthLogitsProcessor masks
        the EOS ids."""
        if not params.min_tokens:
            return ()
        held = set(params.stop_token_ids)
        if not params.ignore_eos:
            held |= self.eos_token_ids
        return tuple(sorted(held))

    def check(
        self, request: Request, token: int, detokenizer: IncrementalDetokenizer | None = None
    ) -> RequestStatus | None:
        """The status `request` finishes with now that `token` (already appended) is its newest, or None.

        Length first (max_tokens, None for none, and max_model_len); EOS and stop tokens only from min_tokens on (the
        sampler never draws them earlier: `held_until_min_tokens`, so they stop a sample from its min_tokens + 1-th
        token, as in vLLM and transformers); a stop
        string completed by the token's text (the detokenizer sees every token) stops the request
        whatever the token rules said, with the string as its stop_reason, once the sample has more than min_tokens
        output tokens (vLLM's detokenizer's rule: a stop string the text completes earlier is passed over). A stop
        token's id is its stop_reason; EOS leaves it None.
        """
        params = request.params
        status = None
        num_tokens = len(request.token_ids)
        num_output_tokens = num_tokens - request.num_prompt_tokens
        max_tokens = params.max_tokens
        if num_tokens >= self.max_model_len or (max_tokens is not None and num_output_tokens >= max_tokens):
            status = RequestStatus.FINISHED_LENGTH
        elif num_output_tokens >= params.min_tokens:
            if token in params.stop_token_ids:
                status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token
            elif not params.ignore_eos and token in self.eos_token_ids:
                status = RequestStatus.FINISHED_STOPPED
        if detokenizer is not None and detokenizer.add_token(token, num_output_tokens > params.min_tokens):
            request.stop_reason = detokenizer.stop_reason
            status = RequestStatus.FINISHED_STOPPED
        return status
