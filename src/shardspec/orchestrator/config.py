"""What an engine runs and where: one `EngineConfig`, checked once when it is made.

`connect(...)`, `shardspec generate` and `shardspec serve` all build one; a bad value raises
ValueError naming the field and what it may be. The ranges that the wire also checks (slots,
context, prefill chunk, drafts, group timeout, world size) are read from the protocol's message
fields, so the two cannot drift apart.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardspec import security
from shardspec.protocol import transport
from shardspec.protocol.messages import LOOKAHEAD_MODES, InitRequest, LoadRequest, WorkerOptions
from shardspec.security import KeyPair
from shardspec.utils import DTYPE_CHOICES, check_address, default_device, parse_size

if TYPE_CHECKING:
    from shardspec.models.checkpoint import Checkpoint
    from shardspec.models.hub import HubModel

FORCED_ACCEPTANCE_ENV = "SHARDSPEC_BENCHMARK_FORCED_ACCEPTANCE"
DEFAULT_DRAFT_TOKENS = 3
DEFAULT_DIST_TIMEOUT_S = 60.0  # a collective waiting longer for a peer fails, and its worker goes back to idle
DEFAULT_CONNECT_TIMEOUT_S = 120.0
MAX_CONNECT_TIMEOUT_S = 86400.0
MTP_MODES = {None: "auto", True: "on", False: "off"}
MAX_GRAMMAR_COMPILERS = 64
MIN_GRAMMAR_MEMORY = 256 << 20  # a compile process holds Python, llguidance and the tokenizer


BUNDLED_MODEL = Path(__file__).parents[1] / "bundled"  # the tiny model in the package: the default model


def message_range(message: type, name: str) -> tuple[Any, Any]:
    """The [lo, hi] that the wire accepts for a field of a message."""
    return message.__dataclass_fields__[name].metadata["range"]


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """The model, its workers, and how the engine decodes."""

    model: str = str(BUNDLED_MODEL)
    """Hugging Face-style model folder (a path-like is taken as its string), or a Hub id ORG/NAME[@REVISION]
    (fetched with huggingface_hub: this side reads config and tokenizer, each worker only the safetensors files of
    its layers; a path that exists is a folder). For workers given by address, a folder this side lacks is the
    path on the workers; workers that lack a model this side has receive their tensors from it. By default the
    bundled tiny model."""

    workers: list[str] | None = None
    """Addresses of running workers (tcp://HOST:PORT or ipc://PATH), in rank order; None: spawn local ones."""

    local: int | None = None
    """How many workers to spawn on this machine (default: tp, else 1); not together with `workers`."""

    device: str = field(default_factory=default_device)
    """Device of spawned workers: cpu, or cuda (one GPU each); default: cuda where this machine has a GPU, else cpu
    (as `shardspec generate` and `serve`)."""

    tp: int | None = None
    """Tensor-parallel degree of each stage; it must equal the worker count ÷ pp when both are given."""

    pp: int = 1
    """Pipeline stages: the workers, in rank order, are pp stages of tp ranks each (stage 0's first)."""

    ep: int = 1
    """Expert parallelism of mixture-of-experts models: each stage's tp ranks form ep groups, each holding
    num_experts ÷ ep whole experts, each expert's width split over the tp ÷ ep ranks of its group (1: every rank
    a slice of every expert; tp: whole experts per rank). It must divide tp and the expert count."""

    layer_split: list[int] | None = None
    """Decoder layers per stage, in stage order (they sum to the model's layers); None: as even as can be."""

    dtype: str = "auto"
    """Weights and activations: auto (the checkpoint's dtype on CPU, bfloat16 on GPU), float32, bfloat16, float16."""

    max_seqs: int = 8
    """Sequences generated at once (cache slots per worker); more requests wait for a free slot."""

    max_seq_len: int | None = None
    """The most tokens of a sequence, prompt and output; None: the model's context (max_position_embeddings)."""

    cache_memory: int | str | None = None
    """Bytes of each worker's cache, its K/V blocks and the recurrent states of max_seqs sequences (an int, or
    a size such as "512MiB" or "2GiB"); None: 90 % of a GPU less its weights and 1 GiB kept for CUDA graphs, or
    1 GiB on a CPU. A worker takes no more than max_seqs sequences of max_seq_len can use."""

    prefix_cache: bool = True
    """Prefix caching: K/V blocks and recurrent states a prompt shares with earlier requests' prompts and outputs
    are reused instead of prefilled again (docs/architecture.md, "Prefix caching"); its saved recurrent states
    take at most an eighth of cache_memory past the sequences' own."""

    prefill_chunk: int = 2048
    """The most prompt tokens one prefill pass takes; prompts prefilled together share it, at least 64 each."""

    mtp: bool | None = None
    """None: speculative decoding with the checkpoint's MTP head when it has one; True: require it; False: plain."""

    draft_tokens: int = DEFAULT_DRAFT_TOKENS
    """MTP drafts verified per step."""

    deterministic: bool = False
    """Batch-invariant decoding: a sequence's greedy output is the same whatever else runs with it and with or
    without MTP, in every dtype (docs/architecture.md, "Deterministic decoding"); costs throughput."""

    pipeline: bool = True
    """Keep the next step on the wire while the current one runs."""

    lookahead: str = "auto"
    """Pipeline stages with MTP: while a sequence decoding alone waits for its step's result from the last
    stage, the earlier stages run its next step on the last stage's guess (all drafts kept, the guessed next
    token), and again when the guess was wrong; the output is the same either way (CPU workers; CUDA
    workers, which replay graphs, wait). "auto": the last stage guesses for its first 16 guesses, then while
    at least 5 % of its last 64 held (and at one lone step in 16 otherwise); "on": always; "off": never;
    "tree": the earlier stages run the next step for several outcomes of the step in flight at once
    (a tree of guesses, branches.py)."""

    tree_width: int = 0
    """lookahead="tree": branches per guess; 0 adaptive (the width whose lone steps made the most tokens a
    second, measured in turn)."""

    relay: bool | None = None
    """Stage links: None: worker to worker, through this engine where a direct link cannot be opened; True:
    always through this engine (hosts that reach it but not each other); False: worker to worker only."""

    micro_batches: int | None = None
    """Micro-batches the running sequences are split into, each stepped on its own so that every pipeline stage
    has work at once (a stage runs one micro-batch while the next stage runs another); None: pp (at most max_seqs)."""

    forced_acceptance: float | None = None
    """Benchmarks only: accept each draft with this probability whatever the model says (see FORCED_ACCEPTANCE_ENV)."""

    dist_port: int | None = None
    """Port of the process group's rendezvous on rank 0's host (default: the first port above rank 0's that no
    worker listens on, or a free one for ipc:// workers)."""

    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S
    """Seconds to wait for every worker to answer its first hello (spawned ones are still starting); a worker
    given by address whose connections are refused fails sooner (workers.REFUSED_GRACE_S)."""

    keys: str | None = None
    """CURVE for tcp:// workers: this side's key pair (a folder or .key_secret file)."""

    server_keys: str | None = None
    """CURVE: the workers' public keys (one .key file for all, or a folder with one per worker, rank order)."""

    heartbeat_timeout: float = transport.DEFAULT_HEARTBEAT_TIMEOUT_S
    """Seconds after which a worker that exited or stopped answering is declared lost; its requests fail,
    and the engine reconnects until the worker is back (engine.healthy)."""

    dist_timeout: float = DEFAULT_DIST_TIMEOUT_S
    """How long a worker's collective waits for a stuck peer before it gives up."""

    step_timeout: float = 0.0
    """Seconds a step's replies may take; a worker silent past it is named and handled as lost (its requests
    fail, the engine reconnects). 0: derived from the step's tokens and the step times measured since the
    model loaded, never under 30s (group.StepWatchdog). A hung worker still answers heartbeats."""

    grammar_compilers: int = 2
    """Structured output: processes that compile constraints at once (each compiles one, checks that it
    can start and times its first mask; more wait). They run at the lowest CPU priority."""

    grammar_timeout: float = 10.0
    """Structured output: CPU seconds a constraint may take to compile (ten times that in wall time on a busy
    host); past them it is refused (a 400)."""

    grammar_memory: int | str = "2GiB"
    """Structured output: the address space of each compile process (an int of bytes, or a size such as
    "2GiB"); a constraint that needs more is refused."""

    grammar_budget: float = 0.2
    """Structured output: seconds a sequence's grammar masks may take in one step on the workers; a sequence
    over it fails alone. A constraint whose first mask takes over a quarter of it is refused up front."""

    hub_model: HubModel | None = None
    """Set when a Hub id is resolved (check_model_folder): its commit and the local folder of its small files."""

    model_key: str = ""
    """Set when the model is resolved: what identifies its contents in the workers' shard caches ("": unknown)."""

    worker_options: WorkerOptions = field(default_factory=WorkerOptions)
    """How the workers compute (kernels, all-reduce, draft head, launch-ahead, ...; each field's help is in
    protocol.messages.WorkerOptions): sent to every worker when the group forms, so no worker needs them set."""

    def __post_init__(self) -> None:
        self._check_workers()
        self._check_decoding()
        if not isinstance(self.worker_options, WorkerOptions):
            raise ValueError(f"worker_options must be a shardspec.WorkerOptions, got {self.worker_options!r}")
        self._check_forced_acceptance()
        self._check_connection()
        self._check_grammars()

    # --- what the rest of the engine reads ---------------------------------------------------------

    @property
    def spawns_workers(self) -> bool:
        return self.workers is None

    @property
    def world_size(self) -> int:
        if self.workers is not None:
            return len(self.workers)
        return self.local or (self.tp or 1) * self.pp

    @property
    def tp_size(self) -> int:
        return self.world_size // self.pp

    def stage_ranks(self) -> list[list[int]]:
        """The ranks of each pipeline stage, in stage order."""
        return [list(range(s * self.tp_size, (s + 1) * self.tp_size)) for s in range(self.pp)]

    def load_request(self) -> LoadRequest:
        model_dir = Path(self.model)
        if self.hub_model is not None:
            model = self.hub_model.pinned
        else:
            model = str(model_dir.resolve()) if model_dir.exists() else self.model
        return LoadRequest(
            model=model,
            model_key=self.model_key,
            dtype=self.dtype,
            max_seqs=self.max_seqs,
            max_seq_len=self.max_seq_len or 0,
            cache_bytes=self.cache_memory or 0,
            prefix_cache=self.prefix_cache,
            prefill_chunk=self.prefill_chunk,
            mtp=MTP_MODES[self.mtp],
            draft_tokens=self.draft_tokens,
            forced_acceptance=-1.0 if self.forced_acceptance is None else self.forced_acceptance,
            layer_split=list(self.layer_split or []),
            deterministic=self.deterministic,
            expert_parallel=self.ep,
            lookahead=self.lookahead if self.pp > 1 else "off",
            tree_width=self.tree_width,
            progress=True,  # (WorkerGroup takes the LoadProgress messages; a raw client gets none)
            grammar_budget_s=self.grammar_budget,
        )

    # --- checks that read files --------------------------------------------------------------------

    def check_model_folder(self) -> None:
        """The folder is a model (spawned workers read it here) and has MTP weights if MTP is required;
        its config splits as asked. From the checkpoint's config and headers: no model is built. A Hub id
        is resolved first (its small files fetched; `model` becomes their folder)."""
        self._resolve_model()
        model_dir = Path(self.model)
        if self.spawns_workers and not (model_dir / "config.json").is_file():
            raise ValueError(f"{self.model} is not a model folder (no config.json)")
        if not (model_dir / "config.json").is_file():
            return  # the workers' folder, on their hosts: they check it
        checkpoint = _open_checkpoint(model_dir)
        if self.mtp and not _has_mtp(checkpoint):
            raise ValueError(f"MTP asked for, but {self.model} has no MTP weights (mtp.*); use mtp=False / --no-mtp")
        _check_split(checkpoint, self.pp, self.layer_split, self.tp_size, self.ep)
        if self.hub_model is None:  # (a Hub model's weights are fetched by the workers: they check them)
            _check_quantization(checkpoint, self.tp_size, self.spawns_workers and self.device == "cuda")

    def _resolve_model(self) -> None:
        from shardspec.models import hub
        from shardspec.models.config import ConfigError
        from shardspec.models.shard_files import folder_key, hub_key

        ref = hub.parse_ref(self.model) if self.hub_model is None else None
        try:
            if ref is not None:
                self.hub_model = hub.resolve(ref)
                self.model, self.model_key = str(self.hub_model.folder), hub_key(self.hub_model.pinned)
            elif self.hub_model is None and (Path(self.model) / "config.json").is_file():
                self.model_key = folder_key(_open_checkpoint(Path(self.model)))
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        except OSError as exc:
            raise ValueError(f"{self.model}: {exc}") from None

    def link_frame_bytes(self) -> int:
        """The largest frame a stage link carries: one pass's hidden states in float32, at the most
        tokens a pass takes (a prefill chunk, 64 a prompt at least, or a verify pass of k + 1 a
        sequence and a lookahead's as many). Without the model folder here, the largest hidden size a
        config may have."""
        from shardspec.models.config import DIMENSION_LIMITS
        from shardspec.protocol.codec import MAX_HEADER_BYTES

        hidden = DIMENSION_LIMITS["hidden_size"][1]
        if (Path(self.model) / "config.json").is_file():
            hidden = _open_checkpoint(Path(self.model)).config.hidden_size
        tokens = max(self.prefill_chunk, self.max_seqs * max(64, 2 * (self.draft_tokens + 1)))
        return MAX_HEADER_BYTES + 4 * hidden * tokens

    def curve_links(self) -> list[tuple[KeyPair | None, bytes | None]]:
        """Per rank: (this side's key pair, that worker's public key); (None, None) without CURVE."""
        if self.keys is None or self.server_keys is None:
            return [(None, None)] * self.world_size
        try:
            pair, publics = security.load_pair(self.keys), security.load_public_keys(self.server_keys)
        except security.KeyFileError as exc:
            raise ValueError(str(exc)) from None
        if len(publics) not in (1, self.world_size):
            raise ValueError(f"server_keys holds {len(publics)} public keys for {self.world_size} workers: give one, "
                             "or one per worker")
        return [(pair, publics[rank % len(publics)]) for rank in range(self.world_size)]

    # --- checks of the values ----------------------------------------------------------------------

    def _check_workers(self) -> None:
        if not isinstance(self.model, str | os.PathLike) or not os.fspath(self.model):
            raise ValueError(f"model must be a model folder's path, got {self.model!r}")
        self.model = os.fspath(self.model)
        if self.workers is not None and self.local is not None:
            raise ValueError("give either workers (addresses) or local (a count), not both")
        lo, hi = message_range(InitRequest, "world_size")
        if self.workers is not None:
            if isinstance(self.workers, str) or not isinstance(self.workers, list | tuple):
                raise ValueError(f"workers must be a list of addresses, got {self.workers!r}")
            if not self.workers:
                raise ValueError("workers is an empty list")
            try:
                self.workers = [check_address(address) for address in self.workers]
            except ValueError as exc:
                raise ValueError(f"workers: {exc}") from None
            if repeated := sorted({a for a in self.workers if self.workers.count(a) > 1}):
                raise ValueError(f"workers: each address once (one worker serves one rank), got {repeated[0]} "
                                 f"{self.workers.count(repeated[0])} times")
        for name in ("local", "tp"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or not lo <= value <= hi):
                raise ValueError(f"{name} must be a worker count in [{lo}, {hi}], got {value!r}")
        if len(self.workers or ()) > hi:
            raise ValueError(f"workers lists {len(self.workers)} addresses; at most {hi} can form a group")
        if type(self.pp) is not int or not lo <= self.pp <= hi:
            raise ValueError(f"pp must be a stage count in [{lo}, {hi}], got {self.pp!r}")
        given = f"{self.world_size} worker addresses given" if self.workers is not None else f"local={self.local}"
        if self.world_size % self.pp:
            raise ValueError(f"pp={self.pp} stages but {given}: the workers must be a multiple of pp")
        if self.tp is not None and self.tp != self.tp_size:
            if self.pp == 1:
                raise ValueError(f"tp={self.tp} but {given}: tp must equal the worker count")
            raise ValueError(f"tp={self.tp} × pp={self.pp} make {self.tp * self.pp} workers, but {given}: tp × pp must "
                             "equal the worker count")
        lo, hi = message_range(LoadRequest, "expert_parallel")
        if type(self.ep) is not int or not lo <= self.ep <= hi:
            raise ValueError(f"ep must be an expert-parallel degree in [{lo}, {hi}], got {self.ep!r}")
        if self.layer_split is not None:
            split = self.layer_split
            if not isinstance(split, list | tuple) or len(split) != self.pp or not all(
                    type(n) is int and n >= 1 for n in split):
                raise ValueError(f"layer_split must give each of the {self.pp} stages a positive layer count, "
                                 f"got {split!r}")
            self.layer_split = list(split)

    def _check_decoding(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        if isinstance(self.cache_memory, str):
            try:
                self.cache_memory = parse_size(self.cache_memory)
            except ValueError as exc:
                raise ValueError(f"cache_memory: {exc}") from None
        lo, hi = message_range(LoadRequest, "cache_bytes")
        if self.cache_memory is not None and (type(self.cache_memory) is not int or not 1 <= self.cache_memory <= hi):
            raise ValueError(f"cache_memory must be a number of bytes in [1, {hi}] or a size such as 512MiB, "
                             f"got {self.cache_memory!r}")
        if self.max_seq_len is not None and (type(self.max_seq_len) is not int or self.max_seq_len < 1):
            raise ValueError(f"max_seq_len must be a positive number of tokens (or None: the model's context), "
                             f"got {self.max_seq_len!r}")
        for name in ("max_seqs", "max_seq_len", "prefill_chunk", "draft_tokens", "tree_width"):
            if getattr(self, name) is None:
                continue
            lo, hi = message_range(LoadRequest, name)
            value = getattr(self, name)
            if type(value) is not int or not lo <= value <= hi:
                raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
        if self.mtp is not None and type(self.mtp) is not bool:
            raise ValueError(f"mtp must be None (auto), True or False, got {self.mtp!r}")
        if type(self.pipeline) is not bool:
            raise ValueError(f"pipeline must be True or False, got {self.pipeline!r}")
        if self.lookahead not in LOOKAHEAD_MODES:
            raise ValueError(f"lookahead must be one of {LOOKAHEAD_MODES}, got {self.lookahead!r}")
        if self.relay is not None and type(self.relay) is not bool:
            raise ValueError(f"relay must be None (auto), True or False, got {self.relay!r}")
        if self.micro_batches is None:
            self.micro_batches = min(self.pp, self.max_seqs)
        if type(self.micro_batches) is not int or not 1 <= self.micro_batches <= self.max_seqs:
            raise ValueError(f"micro_batches must be an integer in [1, max_seqs={self.max_seqs}], "
                             f"got {self.micro_batches!r}")

    def _check_forced_acceptance(self) -> None:
        rate = self.forced_acceptance
        if rate is None:
            return
        if os.environ.get(FORCED_ACCEPTANCE_ENV) != "1":
            raise ValueError(f"forced acceptance is a benchmarking switch that changes the output; set "
                             f"{FORCED_ACCEPTANCE_ENV}=1 to enable it")
        if type(rate) not in (int, float) or not 0.0 <= rate <= 1.0:
            raise ValueError(f"forced acceptance must be a probability in [0, 1], got {rate!r}")
        if self.mtp is False:
            raise ValueError("forced acceptance needs MTP on")

    def _check_connection(self) -> None:
        self.heartbeat_timeout = transport.check_heartbeat_timeout(self.heartbeat_timeout)
        self.dist_timeout = _seconds("dist_timeout", self.dist_timeout, *message_range(InitRequest, "timeout_s"))
        self.connect_timeout = _seconds("connect_timeout", self.connect_timeout, 0.1, MAX_CONNECT_TIMEOUT_S)
        self.step_timeout = _seconds("step_timeout", self.step_timeout, 0.0, MAX_CONNECT_TIMEOUT_S)
        if self.dist_port is not None and (type(self.dist_port) is not int or not 0 < self.dist_port < 65536):
            raise ValueError(f"dist_port must be a port in [1, 65535], got {self.dist_port!r}")
        if (self.keys is None) != (self.server_keys is None):
            raise ValueError("CURVE needs both keys (this side's pair) and server_keys (the workers' public keys)")
        if self.keys is not None and self.spawns_workers:
            raise ValueError("keys apply to workers given by address (tcp://); spawned local workers use ipc://")


    def _check_grammars(self) -> None:
        if type(self.grammar_compilers) is not int or not 1 <= self.grammar_compilers <= MAX_GRAMMAR_COMPILERS:
            raise ValueError(f"grammar_compilers must be an integer in [1, {MAX_GRAMMAR_COMPILERS}], got "
                             f"{self.grammar_compilers!r}")
        self.grammar_timeout = _seconds("grammar_timeout", self.grammar_timeout, 0.1, MAX_CONNECT_TIMEOUT_S)
        self.grammar_budget = _seconds("grammar_budget", self.grammar_budget, *message_range(LoadRequest,
                                                                                             "grammar_budget_s"))
        if isinstance(self.grammar_memory, str):
            try:
                self.grammar_memory = parse_size(self.grammar_memory)
            except ValueError as exc:
                raise ValueError(f"grammar_memory: {exc}") from None
        if type(self.grammar_memory) is not int or self.grammar_memory < MIN_GRAMMAR_MEMORY:
            raise ValueError(f"grammar_memory must be at least {MIN_GRAMMAR_MEMORY >> 20} MiB, got "
                             f"{self.grammar_memory!r}")


def _seconds(name: str, value: Any, lo: float, hi: float) -> float:
    if type(value) not in (int, float) or math.isnan(value) or not lo <= value <= hi:
        raise ValueError(f"{name} must be a number of seconds in [{lo:g}, {hi:g}], got {value!r}")
    return float(value)


def _open_checkpoint(model_dir: Path) -> Checkpoint:
    from shardspec.models.checkpoint import Checkpoint
    from shardspec.models.config import ConfigError

    try:
        return Checkpoint.open(model_dir)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


def _check_split(checkpoint: Checkpoint, pp: int, layer_split: list[int] | None, tp: int, ep: int) -> None:
    """The model's layers can be split into the stages asked for, and each stage's layers over its
    tp ranks with ep expert groups."""
    from shardspec.models.config import ConfigError

    try:
        checkpoint.check_split(pp, layer_split, tp, ep)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


def _check_quantization(checkpoint: Checkpoint, tp: int, gpu: bool) -> None:
    """A quantised checkpoint is one the workers run, split as asked (FP8 weights stay FP8 on a GPU,
    whose TP degree must keep their 128 × 128 blocks whole)."""
    from shardspec.models.config import ConfigError

    try:
        checkpoint.check_quantization(tp, fp8_native=gpu)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


def _has_mtp(checkpoint: Checkpoint) -> bool:
    try:
        return checkpoint.has_mtp  # tensor names only
    except Exception:
        return True  # unreadable here: let the workers say what is wrong
