"""The routed experts of a mixture-of-experts layer: E SwiGLU feed-forwards whose weights are stacked, one parameter
per projection holding every expert (`c_gate`, `c_fc`: [E, hidden, dim]; `c_proj`: [E, dim, hidden]), so that expert
parallelism shards dim 0 (parallel/expert_parallel.py runs `compute` on a rank's slice). Plain PyTorch, no distributed
code.

The experts take rows already sorted by expert (`counts[e]` rows for expert e, in expert order; rows after the last
expert's are dropped assignments and come back as zeros) and run one of two ways, which give the same numbers:

    loop     a matmul per expert over its rows: correct on every device and dtype (one host read of the counts)
    grouped  torch's grouped GEMM (torch._grouped_mm): every expert's rows in one kernel per projection, no host read.
             Its CUDA kernel takes bf16 only and runs fast on compute capability 9.x and 10.x (Hopper, Blackwell;
             elsewhere torch falls back to a loop of its own); strides must be multiples of 16 bytes (dim and hidden
             multiples of 8) and each expert's rows start 16-byte aligned, so every expert's rows are padded to a
             multiple of ALIGN_ROWS with zeros. On a CPU torch runs it too (in any float dtype), which the tests use.
    auto     grouped on a CUDA device of capability 9.x/10.x computing in bf16, else loop
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

ALIGN_ROWS = 16  # rows per expert padded to this: 16-byte aligned group starts in bf16 (8) and fp8 (16) alike
GROUPED_CAPABILITIES = (9, 10)  # the major compute capabilities whose grouped GEMM is a CUTLASS kernel (torch 2.13)


class GroupedExperts(nn.Module):
    def __init__(self, n_experts: int, dim: int, hidden: int, matmul: str = "auto"):
        super().__init__()
        if matmul not in ("auto", "grouped", "loop"):
            raise ValueError(f"GroupedExperts matmul {matmul!r}: choose auto, grouped or loop")
        self.matmul = matmul
        self.c_gate = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.c_fc = nn.Parameter(torch.empty(n_experts, hidden, dim))  # up
        self.c_proj = nn.Parameter(torch.empty(n_experts, dim, hidden))  # down
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, n_layer: int | None = None) -> None:
        """GPT-2's init, as every linear here gets (nn.transformer.init_gpt2_style): N(0, 0.02), the down projection
        N(0, 0.02 / sqrt(2 · n_layer)) when the depth is given."""
        for weight in (self.c_gate, self.c_fc, self.c_proj):
            nn.init.normal_(weight, mean=0.0, std=0.02)
        if n_layer:
            nn.init.normal_(self.c_proj, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @property
    def n_experts(self) -> int:
        return self.c_gate.shape[0]

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows [M, dim] sorted by expert, counts [E] (sum <= M) -> [M, dim]: each row through its expert's SwiGLU,
        rows past sum(counts) zero."""
        return self.compute(rows, counts, self.c_gate, self.c_fc, self.c_proj)

    def compute(self, rows: torch.Tensor, counts: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
        """forward on given stacked weights (as many experts as counts has entries): what expert parallelism runs on
        a rank's slice of the experts (parallel/expert_parallel.py)."""
        if self.uses_grouped(rows, gate):
            return grouped_swiglu(rows, counts, gate, up, down)
        return looped_swiglu(rows, counts, gate, up, down)

    def uses_grouped(self, rows: torch.Tensor, gate: torch.Tensor | None = None) -> bool:
        if self.matmul != "auto":
            return self.matmul == "grouped"
        return (rows.is_cuda and torch.cuda.get_device_capability(rows.device)[0] in GROUPED_CAPABILITIES
                and compute_dtype(rows, self.c_gate if gate is None else gate) == torch.bfloat16)


def compute_dtype(rows: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the experts' matmuls run in: autocast's where it is on, else the weights'."""
    device = rows.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


def looped_swiglu(rows: torch.Tensor, counts: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                  down: torch.Tensor) -> torch.Tensor:
    """The plain path: one SwiGLU per expert over its own rows (experts without rows skipped)."""
    return swiglu_by_counts(rows, counts.tolist(), gate, up, down)  # the one host read of this path


def swiglu_by_counts(rows: torch.Tensor, counts: list[int], gate: torch.Tensor, up: torch.Tensor,
                     down: torch.Tensor) -> torch.Tensor:
    """looped_swiglu with the rows per expert given as host numbers; rows after the last expert's: zeros."""
    pieces, start = [], 0
    for expert, n in enumerate(counts):
        if n:
            x = rows[start:start + n]
            pieces.append((F.silu(x @ gate[expert].t()) * (x @ up[expert].t())) @ down[expert].t())
            start += n
    dropped = rows.shape[0] - start
    if dropped or not pieces:
        dtype = pieces[0].dtype if pieces else rows.dtype
        pieces.append(rows.new_zeros(dropped, down.shape[1], dtype=dtype))
    return torch.cat(pieces)


def grouped_swiglu(rows: torch.Tensor, counts: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                   down: torch.Tensor) -> torch.Tensor:
    """The grouped path: every expert's rows padded to ALIGN_ROWS in one buffer of a size known without reading the
    counts (M + E · (ALIGN_ROWS - 1) rows, rounded up), then one grouped GEMM per projection. On CUDA in bf16."""
    dtype = torch.bfloat16 if rows.is_cuda else compute_dtype(rows, gate)
    m, n_experts = rows.shape[0], counts.numel()
    padded = (counts + ALIGN_ROWS - 1) // ALIGN_ROWS * ALIGN_ROWS
    ends = torch.cumsum(padded, 0)
    starts = torch.cumsum(counts, 0) - counts
    buffer_rows = -(-(m + n_experts * (ALIGN_ROWS - 1) + 1) // ALIGN_ROWS) * ALIGN_ROWS
    # Row r (of expert e) goes to ends[e] - padded[e] + (r - starts[e]); a dropped row (past every expert's) goes to
    # the buffer's last row, which lies past ends[-1] whenever a row is dropped: the GEMMs never read it.
    expert_of_row = torch.searchsorted(torch.cumsum(counts, 0), torch.arange(m, device=rows.device), right=True)
    kept = expert_of_row < n_experts
    expert_of_row = expert_of_row.clamp_max(n_experts - 1)
    slot = ends[expert_of_row] - padded[expert_of_row] + torch.arange(m, device=rows.device) - starts[expert_of_row]
    slot = torch.where(kept, slot, buffer_rows - 1)
    # A dropped row enters as zeros through a select: whatever the GEMMs' backward leaves in the uncomputed last row
    # (NaN, say) then gives it a gradient of exactly 0, as the loop path does.
    values = torch.where(kept[:, None], rows.to(dtype), torch.zeros((), dtype=dtype, device=rows.device))
    x = rows.new_zeros(buffer_rows, rows.shape[1], dtype=dtype).index_put((slot,), values)
    offsets = ends.to(torch.int32)
    with torch.autocast(rows.device.type, enabled=False):  # the dtype is chosen above
        h = F.silu(torch._grouped_mm(x, gate.to(dtype).transpose(-2, -1), offs=offsets)) * \
            torch._grouped_mm(x, up.to(dtype).transpose(-2, -1), offs=offsets)
        y = torch._grouped_mm(h, down.to(dtype).transpose(-2, -1), offs=offsets)
    # Rows of the buffer past ends[-1] were never computed (their values are whatever the memory held): select, do
    # not multiply, so that nothing of them reaches a dropped row.
    return torch.where(kept[:, None], y[slot], torch.zeros((), dtype=y.dtype, device=y.device))
