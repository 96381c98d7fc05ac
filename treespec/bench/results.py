"""What a bench runs and reports: its methods, one `MethodResult` row per method, the
`BenchResult` (rows, forward costs, config) and its table. No torch: the command's flags
import the method names."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

METHODS = ("hf", "hf-assisted", "autoregressive", "linear", "tree")  # what a bench runs by default
KNOWN_METHODS = (*METHODS, "goodput")


@dataclass
class MethodResult:
    method: str
    tokens_per_second: float  # median over runs of (new tokens / wall seconds)
    tokens_per_step: float | None = None  # treespec only: total tokens / total target forwards
    acceptance_by_depth: list[float] | None = None  # treespec only, pooled over runs
    acceptance_rate: float | None = None  # treespec only: accepted draft tokens / drafted tokens, pooled
    mean_accepted_length: float | None = None  # treespec only: accepted draft tokens per target step
    draft_forwards: int | None = None  # treespec only: draft model forwards, summed over runs
    # treespec only, timed inside generate(): c as a round pays it, (draft seconds per draft
    # forward, sampling included) / (verify seconds per target step, the walk included)
    c_in_loop: float | None = None
    runs: list[float] = field(default_factory=list)  # tokens/s of every run


@dataclass
class BenchResult:
    config: dict  # what was run (models, dtype, tree, sampling, sizes)
    cost: dict  # per backend: t(1), t(n)/t(1), c = t_draft/t_target, floor (see measure.cost_ratios)
    methods: list[MethodResult]

    def to_json(self) -> dict:
        return asdict(self)


def result_table(result: BenchResult) -> str:
    """The bench's table: one row per method (speedup over HF `generate()` where it ran), then
    each backend's forward costs."""
    base = next((r.tokens_per_second for r in result.methods if r.method == "hf"), None)
    header = f"{'method':<30}{'tokens/s':>10}{'speedup':>9}{'tokens/step':>13}{'accept':>8}{'acc.len':>9}"
    lines = [header + f"{'c loop':>8}  acceptance by depth"]
    for r in result.methods:
        speed = f"{r.tokens_per_second / base:.2f}x" if base else "-"
        tps = f"{r.tokens_per_step:.2f}" if r.tokens_per_step is not None else "-"
        rate = f"{r.acceptance_rate:.2f}" if r.acceptance_rate else "-"
        length = f"{r.mean_accepted_length:.2f}" if r.acceptance_rate and r.mean_accepted_length else "-"
        acc = " ".join(f"{a:.2f}" for a in r.acceptance_by_depth or [])
        c = f"{r.c_in_loop:.3f}" if r.c_in_loop is not None else "-"
        lines.append(
            f"{r.method:<30}{r.tokens_per_second:>10.1f}{speed:>9}{tps:>13}{rate:>8}{length:>9}{c:>8}  {acc}"
        )
    for backend, cost in result.cost.items():
        lines.append(f"cost [{backend}]: " + ", ".join(f"{k}={v:.4g}" for k, v in cost.items()))
    return "\n".join(lines)
