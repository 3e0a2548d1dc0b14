"""Typed request and reply definitions of every op. Worker and orchestrator both import this.

Each op has a request and a reply dataclass, checked on arrival by `parse` (protocol.fields, which
also holds the field metadata: `bounded`, `one_of`, `switch`) and written by `to_meta`. The step op
(protocol.step), the model-transfer ops (protocol.shards) and the stage-link messages
(protocol.stage_link) have modules of their own; this one re-exports them and holds the op set.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from shardspec.protocol.fields import MAX_STR as MAX_STR
from shardspec.protocol.fields import bounded, one_of, switch, text
from shardspec.protocol.fields import parse as parse  # (re-exported: the ops' users parse through here)
from shardspec.protocol.fields import to_meta as to_meta
from shardspec.protocol.shards import MAX_CHUNK_BYTES as MAX_CHUNK_BYTES  # (the shard ops, re-exported)
from shardspec.protocol.shards import ChunkReply, ChunkRequest, ShardsReply, ShardsRequest
from shardspec.protocol.shards import ItemNeed as ItemNeed
from shardspec.protocol.stage_link import AcceptRecord, Guesses, HiddenStates  # (the links, re-exported)
from shardspec.protocol.step import FAILED as FAILED  # (the step op, re-exported)
from shardspec.protocol.step import GRAMMAR_KEY_CHARS, MAX_PREFIX_STATES, StepReply, StepRequest
from shardspec.protocol.step import MAX_LOGPROBS as MAX_LOGPROBS
from shardspec.protocol.step import MAX_PROMPT_TOKENS as MAX_PROMPT_TOKENS
from shardspec.protocol.step import MAX_STEP_PROMPT_TOKENS as MAX_STEP_PROMPT_TOKENS
from shardspec.protocol.step import MIN_TEMPERATURE as MIN_TEMPERATURE
from shardspec.protocol.step import MIN_TOP_P as MIN_TOP_P
from shardspec.protocol.step import BlockGrant as BlockGrant
from shardspec.protocol.step import PrefillSpec as PrefillSpec
from shardspec.protocol.step import SamplingParams as SamplingParams
from shardspec.protocol.step import SaveAt as SaveAt
from shardspec.protocol.step import SequenceError as SequenceError
from shardspec.protocol.step import TokenBias as TokenBias

MAX_DRAFT_TOKENS = 8
MAX_GRAMMAR_CHARS = 1 << 20  # a structured-output grammar (GrammarRequest.grammar; = constraints.MAX_GRAMMAR_CHARS)
MAX_GRAMMARS = 1024  # grammars a worker holds at once (GrammarRequest)


# --- worker options ---------------------------------------------------------------------------

FP8_PREFILL_MODES = ("auto", "triton")
FP8_DECODE_MODES = ("w8a8", "weight-only")
MOE_BACKENDS = ("auto", "reference", "grouped", "gathered", "fused")  # auto or one of layers.moe.EXPERT_BACKENDS
ALLREDUCE_MODES = ("auto", "shm", "symm", "gloo", "nccl")
DRAFT_HEADS = ("fp8", "bf16", "cublas")
LAUNCH_AHEAD_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class WorkerOptions:
    """How the workers compute: kernels, all-reduce, draft head, launch-ahead. Each default is the
    fastest where it applies; the others are for comparisons and for hardware where the default does
    not fit. The orchestrator sends them in init (EngineConfig.worker_options); the worker applies
    them to its whole process (kernels.use) and reports them in stats; the CLI's flags are made from
    these fields (option_flags)."""

    kernels: bool = switch(True, "Triton kernels on CUDA workers; off: PyTorch operations only")
    bf16_gemv: bool = switch(True, "bf16/fp16 matmuls of up to 16 rows through the split-K decode GEMV kernel; "
                             "off: cuBLAS (FP8 weights always take the kernel)")
    fp8_prefill: str = one_of(FP8_PREFILL_MODES, "auto", "FP8 matmuls past the decode rows: auto through "
                              "cuBLAS's blockwise FP8 where it has one, else shardspec's kernel; triton: always "
                              "shardspec's kernel")
    fp8_decode: str = one_of(FP8_DECODE_MODES, "w8a8", "FP8 matmuls of decode steps: w8a8 rounds the "
                             "activations to FP8 too (the FP8 tensor cores), weight-only keeps them bf16")
    fla: bool = switch(True, "prefill chunks of 64 tokens or more through flash-linear-attention's chunked gated "
                       "delta rule where it is installed; off: shardspec's kernel")
    moe_backend: str = one_of(MOE_BACKENDS, "auto", "how mixture-of-experts layers run their experts: auto picks "
                              "by device, dtype and rows; the others force one")
    allreduce: str = one_of(ALLREDUCE_MODES, "auto", "how a tensor-parallel group's collectives go: through "
                            "memory the ranks share (shm or symm: a shared segment for CPU workers, symmetric memory "
                            "for CUDA ones) or through the library (gloo or nccl: Gloo for CPU workers, NCCL for "
                            "CUDA ones); auto shares memory where every rank is on one host (CUDA: and its GPU "
                            "reaches the others' directly)")
    fused_norm: bool = switch(True, "with the symmetric-memory all-reduce, the all-reduce and the RMS norm after it "
                              "in one kernel; off: two")
    draft_head: str = one_of(DRAFT_HEADS, "fp8", "how MTP drafts read the LM head on CUDA: fp8 (a kernel on an "
                             "FP8 copy, half the bytes; bf16 below compute capability 8.9), bf16 (the kernel on "
                             "the head itself), cublas (the logits, then argmax)")
    launch_ahead: str = one_of(LAUNCH_AHEAD_MODES, "auto", "a single stage at TP 1 queues the next step's pass "
                               "on the device behind the current one: auto on GPUs (with CUDA graphs), on also on "
                               "CPUs (it only reorders the work), off never")
    tail_graphs: bool = switch(True, "with CUDA graphs, a single stage at TP 1 replays the prefill of a lone "
                               "prompt's chunks of up to 128 tokens (a cached conversation's next turn) from graphs "
                               "captured at load; off: eagerly")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(f.default, bool) and type(value) is not bool:
                raise ValueError(f"{f.name} must be True or False, got {value!r}")
            if "choices" in f.metadata and value not in f.metadata["choices"]:
                raise ValueError(f"{f.name} must be one of {', '.join(f.metadata['choices'])}, got {value!r}")



# --- ops --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HelloRequest:
    OP: ClassVar[str] = "hello"
    client: str = ""


@dataclass(frozen=True)
class HelloReply:
    OP: ClassVar[str] = "hello"
    protocol: int
    version: str
    device: str
    pid: int
    hostname: str
    state: str  # "idle" | "initialized" | "loaded"


@dataclass(frozen=True)
class InitRequest:
    """Join a torch.distributed group; rank 0 hosts the rendezvous at dist_addr. The world is `stages`
    pipeline stages of world_size / stages tensor-parallel ranks each, stage-major: rank r is in
    stage r // tp at TP rank r % tp."""

    OP: ClassVar[str] = "init"
    rank: int = bounded(0, 4095)
    world_size: int = bounded(1, 4096)
    dist_addr: str = "tcp://127.0.0.1:29500"
    timeout_s: float = bounded(1.0, 3600.0, 120.0)
    stages: int = bounded(1, 4096, 1)
    links: list[str] = field(default_factory=list)  # with stages > 1: every rank's stage-link address
    relay: bool = False  # stage links through the orchestrator instead of worker to worker
    link_keys: list[str] = field(default_factory=list)  # CURVE: every rank's public key (Z85), for its links
    host_ranks: int = bounded(1, 4096, 1)  # ranks of the group on this worker's host (hello's hostname)
    # the group's rendezvous store is sealed with this secret (shard_worker.group.SealedStore: keys under
    # their HMAC, values encrypted and authenticated; random per group); empty: none
    dist_secret: str = ""
    # the largest frame a stage-link inbox takes (a pass's hidden states); a peer that sends a larger
    # one is disconnected before it is read into memory. 0: no bound
    link_max_bytes: int = bounded(0, 1 << 40, 0)
    # in init, not load: the all-reduce choice is a collective of the group forming, and all hold for its life
    options: WorkerOptions = field(default_factory=WorkerOptions)

    def __post_init__(self) -> None:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is not below world_size {self.world_size}")
        if self.world_size % self.stages:
            raise ValueError(f"world_size {self.world_size} is not a multiple of stages {self.stages}")
        if self.stages > 1 and len(self.links) != self.world_size:
            raise ValueError(f"{self.stages} stages need a link address per rank ({self.world_size}), "
                             f"got {len(self.links)}")
        if self.dist_secret and not (len(self.dist_secret) <= 64 and self.dist_secret.isalnum()):
            raise ValueError("dist_secret must be at most 64 letters and digits")
        if self.link_keys and (len(self.link_keys) != self.world_size or not all(
                len(key) == 40 for key in self.link_keys)):
            raise ValueError(f"link_keys must hold one 40-character Z85 public key per rank ({self.world_size})")

    @property
    def tp_size(self) -> int:
        return self.world_size // self.stages

    @property
    def stage(self) -> int:
        return self.rank // self.tp_size

    def peer(self, stage: int) -> int:
        """The rank at this rank's TP place in `stage`: where its stage links go."""
        return stage * self.tp_size + self.rank % self.tp_size


@dataclass(frozen=True)
class InitReply:
    OP: ClassVar[str] = "init"
    rank: int
    world_size: int
    backend: str
    stage: int
    tp_rank: int
    tp_size: int
    collectives: str = ""  # how its TP group's collectives go: shm, gloo, symm, nccl ("": a group of one)


LOOKAHEAD_MODES = ("auto", "on", "off", "tree")


@dataclass(frozen=True)
class LoadRequest:
    """Load this rank's shard of a checkpoint folder and allocate caches for max_seqs sequences."""

    OP: ClassVar[str] = "load"
    model: str
    dtype: str = "auto"
    max_seqs: int = bounded(1, 4096, 8)
    max_seq_len: int = bounded(0, 1 << 22, 0)  # 0: the model's context (max_position_embeddings)
    prefill_chunk: int = bounded(1, 1 << 20, 2048)  # tokens per prefill pass (>= 64 per prompt)
    mtp: str = "auto"  # "auto": on when the checkpoint has mtp.*; "on": required; "off"
    draft_tokens: int = bounded(1, MAX_DRAFT_TOKENS, 3)
    forced_acceptance: float = bounded(-1.0, 1.0, -1.0)  # benchmarks only; < 0 = off
    layer_split: list[int] = field(default_factory=list)  # decoder layers per stage; []: as even as can be
    deterministic: bool = False  # batch-invariant decoding (ModelRunner's `deterministic`)
    expert_parallel: int = bounded(1, 4096, 1)  # MoE: groups of a stage's ranks that hold whole experts (layers.moe)
    lookahead: str = "off"  # stages with MTP: a lone sequence's next step runs on a guess (stage.ForwardingStage)
    tree_width: int = bounded(0, 16, 0)  # lookahead "tree": branches per guess, 0 adaptive (branches.TreeGuesser)
    cache_bytes: int = bounded(0, 1 << 50, 0)  # K/V blocks and recurrent states; 0: the device's default
    prefix_cache: bool = True  # room for saved recurrent states (LoadReply.prefix_states), for prefix caching
    progress: bool = False  # send the owner LoadProgress messages while the weights are read
    # structured output: the time a sequence's grammar masks may take in one step; over it, it fails alone
    grammar_budget_s: float = bounded(1e-3, 3600.0, 0.2)
    # what the model's contents are (ShardsRequest.key): where a worker without the folder finds it in its cache
    model_key: str = text(64)

    def __post_init__(self) -> None:
        if self.mtp not in ("auto", "on", "off"):
            raise ValueError(f"mtp must be 'auto', 'on' or 'off', got {self.mtp!r}")
        if self.lookahead not in LOOKAHEAD_MODES:
            raise ValueError(f"lookahead must be one of {LOOKAHEAD_MODES}, got {self.lookahead!r}")
        if any(n < 1 for n in self.layer_split):
            raise ValueError(f"layer_split must list positive layer counts, got {self.layer_split}")


@dataclass(frozen=True)
class LoadReply:
    OP: ClassVar[str] = "load"
    weight_bytes: int
    cache_bytes: int
    dtype: str
    vocab_size: int
    num_layers: int
    layers: list[int]  # [first, end) of the decoder layers this rank's stage holds
    has_mtp: bool
    draft_tokens: int  # 0: MTP off
    max_seq_len: int
    eos_token_ids: list[int]
    load_s: float
    rss_bytes: int
    kv_blocks: int  # K/V blocks the orchestrator may grant (block ids 0 .. kv_blocks - 1)
    block_tokens: int  # positions per block
    step_span: int  # positions past a sequence's length that one step may write: its blocks must cover them
    prefix_states: int  # saved recurrent states it holds for the prefix cache (ids 0 .. prefix_states - 1)
    # a finished sequence's state stays at its last committed token until released (no pass launched
    # ahead runs past it), so a release may save it (ReleaseRequest.saves)
    keeps_finished_state: bool
    # the most new tokens a prefill from a saved state runs as one pass with a state saved within it
    # (the worker's largest tail graph: shard_worker.tails), 0 for none
    one_pass_tokens: int = 0


@dataclass(frozen=True)
class SaveFinished:
    """Save a finished sequence's recurrent state (at its last committed token) as saved state `state`."""

    seq: int = bounded(0, 2**63 - 1)
    state: int = bounded(0, MAX_PREFIX_STATES - 1)



@dataclass(frozen=True)
class GrammarRequest:
    """Build the grammar `grammar` (an llguidance grammar the orchestrator checked) under `key`, for
    the sequences whose PrefillSpec.grammar names it, and forget the grammars `drop` names. The last
    stage's ranks build it on a thread of their own, so no step waits for it, and answer once it is
    built (other requests are answered meanwhile); holding it already, at once."""

    OP: ClassVar[str] = "grammar"
    key: str = text(GRAMMAR_KEY_CHARS)
    grammar: str = text(MAX_GRAMMAR_CHARS)
    drop: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class GrammarReply:
    OP: ClassVar[str] = "grammar"
    key: str
    build_s: float  # what building it took (0: it was built before)


@dataclass(frozen=True)
class ReleaseRequest:
    """Free sequences' slots and blocks; first save the recurrent states `saves` names (of sequences in `seqs`)."""

    OP: ClassVar[str] = "release"
    seqs: list[int] = field(default_factory=list)
    saves: list[SaveFinished] = field(default_factory=list)


@dataclass(frozen=True)
class ReleaseReply:
    OP: ClassVar[str] = "release"
    released: list[int]
    free_slots: int


@dataclass(frozen=True)
class StatsRequest:
    OP: ClassVar[str] = "stats"
    timeline: bool = False  # include the worker's last steps' events (StatsReply.timeline)


@dataclass(frozen=True)
class StatusRequest:
    """What a worker is doing, for anyone who may reach it (`shardspec status`): it takes no
    ownership and is answered while the worker loads too."""

    OP: ClassVar[str] = "status"


@dataclass(frozen=True)
class LoadProgress:
    """How much of its shard a loading worker has read: sent to its owner while `load` runs, a few
    times a second at most and once at the end (no reply)."""

    OP: ClassVar[str] = "progress"
    tensors_done: int = bounded(0, 1 << 40, 0)
    tensors_total: int = bounded(0, 1 << 40, 0)
    bytes_done: int = bounded(0, 1 << 60, 0)
    bytes_total: int = bounded(0, 1 << 60, 0)


@dataclass(frozen=True)
class StatusReply:
    """A worker's state: "idle", "initialized", "loading" or "loaded"; its owner's address as the
    worker sees it ("" when it has none; "local" over ipc://); the model folder's name (no path),
    the stage and decoder layers it holds; its load's progress while it loads."""

    OP: ClassVar[str] = "status"
    state: str
    owner: str
    version: str
    device: str
    hostname: str
    pid: int
    uptime_s: float
    rss_bytes: int
    device_bytes: int
    model: str = ""
    rank: int = 0
    world_size: int = 0
    stage: int = 0
    stages: int = 0
    layers: list[int] = field(default_factory=list)  # [first, end) of the stage's decoder layers
    loading: LoadProgress | None = None


@dataclass(frozen=True)
class TimelineEvent:
    """When a worker did one thing of step `step` (numbered as on the stage links, from 1 after a
    load), by its wall clock in seconds: "request" (it took the step's command), "send hidden",
    "wait hidden" / "got hidden" (the states from the stage before: waiting began, they were in),
    "send record", "wait record" / "got record" (the last stage's record of `step`), "reply"."""

    step: int = bounded(0, 2**63 - 1, 0)
    event: str = ""
    at: float = bounded(0.0, 1e12, 0.0)


@dataclass(frozen=True)
class StatsReply:
    OP: ClassVar[str] = "stats"
    state: str
    device: str
    rank: int
    world_size: int
    rss_bytes: int
    rss_anon_bytes: int
    device_bytes: int
    weight_bytes: int
    cache_bytes: int
    slots_total: int
    slots_free: int
    live_sequences: list[int]
    steps: int
    errors: int
    draft_len: int  # drafts per verify step; 0: MTP off
    drafts: int  # verify steps that checked drafts, summed over sequences
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: list[int]  # how often draft i was accepted
    step_gaps: int  # idle gaps measured between consecutive steps
    step_gap_total_s: float
    busy_s: float = 0.0  # in steps, not counting waits on stage links: 1 - Δbusy/Δwall is the idle fraction
    link_wait_s: float = 0.0  # waiting for another stage's hidden states or record
    forwarded_max: int = 0  # an earlier stage: the most steps run whose last-stage record was still to come
    lookaheads: int = 0  # an earlier stage: verify passes run on the last stage's guess (stage.ForwardingStage)
    lookaheads_right: int = 0  # of them, those whose guess held (the others ran again)
    branches: int = 0  # an earlier stage: rows of the passes run on a tree of guesses (lookahead "tree")
    launched_ahead: int = 0  # passes queued before their step came, behind the step before (runner.py: launch ahead)
    collectives: str = ""  # how its TP group's collectives go (InitReply.collectives)
    grammar_tokens: int = 0  # the last stage: tokens sampled under a grammar (structured output)
    forced_tokens: int = 0  # of them, those the grammar allowed alone (jump-forward: no choice to sample)
    grammar_s: float = 0.0  # the last stage: host time in grammar work (masks, advances), over grammar_steps steps
    grammar_steps: int = 0
    options: WorkerOptions = field(default_factory=WorkerOptions)  # in effect: the last init's
    timeline: list[TimelineEvent] = field(default_factory=list)  # when asked: the last steps' events, oldest first


@dataclass(frozen=True)
class ShutdownRequest:
    """Goodbye: the worker frees the model and the group and waits for the next orchestrator."""

    OP: ClassVar[str] = "shutdown"


@dataclass(frozen=True)
class ShutdownReply:
    OP: ClassVar[str] = "shutdown"


@dataclass(frozen=True)
class ErrorReply:
    OP: ClassVar[str] = "error"
    code: str
    message: str


# the op set: these maps are the one place that defines it (the codec's OPS derives from them)
REQUESTS: dict[str, type] = {
    cls.OP: cls
    for cls in (HelloRequest, InitRequest, LoadRequest, StepRequest, ReleaseRequest, StatsRequest, StatusRequest,
                ShutdownRequest, GrammarRequest, ShardsRequest, ChunkRequest)
}
REPLIES: dict[str, type] = {
    cls.OP: cls
    for cls in (HelloReply, InitReply, LoadReply, StepReply, ReleaseReply, StatsReply, StatusReply, LoadProgress,
                ShutdownReply, GrammarReply, ShardsReply, ChunkReply, ErrorReply)
}
LINKS: dict[str, type] = {cls.OP: cls for cls in (HiddenStates, AcceptRecord, Guesses)}
OPS = frozenset(REQUESTS) | frozenset(REPLIES) | frozenset(LINKS)
