"""Measurements of runners and the machine: forward seconds, memory bandwidth, one backend's
cost ratios (`cost_ratios`) and what a measurement ran on (`machine_info`). Every timing
synchronises on CUDA (`synchronize`) and is a median (`treespec.timing.median_seconds`)."""

from __future__ import annotations

import torch

from ..backends import Runner, cpu_bf16_flags, cpu_model
from ..timing import median_seconds
from ..tree import TokenTree


def machine_info(device: torch.device | str = "cpu") -> dict:
    """What a measurement ran on, for its JSON and its report: the device (CPU model or GPU
    name), the CPU's bf16 matrix flags, torch threads and versions."""
    device = torch.device(device)
    return {
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model(),
        "cpu_bf16_flags": sorted(cpu_bf16_flags()),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def synchronize(device: torch.device) -> None:
    """Wait for `device`'s queued work (a no-op on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forward_seconds(runner: Runner, n_nodes: int = 1, prefix_len: int = 128, repeats: int = 20) -> float:
    """Median seconds of one `score()` of an `n_nodes` tree after a `prefix_len` prefix."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, runner.vocab_size, (prefix_len + n_nodes,), generator=g).tolist()
    tree = TokenTree(tokens[prefix_len:], [-1] + [0] * (n_nodes - 1))  # the root and n-1 children
    runner.reset()
    runner.prefill(tokens[:prefix_len])
    return median_seconds(
        lambda: runner.score(tree),
        repeats,
        warmup=2,
        sync=lambda: synchronize(runner.device),
        between=lambda: runner.commit([]),  # the prefix alone stays cached
    )


def memory_bandwidth(device: torch.device, mbytes: int = 256, repeats: int = 10) -> float:
    """Bytes/s of a large device copy (read + write), median of `repeats`."""
    x = torch.empty(mbytes * 2**20 // 4, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    seconds = median_seconds(lambda: y.copy_(x), repeats, warmup=0, sync=lambda: synchronize(device))
    return 2 * x.numel() * 4 / seconds


def cost_ratios(target: Runner, draft: Runner | None, n_nodes: int, weight_bytes: int) -> dict:
    """One backend's forward costs: t(1), t(n)/t(1), c = t_draft(1)/t_target(1) and the
    bandwidth floor (weight bytes / measured bandwidth) as seconds and as a ratio to t(1)."""
    t1 = forward_seconds(target)
    cost = {"t_target_1_s": t1, f"t_target_{n_nodes}_s": forward_seconds(target, n_nodes)}
    cost[f"t({n_nodes})/t(1)"] = cost[f"t_target_{n_nodes}_s"] / t1
    if draft is not None:
        cost["t_draft_1_s"] = forward_seconds(draft)
        cost["c"] = cost["t_draft_1_s"] / t1
    floor = weight_bytes / memory_bandwidth(target.device)
    cost["floor_s"], cost["floor/t(1)"] = floor, floor / t1
    return cost
