"""Run by tests/test_parallel.py under torchrun (N ranks) or alone (the single-process reference):

    python -m torch.distributed.run --nproc-per-node N tests/tp_worker.py CASE OUT.json

CASE "tiny": a float64 Llama with 4 query / 2 KV heads and a replicated draft; "smollm2":
SmolLM2-135M-Instruct (9 / 3 heads) in float64 with its shipped draft. Each decodes greedy and
seeded, chains and trees, `generate_batch` and the continuous engine, and rank 0 writes every
output's token ids to OUT.json. Fault cases ("hang", "die", "mismatch") make one rank misbehave;
every rank must then end with an error."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig, parallel  # noqa: E402
from treespec.backends.native import NativeRunner  # noqa: E402

torch.set_num_threads(1)

GREEDY, T1 = SamplingConfig(temperature=0), SamplingConfig(temperature=1.0)
CHAIN, TREE = TreeConfig(width=1, depth=3), TreeConfig(width=2, depth=3, strategy="iid")


def tiny_decoder() -> SpeculativeDecoder:
    from tests.conftest import perturbed, tiny_llama

    target = tiny_llama(0)  # float64, 4 query heads, 2 KV heads
    tp = parallel.init()
    return SpeculativeDecoder(
        NativeRunner.from_hf(target, tp=tp), NativeRunner.from_hf(perturbed(target, noise=0.3, seed=1))
    )


def decode(dec: SpeculativeDecoder, prompts: list, n: int) -> dict[str, list]:
    out: dict[str, list] = {}
    for name, tree, sampling in (
        ("greedy-chain", CHAIN, GREEDY),
        ("greedy-tree", TreeConfig(width=2, depth=3, strategy="topk"), GREEDY),
        ("seeded-chain", CHAIN, T1),
        ("seeded-tree", TREE, T1),
        ("plain-seeded", None, T1),
    ):
        out[name] = [
            dec.generate(p, n, tree=tree, sampling=sampling, seed=7 + i, ignore_eos=True).token_ids
            for i, p in enumerate(prompts)
        ]
    batch = dec.generate_batch(
        prompts, n, tree=TREE, sampling=T1, seeds=[3, 4, 5][: len(prompts)], ignore_eos=True
    )
    out["batch"] = [o.token_ids for o in batch]
    engine = dec.engine(max_live=2)
    ids = [engine.add(prompts[0], n, tree=CHAIN, sampling=T1, seed=11, ignore_eos=True)]
    engine.step()
    engine.step()
    ids += [
        engine.add(p, n, tree=TREE, sampling=T1, seed=12 + i, ignore_eos=True)
        for i, p in enumerate(prompts[1:])
    ]
    outputs = engine.run()
    out["engine"] = [outputs[i].token_ids for i in ids]
    return out


def main(case: str, path: str) -> None:
    rank = int(os.environ.get("RANK", "0"))
    if case == "tiny":
        dec = tiny_decoder()
        prompts = [[5, 9, 2, 31, 7], [11, 3, 3, 60, 2, 8, 40], [4]]
        result = decode(dec, prompts, 12)
        # the automatic tree: costs measured on every rank, rank 0's used by all (no hang)
        result["auto"] = [dec.generate(prompts[0], 8, seed=1).token_ids]
    elif case == "smollm2":
        from treespec.zoo import pair

        dec = SpeculativeDecoder.from_pretrained(*pair("smollm2"), dtype="float64", drafter="model")
        chat = [{"role": "user", "content": "Name three colours."}]
        result = decode(dec, [chat, "The capital of France is"], 6)
    elif case in ("compiled", "compiled-int8"):  # float32, the compiled forward (the all-reduce
        # inside the graph), of float weights or of int8 ones
        from tests.conftest import tiny_llama
        from treespec.backends.native import CompiledForward

        model, tp = tiny_llama(0, dtype=torch.float32), parallel.init()
        result = {}
        for quantize in ("int8",) if case == "compiled-int8" else (None,):
            eager = NativeRunner.from_hf(model, tp=tp, quantize=quantize)
            compiled = NativeRunner.from_hf(model, tp=tp, compile=True, quantize=quantize)
            compiled.compiled = CompiledForward(compiled, {"freezing": True})  # no autotuning: quick
            rows = []
            for runner in (eager, compiled):
                runner.prefill([5, 9, 2, 31, 7])
                rows.append(runner.extend([4], [-1]))
            result[str(quantize)] = {
                "graphs": sorted(compiled.compiled.compiled),
                "max_diff": (rows[0] - rows[1]).abs().max().item(),
            }
    elif case == "mismatch":  # rank 1 was started with other settings
        from treespec.zoo import pair

        SpeculativeDecoder.from_pretrained(*pair("pycode"), dtype="float32" if rank == 0 else "bfloat16")
        result = {}
    elif case in ("hang", "die"):
        dec = tiny_decoder()
        if rank == 1:
            if case == "die":
                os._exit(3)
            time.sleep(600)
        result = {"x": [dec.generate([5, 9, 2], 8, tree=CHAIN, sampling=GREEDY).token_ids]}
    else:
        raise SystemExit(f"unknown case {case!r}")
    if parallel.leader():
        Path(path).write_text(json.dumps(result))
    parallel.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
