"""`EngineConfig`: every setting `hybridkv.patch(model, **config)` accepts."""

from __future__ import annotations

import difflib
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, get_args

from hybridkv.execution.kv_dtypes import KVCacheDtype, normalize_kv_cache_dtype
from hybridkv.execution.kv_events_config import KVEventsConfig
from hybridkv.execution.speculative_config import SpeculativeConfig
from hybridkv.kernels.backend import Backend
from hybridkv.scheduling.scheduler import PREEMPTION_MODES
from hybridkv.scheduling.validation import check_bool, check_choice, check_float, check_int

ATTENTION_BACKENDS = (None, *get_args(Backend))
GENERATION_CONFIGS = ("auto", "vllm")  # vLLM's values but a folder's path (load its GenerationConfig yourself)
GIB = 1 << 30
# The disk tier's bound when prefix_cache_dir is given without one.
DEFAULT_PREFIX_CACHE_DIR_SIZE = 10.0
DEFAULT_SWAP_SPACE = 4  # GiB, vLLM's default
# The most of the host's memory swap space may ask for (vLLM's CacheConfig refuses more than 70% of total CPU memory).
MAX_SWAP_SHARE = 0.7


def checked_folder(folder: str | os.PathLike) -> Path:
    """`prefix_cache_dir` as a folder this process can write (made if missing); else a ValueError naming it."""
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"prefix_cache_dir must be a folder path, got {type(folder).__name__}")
    path = Path(folder).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"prefix_cache_dir={str(folder)!r} is a file; name a folder (it is made if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"prefix_cache_dir={str(folder)!r} cannot be made: {error}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(
            f"prefix_cache_dir={str(folder)!r} is not writable by this process; name a folder it can write"
        )
    return path


def host_memory_bytes() -> int | None:
    """The host's physical memory in bytes, or None where the platform does not say (no `os.sysconf`)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


@dataclass(frozen=True)
class EngineConfig:
    """Everything `hybridkv.patch(model, **config)` accepts (names follow vLLM).

    KV memory: `num_blocks` if given, else `kv_cache_memory` bytes, else on CUDA
    `gpu_memory_utilization` of the device, else 1 GiB on the CPU. `kv_cache_dtype`: the pages' dtype,
    one for every layer or one per layer kind, fp8 included (hybridkv/execution/kv_dtypes.py). With
    `preemption_mode="swap"`, `swap_space` GiB of CPU memory (vLLM's unit and default, 4) hold preempted requests'
    blocks (never more blocks than the device pool; with state layers, up to half of it holds their states, one CPU slot
    per swapped request); with "recompute" none is taken. More than 70% of the host's memory is an error (vLLM's
    rule), in either mode, but the default with "recompute" asks for nothing. `generation_config`: "auto" (vLLM's
    default) gives a request without sampling settings the model's generation config's
    (`LLMEngine.get_default_sampling_params`), "vllm" SamplingParams'. `cpu_threads`: torch threads for the steps of a
    model on the CPU: "auto" (the cores other processes leave free, at most torch's count;
    hybridkv/execution/cpu_threads.py), a count, or None (torch's setting as it is).
    `enforce_eager` (vLLM's name): False runs decode steps in graph mode, padded to bucket sizes and, on a
    single GPU, replayed as captured CUDA graphs (hybridkv/execution/graphs.py; elsewhere run eagerly over the same
    padded buffers, which tests what a GPU captures); True runs every step eagerly, unpadded; None (default)
    is graph mode on a single CUDA device and eager elsewhere. `compile`: the forward traced once by
    `torch.compile`, split at attention and its distinct pieces compiled by inductor, kept on disk for the next
    process (hybridkv/execution/compilation.py): True compiles (a model that cannot be compiled is an error), False
    never does, None (default) compiles where CUDA graphs are captured, over which they are captured, and runs
    eagerly elsewhere (on the CPU compiling costs more set-up than it saves: benchmarks/RESULTS.md); a model
    that cannot be compiled then runs eagerly with a warning. `use_tqdm`: progress bars for set-up that takes
    a while (compiling, capturing CUDA graphs); `logging.getLogger("hybridkv")` logs each stage either way.
    `async_scheduling` (vLLM's name): the next step is planned and launched while the device runs this one, whose
    tokens are read after (hybridkv/engine/async_steps.py): True, False, or None (default) on where the model runs on
    one CUDA device (the host's work then hides behind the GPU's) and off elsewhere (on the CPU the host and the
    forward share the cores: nothing runs beside the step). A tensor-parallel model never schedules ahead.

    A model with state layers keeps, with prefix caching on, `num_state_checkpoints` states at block boundaries of
    computed prefixes (default `max_num_seqs`; 0: no hit on such a model), one every `state_checkpoint_interval`
    tokens (default: the smallest multiple of every group's block size and of the state layers' scan chunk, so
    that a computation split there continues exactly): a prefix-cache hit restores the state at its end.

    A model that takes images keeps up to `encoder_cache_bytes` of image embeddings by content hash, so that
    an image seen again skips the vision tower (hybridkv/execution/multimodal.py).

    Tiers beyond the pool (hybridkv/memory/tiers.py): `kv_offloading_size` GiB of host memory (vLLM's name; its
    `kv_offloading_backend` "native" is the one backend) keep the blocks the pool evicts, least recently used going
    first; `prefix_cache_dir` a folder where computed blocks are written and read by later processes of the same
    model, at most `prefix_cache_dir_size` GiB (default 10; hybridkv/execution/kv_tiers.py). A prefix found there is
    copied back instead of computed.

    LoRA adapters per request (vLLM's settings; hybridkv/execution/lora.py): `enable_lora` lets requests name an adapter
    (`lora_request`), at most `max_loras` adapters run in one step (others wait), of rank at most `max_lora_rank`, and
    `max_cpu_loras` (default `max_loras`) stay read in host memory.

    `kv_events_config` (vLLM's dict, or a `KVEventsConfig`; hybridkv/execution/kv_events_config.py): with
    `enable_kv_cache_events`, the blocks the prefix cache stores and drops, in every tier, are published as vLLM's KV
    events over ZMQ (hybridkv/memory/kv_events.py), which a router's index reads (vllm-router's kv_aware policy).

    `speculative_config` (vLLM's dict: n-gram prompt lookup or a draft model; hybridkv/execution/speculative_config.py)
    proposes tokens that each step checks in the same forward (hybridkv/engine/speculation.py).

    `worker_extension_cls` (vLLM's: a class or its qualified name, "package.module.Class") adds the caller's methods to
    the worker that `collective_rpc` calls reach (hybridkv/engine/worker.py).

    Every setting is checked on construction: a wrong type is a TypeError (a bool or a float is no
    count: `num_blocks=100.0` names `num_blocks=100`), a value out of range a ValueError naming the
    rule. `from_kwargs` also names the closest settings to an unknown one.
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: KVCacheDtype = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    swap_space: float = DEFAULT_SWAP_SPACE
    generation_config: str = "auto"
    attention_backend: str | None = None
    cpu_threads: int | str | None = "auto"
    enforce_eager: bool | None = None
    compile: bool | None = None
    use_tqdm: bool = True
    async_scheduling: bool | None = None
    num_state_checkpoints: int | None = None
    state_checkpoint_interval: int | None = None
    encoder_cache_bytes: int = 256 << 20
    speculative_config: Any = None
    kv_offloading_size: float | None = None
    kv_offloading_backend: str | None = None
    prefix_cache_dir: str | os.PathLike | None = None
    prefix_cache_dir_size: float = DEFAULT_PREFIX_CACHE_DIR_SIZE
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    kv_events_config: Any = None
    worker_extension_cls: str | type | None = None

    def __post_init__(self) -> None:
        set_field = functools.partial(object.__setattr__, self)
        extension = self.worker_extension_cls
        if extension is not None and not isinstance(extension, str | type):
            raise TypeError(
                "worker_extension_cls must be a class or its qualified name ('package.module.Class'), "
                f"not {extension!r}"
            )
        counts = (
            ("block_size", 1, ""),
            ("max_num_seqs", 1, ""),
            ("max_num_batched_tokens", 1, ""),
            ("long_prefill_token_threshold", 0, " (0 turns the cap off)"),
            ("encoder_cache_bytes", 0, " (bytes of image embeddings kept for reuse; 0 keeps none)"),
        )
        for name, minimum, rule in counts:
            set_field(name, check_int(name, getattr(self, name), minimum, rule))
        optional_counts = (
            ("num_blocks", 2, " (block 0 is the null block, never used)"),
            ("kv_cache_memory", 1, " (bytes)"),
            ("max_model_len", 1, ""),
            ("num_state_checkpoints", 0, " (0: no prefix-cache hit on a model with state layers)"),
            ("state_checkpoint_interval", 1, " (tokens)"),
        )
        for name, minimum, rule in optional_counts:
            if getattr(self, name) is not None:
                set_field(name, check_int(name, getattr(self, name), minimum, rule))
        swap_space = check_float("swap_space", self.swap_space)
        if swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 (GiB of CPU memory for swapped requests), got {swap_space}")
        set_field("swap_space", swap_space)
        check_choice("generation_config", self.generation_config, GENERATION_CONFIGS)
        utilization = check_float("gpu_memory_utilization", self.gpu_memory_utilization)
        if not 0 < utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1] (the share of the device's memory hybridkv may use), "
                f"got {utilization}"
            )
        set_field("gpu_memory_utilization", utilization)
        set_field("kv_cache_dtype", normalize_kv_cache_dtype(self.kv_cache_dtype))
        set_field("speculative_config", SpeculativeConfig.of(self.speculative_config))
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        if self.compile is not None:
            check_bool("compile", self.compile)
        check_bool("use_tqdm", self.use_tqdm)
        if self.async_scheduling is not None:
            check_bool("async_scheduling", self.async_scheduling)
        if self.enforce_eager is not None:
            check_bool("enforce_eager", self.enforce_eager)
        check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if self.cpu_threads is not None and self.cpu_threads != "auto":
            if isinstance(self.cpu_threads, str):
                raise ValueError(f"cpu_threads must be 'auto', a thread count or None, got {self.cpu_threads!r}")
            set_field("cpu_threads", check_int("cpu_threads", self.cpu_threads, 1, " (or 'auto', or None)"))
        self._check_tiers()
        events = KVEventsConfig.of(self.kv_events_config)
        if events is not None and events.publishes and not self.enable_prefix_caching:
            raise ValueError(
                "kv_events_config announces prefix-cache blocks, which enable_prefix_caching=False turns off; turn "
                "prefix caching on or drop kv_events_config"
            )
        set_field("kv_events_config", events)
        self._check_swap_space_fits_the_host()
        self._check_lora()

    def _check_lora(self) -> None:
        """vLLM's LoRA settings: `max_loras` adapters in one step, of rank at most `max_lora_rank`, `max_cpu_loras`
        (default `max_loras`, at least that) kept read in host memory."""
        set_field = functools.partial(object.__setattr__, self)
        check_bool("enable_lora", self.enable_lora)
        set_field("max_loras", check_int("max_loras", self.max_loras, 1, " (adapters in one step)"))
        set_field("max_lora_rank", check_int("max_lora_rank", self.max_lora_rank, 1, " (the largest adapter rank)"))
        if self.max_cpu_loras is not None:
            cpu = check_int("max_cpu_loras", self.max_cpu_loras, 1, " (adapters kept read in host memory)")
            if cpu < self.max_loras:
                raise ValueError(f"max_cpu_loras ({cpu}) must be >= max_loras ({self.max_loras}), as in vLLM")
            set_field("max_cpu_loras", cpu)

    def _check_tiers(self) -> None:
        """The tiers beyond the pool: `kv_offloading_size` GiB of host memory (vLLM's name; with
        `kv_offloading_backend` "native", its default), `prefix_cache_dir` a folder of at most `prefix_cache_dir_size`
        GiB; both need prefix caching."""
        set_field = functools.partial(object.__setattr__, self)
        if self.kv_offloading_size is not None:
            size = check_float("kv_offloading_size", self.kv_offloading_size)
            if size < 0:
                raise ValueError(
                    f"kv_offloading_size must be >= 0 (GiB of host memory for the blocks the pool evicts), got {size}"
                )
            set_field("kv_offloading_size", size)
        backend = self.kv_offloading_backend
        if backend == "lmcache":
            raise ValueError(
                "kv_offloading_backend='lmcache' is not supported: LMCache keeps one KV layout per model and runs "
                "its own process, and hybridkv's pool holds sliding, full, latent and state layers' pages together; "
                "use kv_offloading_backend='native' (hybridkv's own host tier, and prefix_cache_dir for disk)"
            )
        if backend is not None:
            check_choice("kv_offloading_backend", backend, ("native",))
            if not self.kv_offloading_size:
                raise ValueError(
                    "kv_offloading_backend='native' needs kv_offloading_size (GiB of host memory), as in vLLM"
                )
        size = check_float("prefix_cache_dir_size", self.prefix_cache_dir_size)
        if size <= 0:
            raise ValueError(f"prefix_cache_dir_size must be > 0 (GiB the folder may hold), got {size}")
        set_field("prefix_cache_dir_size", size)
        if self.prefix_cache_dir is not None:
            set_field("prefix_cache_dir", checked_folder(self.prefix_cache_dir))
        if (self.kv_offloading_size or self.prefix_cache_dir is not None) and not self.enable_prefix_caching:
            raise ValueError(
                "kv_offloading_size and prefix_cache_dir keep prefix-cache blocks, which enable_prefix_caching=False "
                "turns off; drop them or turn prefix caching on"
            )

        # The host tier and swap space are separate budgets (a swapped request's blocks must come back; the tier's may
        # be dropped at any time), which together keep to the share of the host's memory swap space alone may take.
        host = host_memory_bytes()
        if (
            host is not None
            and self.kv_offloading_bytes
            and self.kv_offloading_bytes + self.swap_space_bytes > MAX_SWAP_SHARE * host
        ):
            room = max(0.0, MAX_SWAP_SHARE * host - self.swap_space_bytes) / GIB
            raise ValueError(
                f"kv_offloading_size={self.kv_offloading_size:g} GiB with swap_space={self.swap_space_bytes / GIB:g} "
                f"GiB is more than {MAX_SWAP_SHARE:.0%} of the host's {host:,} bytes; lower kv_offloading_size to at "
                f"most {room:.2f} GiB"
            )

    @property
    def kv_offloading_bytes(self) -> int:
        """The host memory the host tier takes: `kv_offloading_size` GiB, else 0."""
        return int((self.kv_offloading_size or 0) * GIB)

    def _check_swap_space_fits_the_host(self) -> None:
        """`swap_space` asks for at most `MAX_SWAP_SHARE` of the host's memory (vLLM's rule), else a ValueError naming
        the most it may be. With "recompute" none is taken: the default asks for nothing there (so it passes on any
        host), but a value given beyond the limit is still named as the mistake it is."""
        if self.preemption_mode != "swap" and self.swap_space == DEFAULT_SWAP_SPACE:
            return
        host = host_memory_bytes()
        requested = int(self.swap_space * GIB)
        if host is None or requested <= MAX_SWAP_SHARE * host:
            return
        unused = ", or leave it out: preemption_mode='recompute' takes none" if self.preemption_mode != "swap" else ""
        raise ValueError(
            f"swap_space={self.swap_space:g} GiB asks for {requested:,} bytes of CPU memory, more than "
            f"{MAX_SWAP_SHARE:.0%} of the host's {host:,} bytes; lower swap_space to at most "
            f"{MAX_SWAP_SHARE * host / GIB:.2f} GiB{unused}"
        )

    @property
    def swap_space_bytes(self) -> int:
        """The CPU memory swapped requests may take: `swap_space` GiB with `preemption_mode="swap"`, else 0."""
        return int(self.swap_space * GIB) if self.preemption_mode == "swap" else 0

    @classmethod
    def from_kwargs(cls, **config: Any) -> EngineConfig:
        """`EngineConfig(**config)`, where an unknown setting is a TypeError naming the closest valid
        ones (a typo such as `blok_size=8` would otherwise be the dataclass's bare complaint)."""
        names = [field.name for field in fields(cls)]
        unknown = [name for name in config if name not in names]
        if unknown:
            plural = "s" if len(unknown) > 1 else ""
            raise TypeError(
                f"unknown hybridkv setting{plural} {with_guesses(unknown, names)}; the settings are {', '.join(names)}"
            )
        return cls(**config)


def with_guesses(unknown: Sequence[str], known: Sequence[str]) -> str:
    """The unknown names, each with the closest of the known ones: "'blok_size' (did you mean block_size?)"."""
    guesses = []
    for name in unknown:
        close = difflib.get_close_matches(name, known)
        guesses.append(f"{name!r} (did you mean {' or '.join(close)}?)" if close else repr(name))
    return ", ".join(guesses)
