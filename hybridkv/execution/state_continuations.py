"""State layers whose transformers code does not continue a prompt from a carried state as its prompt forward would,
continued exactly in a step.

A step runs a prompt's later piece (chunked prefill, a prefix-cache hit's rest, a recomputed request, a piece between
state checkpoints) from the state its earlier tokens left. transformers' generate never does this: it computes the
whole prompt in one forward from a zero state (the "prompt form" of a state layer), then one token a step (the
"decode form"). A state layer's code picks its form by whether the cache holds a state and how many tokens come, so a
piece of a prompt that continues a state gets the decode form where generate used the prompt form. Three are continued
here, each in the prompt form's own arithmetic from the carried state, so a prompt cut at a multiple of the layer's
scan chunk gives generate's numbers to the last bit (and within fp32 rounding elsewhere):

- **Mamba-1's selective scan** (`mamba_scan_forward`: Jamba). Over several tokens it scans from zero whatever state
  the cache holds (transformers marks it "WRONG if the cache is not empty"); one token reads the state. The prompt
  form here: its scan, position by position (`state = exp(A dt) * state + dt B x`, output `state @ C + D x`, gated by
  `silu(z)`), from the carried state instead of zero.
- **Mamba2's scan** (`mamba2_scan_forward`: Zamba2, Bamba, Granite 4, Nemotron-H, Falcon-H1). Over several tokens its
  chunked scan takes the state; one token takes the decode form, which skips the time step's floor
  (`time_step_limit`: Zamba2's is 0.001) that the chunked scan applies. A prompt's one-token piece runs the chunked
  scan from the state (`mamba2_chunk_scan`, as the prompt forward runs it); and where a floor makes the two forms
  differ, a speculating sequence's rows, which generate decodes, run the decode form one token at a time.
- **MiniMax's lightning attention** (its module's forward). With a state in its cache it runs token by token, the
  decode form, over any number of tokens; the prompt form computes blocks of `block_size` tokens (within a block
  `(Q K^T * decay) V`, across blocks through the state `K^T V`). A prompt's piece runs the blocks from the carried
  state (`continued_forward` wraps the module's forward while the runner lives).

The step's decode rows (and a speculating sequence's rows, tokens generate decodes one at a time) keep the decode
form: `StepStateCache.continues_prompt` tells them apart. Each fix replaces a function in the model's transformers
module while a runner that needs it lives (`continue_states` returns what puts it back) and computes its own way only
for hybridkv's step cache; every other call (the model's own generate, a plain forward) runs transformers' function.
The end-to-end check at patch time (hybridkv/execution/step_check.py) stays the judge: a layer that still drops its
state is refused there.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F

from hybridkv.execution.state_layers import StepStateCache
from hybridkv.memory.kv_spec import StateSpec

# The functions continued, by name in a model's transformers module, and what makes the replacement.
_FIXES: dict[str, Callable[[Callable[..., Any], dict[str, Any]], Callable[..., Any]]] = {}
# (module namespace, function name) -> (transformers' function, how many live runners use the replacement)
_installed: dict[tuple[str, str], tuple[Callable[..., Any], int]] = {}


def continue_states(modules: Iterable[torch.nn.Module]) -> Callable[[], None]:
    """Install the fix of every state layer module among `modules` whose transformers code needs one; returns the
    call that takes them back out (the function is restored when the last runner using it closes)."""
    taken: list[tuple[str, str]] = []
    for namespace in sorted({type(module).__module__ for module in modules}):
        globals_ = vars(sys.modules[namespace])
        for name, make in _FIXES.items():
            if not callable(globals_.get(name)):
                continue
            key = (namespace, name)
            original, users = _installed.get(key, (globals_[name], 0))
            if users == 0:
                globals_[name] = make(original, globals_)
            _installed[key] = (original, users + 1)
            taken.append(key)

    def restore() -> None:
        for key in taken:
            original, users = _installed.pop(key)
            if users > 1:
                _installed[key] = (original, users - 1)
            else:
                vars(sys.modules[key[0]])[key[1]] = original
        taken.clear()

    return restore


def continued_forward(module: torch.nn.Module) -> Callable[..., Any]:
    """The state layer module's forward, or, for a layer whose own forward continues a prompt in the decode form
    (MiniMax's lightning attention, found by its decay buffers and block size), one that runs a prompt's piece in
    the prompt form from the carried state."""
    forward = module.forward
    if not all(hasattr(module, name) for name in _LIGHTNING_PARTS):
        return forward

    signature = inspect.signature(forward)

    @functools.wraps(forward)
    def lightning_forward(*args: Any, **kwargs: Any) -> Any:
        arguments = signature.bind(*args, **kwargs).arguments  # segmented_forward passes the cache by position
        cache = arguments.get("cache")
        layer_idx = module.layer_idx
        if isinstance(cache, StepStateCache) and arguments.get("attention_mask") is None:
            state = cache.get_recurrent_state(layer_idx) if cache.continues_prompt(layer_idx) else None
            if state is not None:
                output, state = _lightning_blocks(module, arguments["hidden_states"], state)
                cache.update_recurrent_state(state, layer_idx)
                return output, state
        return forward(*args, **kwargs)

    return lightning_forward


_LIGHTNING_PARTS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay", "block_size", "qkv_proj", "output_gate")


def _lightning_blocks(
    module: torch.nn.Module, hidden_states: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' MiniMax lightning attention in its prompt form (its forward without a cached state), from
    `state` (`[batch, heads, head_dim, head_dim]`) instead of zero: the output rows and the last state."""
    batch_size, seq_len, _ = hidden_states.shape
    heads, head_dim, block_size = module.num_attention_heads, module.head_dim, module.block_size
    qkv_states = module.act_fn(module.qkv_proj(hidden_states)).reshape(batch_size, seq_len, heads, 3 * head_dim)
    query_states, key_states, value_states = (t.transpose(1, 2) for t in torch.split(qkv_states, head_dim, dim=3))
    attn_weights_inter = state
    attn_output = []
    for start in range(0, seq_len, block_size):
        end = min(start + block_size, seq_len)
        current = end - start
        query, key, value = (t[:, :, start:end] for t in (query_states, key_states, value_states))
        block_decay = torch.exp(-module.slope_rate * current)
        attn_weights_intra = torch.matmul(query, key.transpose(-1, -2))
        attn_output_intra = torch.matmul(attn_weights_intra * module.diagonal_decay[:, :, :current, :current], value)
        attn_output_inter = torch.matmul(query * module.query_decay[:, :current], attn_weights_inter)
        attn_output.append(attn_output_inter + attn_output_intra)
        next_attn_weights_inter = torch.matmul((key * module.key_decay[:, -current:]).transpose(-1, -2), value)
        attn_weights_inter = attn_weights_inter * block_decay + next_attn_weights_inter
    output = torch.cat(attn_output, dim=-2).transpose(1, 2).reshape(batch_size, seq_len, heads * head_dim)
    output = torch.sigmoid(module.output_gate(hidden_states)) * module.norm(output)
    return module.out_proj(output), attn_weights_inter


def _mamba_scan_from_state(original: Callable[..., Any], namespace: dict[str, Any]) -> Callable[..., Any]:
    def mamba_scan_forward(module, hidden_states, time_step, B, C, gate, cache, **kwargs):
        layer_idx = module.layer_idx
        state = None
        if isinstance(cache, StepStateCache) and (hidden_states.shape[-1] > 1 or cache.continues_prompt(layer_idx)):
            state = cache.get_recurrent_state(layer_idx, state_idx=0)
        if state is None:
            return original(module, hidden_states, time_step, B, C, gate, cache, **kwargs)
        output, state = _mamba_selective_scan(module, hidden_states, time_step, B, C, gate, state)
        cache.update_recurrent_state(state, layer_idx)
        return output

    mamba_scan_forward.__wrapped__ = original
    return mamba_scan_forward


# A Mamba2 mixer's time-step limits where none applies: its decode form and its chunked scan compute the same.
_NO_LIMIT = (0.0, float("inf"))


def decode_form_differs(model: torch.nn.Module, states: Iterable[StateSpec]) -> bool:
    """Whether a state layer of the model computes other numbers in its decode form than in its prompt form, beyond
    rounding: a Mamba2 mixer with a time-step floor (Zamba2's 0.001), which transformers' decode form skips. Such a
    model keeps state checkpoints within prompts only (a state reached through generated tokens is not the one a
    prompt of the same tokens has)."""
    named = dict(model.named_modules())
    return any(_has_time_step_floor(named[spec.module_name]) for spec in states)


def _has_time_step_floor(module: torch.nn.Module) -> bool:
    """Whether a Mamba2 mixer limits its time step (`time_step_limit`), which its decode form skips."""
    return tuple(getattr(module, "time_step_limit", _NO_LIMIT)) != _NO_LIMIT


def _mamba2_piece_from_state(original: Callable[..., Any], namespace: dict[str, Any]) -> Callable[..., Any]:
    chunk_scan = namespace.get("mamba2_chunk_scan")

    def mamba2_scan_forward(module, hidden_states, B, C, dt, cache, **kwargs):
        batch_size, seq_len, _ = hidden_states.shape
        if not isinstance(cache, StepStateCache):
            return original(module, hidden_states, B, C, dt, cache, **kwargs)
        if seq_len > 1 and _has_time_step_floor(module) and cache.decodes(module.layer_idx):
            # Speculative rows: tokens generate decodes one at a time, in the decode form, which skips the floor
            # the chunked scan applies; one token at a time here too.
            rows = [slice(index, index + 1) for index in range(seq_len)]
            return torch.cat(
                [original(module, hidden_states[:, r], B[:, r], C[:, r], dt[:, r], cache, **kwargs) for r in rows], 1
            )
        if chunk_scan is None or seq_len != 1 or not cache.continues_prompt(module.layer_idx):
            return original(module, hidden_states, B, C, dt, cache, **kwargs)
        state = cache.get_recurrent_state(module.layer_idx, state_idx=0)
        groups, state_size = module.n_groups, module.ssm_state_size
        output, state = chunk_scan(
            hidden_states.view(batch_size, 1, module.num_heads, module.head_dim),
            dt,
            -torch.exp(module.A_log.float()),
            B.view(batch_size, 1, groups, state_size),
            C.view(batch_size, 1, groups, state_size),
            chunk_size=module.chunk_size,
            D=module.D,
            z=None,
            return_final_states=True,
            dt_bias=module.dt_bias,
            dt_softplus=True,
            initial_states=state,
            dt_limit=module.time_step_limit,
            **kwargs,
        )
        cache.update_recurrent_state(state, module.layer_idx)
        return output.reshape(batch_size, 1, module.intermediate_size)

    mamba2_scan_forward.__wrapped__ = original
    return mamba2_scan_forward


def _mamba_selective_scan(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    time_step: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    gate: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Mamba-1 scan (`mamba_selective_scan`'s recurrent iteration, with `mamba_scan_forward`'s
    arguments) from `state` instead of zero: x, time step and gate `[batch, channels, seq]`, B and C `[batch, seq,
    state]`; the gated output and the last state."""
    input_dtype = hidden_states.dtype
    A = -torch.exp(module.A_log.float())
    dt = time_step
    if module.dt_proj.bias is not None:
        dt = dt + module.dt_proj.bias.float()[..., None]
    dt = F.softplus(dt)
    discrete_A = torch.exp(A[None, :, None, :] * dt[:, :, :, None])
    deltaB_u = dt[:, :, :, None] * B[:, None, :, :].float() * hidden_states[:, :, :, None].float()
    outputs = []
    for index in range(hidden_states.shape[-1]):
        state = discrete_A[:, :, index] * state + deltaB_u[:, :, index]
        outputs.append(torch.matmul(state.to(input_dtype), C[:, index, :].unsqueeze(-1))[:, :, 0])
    output = torch.stack(outputs, dim=-1) + hidden_states * module.D.float()[None, :, None]
    return output * F.silu(gate), state


_FIXES["mamba_scan_forward"] = _mamba_scan_from_state
_FIXES["mamba2_scan_forward"] = _mamba2_piece_from_state
