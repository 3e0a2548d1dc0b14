"""The sparse mixture-of-experts block of Qwen3.5 MoE, tensor- and expert-parallel.

    out = Σ_topk w_i · expert_i(x) + sigmoid(x · W_seg) · shared_expert(x)

with p = softmax(x · W_gateᵀ) in fp32, its top k renormalised to sum to 1, and every expert a
SiLU-gated MLP. The router and the shared expert's gate are replicated. The group's ranks form
`ep` groups: each group holds num_experts / ep whole experts, and each expert's intermediate width
is split over the tp / ep ranks of its group (ep = 1: every rank holds a slice of every expert;
ep = tp: whole experts per rank). The shared expert is split over all tp ranks like a dense MLP.
A rank returns its partial sum (its experts' and its shared-expert slice's), which the next RMSNorm
sums across the group: one all-reduce per layer, as for the dense MLP.

The routed experts run on one of four backends (`EXPERT_BACKENDS`), all on the same weights:
- `reference`: a loop over the experts the tokens hit, as transformers computes it (CPU; its row
  selection syncs with the host);
- `grouped`: tokens sorted by expert and two `torch.nn.functional.grouped_mm` calls (bf16 on CUDA,
  the GPU's default; no host sync, so CUDA graphs capture it);
- `gathered`: each (token, expert) row times its expert's gathered weights, in fixed blocks of
  rows: no host sync, any dtype, and batch-invariant (the GPU's path in deterministic mode and for
  float32/float16);
- `fused`: two Triton launches (kernels.moe), each (token, expert) row a GEMV of its expert's
  weights, no sorting (bf16 on CUDA at up to FUSED_ROWS rows: decode and verify steps, where the
  others are bound by their launches; no host sync).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from shardspec import kernels
from shardspec.layers.invariant import in_blocks, pointwise
from shardspec.layers.linear import MergedColumnParallelLinear, linear
from shardspec.layers.mlp import MLP, silu_mul
from shardspec.layers.parallel import SliceSpec, TPGroup
from shardspec.layers.quantization import QuantConfig

GATHER_ROWS = 64  # (token, expert) rows per block of the gathered backend: fixed shapes, bounded gathers
# (token, expert) rows up to which bf16 on CUDA takes the fused backend. It re-reads an expert for each
# row that hits it (~13 % more bytes than the distinct experts at 64 uniform rows, ~58 % at 256), and
# still beat the grouped GEMM at every size bench/moe_kernels.py measured on an H200, up to 256 rows
# (32 tokens × top 8: 389 against 473 µs; 1 token: 33 against 103): past that it is not measured
FUSED_ROWS = 256
# tokens up to which the fused kernels also run the shared expert (re-read once per token). On an H200
# at the 35B-A3B shapes, in-process: at one token it saves the shared expert's own launches for one
# more row of each kernel (a batch-1 step 3.70 ms against 4.17 without); a k = 3 step, whose verify
# pass has 4 tokens, took 7.61 ms against 7.02 with it fused up to 8 tokens (the down kernel then
# padded its slots to 16; it runs the shared expert beside them now, not yet timed past one token);
# at 8 tokens its 7 extra reads (42 MB a layer) cost more than they save (a batch-8 step through the
# engine 9.20 ms against 7.85 unfused)
SHARED_TOKENS = 1


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [N, k] in the logits' dtype, expert ids [N, k]): the top k of the fp32 softmax,
    renormalised."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(logits.dtype), ids


Range = tuple[int, int]


def expert_split(tp: TPGroup, num_experts: int, intermediate_size: int, ep: int) -> tuple[Range, Range]:
    """(this rank's experts [first, end), its rows [start, end) of each expert's width)."""
    per_group = tp.size // ep  # ranks sharing each expert
    group, member = divmod(tp.rank, per_group)
    experts, width = num_experts // ep, intermediate_size // per_group
    return (group * experts, (group + 1) * experts), (member * width, (member + 1) * width)


class Experts(nn.Module):
    """This rank's routed experts: `gate_up_proj` [E_rank, 2·I_rank, H] (each expert's gate rows, then
    its up rows) and `down_proj` [E_rank, H, I_rank], the checkpoint's fused 3-D layout. Each
    parameter's slice spec holds the range of experts it holds and the slice of one expert's matrix
    (models.loader reads either expert layout with them, dequantising FP8 experts)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TPGroup, ep: int = 1):
        super().__init__()
        experts, rows = expert_split(tp, num_experts, intermediate_size, ep)
        count, width = experts[1] - experts[0], rows[1] - rows[0]
        self.first = experts[0]
        self.sizes = [intermediate_size, intermediate_size]  # the gate and up rows of a whole expert
        self.gate_up_proj = nn.Parameter(torch.empty(count, 2 * width, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(count, hidden_size, width), requires_grad=False)
        self.slice_specs = {"gate_up_proj": SliceSpec(parts=(("gate_proj", (rows,)), ("up_proj", (rows,))),
                                                      experts=experts),
                            "down_proj": SliceSpec(cut=(1, (rows,)), experts=experts)}
        self.block_rows = 0  # batch-invariant mode (CausalLM.set_batch_invariant)
        self.invariant = False
        self.backend = kernels.settings.moe_backend  # auto or one of EXPERT_BACKENDS (comparisons)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Σ over each row's k experts held here of weight · expert(row): x [N, H] -> [N, H]; with
        `shared` (SparseMoE.fused_shared) the fused kernels add the gated shared expert too."""
        local = ids - self.first  # ids of this rank's experts: [0, E_rank); others fall outside
        if shared is not None:
            return fused_experts(self, x, weights, local, shared)
        return EXPERT_BACKENDS[self.pick(x, ids.numel())](self, x, weights, local)

    def pick(self, x: torch.Tensor, rows: int) -> str:
        """The backend for x's (token, expert) `rows`."""
        if self.backend != "auto":
            check_backend_setting(self.backend)
            return self.backend
        if not x.is_cuda:
            return "reference"
        if x.dtype != torch.bfloat16 or self.invariant:
            return "gathered"
        return "fused" if rows <= FUSED_ROWS and kernels.enabled(x) else "grouped"

    def expert(self, e: int | torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        gate, up = linear(rows, self.gate_up_proj[e], self.block_rows).chunk(2, -1)
        return linear(silu_mul(gate, up, self.invariant), self.down_proj[e], self.block_rows)


def reference_experts(experts: Experts, x: torch.Tensor, weights: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A loop over the experts hit, each over its rows, added in expert order (transformers' order)."""
    out = torch.zeros_like(x)
    held = (local >= 0) & (local < experts.gate_up_proj.shape[0])
    for e in torch.unique(local[held]).tolist():
        token, slot = torch.where(local == e)
        out.index_add_(0, token, experts.expert(e, x[token]) * weights[token, slot, None])
    return out


def grouped_experts(experts: Experts, x: torch.Tensor, weights: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The (token, expert) rows sorted by expert, two grouped matmuls, the rows put back."""
    count = experts.gate_up_proj.shape[0]
    flat = local.flatten()
    held = (flat >= 0) & (flat < count)
    group = torch.where(held, flat, count)  # rows of other ranks' experts sort last, past every group
    order = group.argsort(stable=True)
    sizes = torch.zeros(count + 1, dtype=torch.int32, device=x.device)
    sizes.scatter_add_(0, group, torch.ones_like(group, dtype=torch.int32))
    offsets = sizes[:count].cumsum(0, dtype=torch.int32)  # on the device: no host sync
    rows = x[order // local.shape[1]]
    gate, up = F.grouped_mm(rows, experts.gate_up_proj.transpose(1, 2), offs=offsets).chunk(2, -1)
    down = F.grouped_mm(silu_mul(gate, up), experts.down_proj.transpose(1, 2), offs=offsets)
    down = torch.where(held[order, None], down, 0)  # rows past the last group are not written: garbage
    return _weighted_sum(torch.empty_like(down).index_copy_(0, order, down), weights)


def gathered_experts(experts: Experts, x: torch.Tensor, weights: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """Each (token, expert) row times its expert's weights, gathered GATHER_ROWS rows at a time."""
    count, k = experts.gate_up_proj.shape[0], local.shape[1]
    flat = local.flatten()
    held = (flat >= 0) & (flat < count)

    def block(rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        gate, up = torch.bmm(rows[:, None], experts.gate_up_proj[ids].transpose(1, 2))[:, 0].chunk(2, -1)
        h = silu_mul(gate, up, experts.invariant)
        return torch.bmm(h[:, None], experts.down_proj[ids].transpose(1, 2))[:, 0]

    down = in_blocks(block, x.repeat_interleave(k, 0), flat.clamp(0, count - 1), rows=GATHER_ROWS)
    return _weighted_sum(torch.where(held[:, None], down, 0), weights)


def fused_experts(experts: Experts, x: torch.Tensor, weights: torch.Tensor, local: torch.Tensor,
                  shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Each (token, expert) row's gate/up GEMV and SiLU, then each token's down GEMVs added in slot
    order: two Triton launches (kernels.moe); with `shared` (kernels.moe.experts) the shared expert too."""
    if not kernels.HAVE_TRITON:
        raise RuntimeError("the fused expert backend needs Triton (a CUDA build of torch; on a CPU, "
                           "TRITON_INTERPRET=1)")
    return kernels.moe.experts(kernels.rows(x), weights, local, experts.gate_up_proj, experts.down_proj, shared)


def _weighted_sum(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_j weights[:, j] · rows of slot j ([N·k, H] -> [N, H]), in slot order: the same arithmetic
    for every token whatever the batch."""
    rows = rows.view(*weights.shape, -1)
    out = rows[:, 0] * weights[:, :1]
    for j in range(1, weights.shape[1]):
        out = out + rows[:, j] * weights[:, j : j + 1]
    return out


EXPERT_BACKENDS: dict[str, Callable[[Experts, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "reference": reference_experts, "grouped": grouped_experts, "gathered": gathered_experts,
    "fused": fused_experts}


def check_backend_setting(backend: str) -> None:
    """ValueError naming the choices unless `backend` is auto or one of EXPERT_BACKENDS."""
    if backend != "auto" and backend not in EXPERT_BACKENDS:
        raise ValueError(f"moe_backend must be auto or one of {sorted(EXPERT_BACKENDS)}, not {backend!r}")


class SparseMoE(nn.Module):
    """Router, routed experts and the gated shared expert; returns this rank's partial sum. The router
    and the shared expert's gate read the same rows: one replicated weight [E + 1, H] (the gate's row
    last), one matmul."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 shared_intermediate_size: int, tp: TPGroup, ep: int = 1, quant: QuantConfig | None = None,
                 prefix: str = ""):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        # every rank holds all rows of both (replicated)
        self.router = MergedColumnParallelLinear(hidden_size, {"gate": [(0, num_experts)],
                                                               "shared_expert_gate": [(0, 1)]}, quant,
                                                 f"{prefix}.router")
        self.experts = Experts(num_experts, hidden_size, intermediate_size, tp, ep)
        self.shared_expert = MLP(hidden_size, shared_intermediate_size, tp, quant, f"{prefix}.shared_expert")
        self.invariant = False  # batch-invariant mode (CausalLM.set_batch_invariant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        logits = self.router.joined(rows)  # [N, E + 1], not split
        if kernels.enabled(logits):  # softmax, top k, renormalisation and the gate's sigmoid: one launch
            weights, ids, gate = kernels.moe.route(logits, self.num_experts, self.top_k)
        else:
            weights, ids = route(logits[:, : self.num_experts], self.top_k)
            gate = pointwise(torch.sigmoid, logits[:, self.num_experts :], self.invariant)
        if (shared := self.fused_shared(rows, ids, gate)) is not None:
            return self.experts(rows, weights, ids, shared).view(x.shape)
        return (self.experts(rows, weights, ids) + gate * self.shared_expert(rows)).view(x.shape)

    def fused_shared(self, rows: torch.Tensor, ids: torch.Tensor, gate: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The shared expert's (gate_up, down, gate) for the fused expert kernels to run as one more
        slot of each token, or None: only where they run the routed experts, on at most SHARED_TOKENS
        tokens (they read it once per token), with the shared expert as wide as a routed one on this
        rank and its weights 16-bit like the experts'."""
        shared = self.shared_expert
        fits = (rows.shape[0] <= SHARED_TOKENS and self.experts.pick(rows, ids.numel()) == "fused"
                and all(not part.method.quantized and part.weight.dtype == self.experts.gate_up_proj.dtype
                        for part in (shared.gate_up_proj, shared.down_proj))
                and shared.down_proj.weight.shape == self.experts.down_proj.shape[1:])
        return (shared.gate_up_proj.weight, shared.down_proj.weight, gate) if fits else None
