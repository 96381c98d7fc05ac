"""What the experiment scripts share: where results go, what a run ran on, teacher-forced
logits, and a named pair's held-out prompts as token ids.

Scripts run as `python experiments/<script>.py` (or `experiments/build/<script>.py`) from the
repository root; a script in a subfolder puts this folder on `sys.path` before importing it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from treespec.backends.cpu import cpu_bf16_flags, cpu_model
from treespec.request import chat_ids
from treespec.zoo import heldout_chats, load_prompts

RESULTS = Path(__file__).resolve().parent / "results"


def write_results(name: str, data) -> Path:
    """`data` as JSON in results/`name` (indented, a final newline), said on stdout."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {path}")
    return path


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


def chain_logits(runner, ids: list[int], cont: list[int]) -> torch.Tensor:
    """The `runner`'s next-token logits [len(cont), V] at the positions that predict each token
    of `cont` when `cont` follows the prompt `ids` (teacher forcing; the cache is reset first)."""
    runner.reset()
    runner.prefill(ids[:-1])
    logits = runner.extend([ids[-1]] + cont[:-1], list(range(-1, len(cont) - 1)))
    runner.commit([])
    return logits


def heldout_prompt_ids(name: str, tokenizer, n: int | None = None) -> list[list[int]]:
    """The first n held-out prompts of a named pair as token ids, as its benchmarks feed them:
    for "smollm2" (a chat model) the held-out chat instructions rendered with its chat
    template, for "pycode" openings of held-out Python files. Neither set was used to train or
    distil the pair's draft."""
    if name == "pycode":
        return [tokenizer(p)["input_ids"] for p in load_prompts(n=n)]
    if name != "smollm2":
        raise ValueError(f"unknown pair {name!r}; the pairs are smollm2, pycode")
    return [list(chat_ids(chat, tokenizer)) for chat in heldout_chats(n)]


def parse_tree(spec: str, acceptance: list[float] | None = None):
    """A `TreeConfig` from "strategy:WIDTHxDEPTH", or from "sequoia:NODESxDEPTH": the
    Sequoia-optimal shape of at most NODES draft nodes and depth DEPTH for a calibrated
    acceptance vector (`costs/calibrate_sequoia.py`'s JSON)."""
    from treespec import TreeConfig
    from treespec.sequoia import optimal_shape

    strategy, shape = spec.split(":")
    a, b = (int(x) for x in shape.split("x"))
    if strategy == "sequoia":
        if acceptance is None:
            raise SystemExit(
                f"{spec}: pass --sequoia with a calibrate_sequoia.py JSON (its acceptance vector)"
            )
        return TreeConfig(strategy="sequoia", shape=optimal_shape(acceptance, a, b), depth=b)
    return TreeConfig(width=a, depth=b, strategy=strategy)
