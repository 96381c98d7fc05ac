"""Structured outputs on an accelerator (or `cpu`): greedy speculative == greedy plain under a
JSON schema for several trees, sampled outputs valid, batch == solo, on the pycode pair in
float32 and bfloat16. Prints ALL OK or FAILED.

    python experiments/structured/device_check.py cuda
"""

import json
import sys

import torch

from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig
from treespec.constraints import Choice, JsonSchema, Regex
from treespec.zoo import ZOO

DEV = sys.argv[1] if len(sys.argv) > 1 else "cuda"
print(torch.__version__, torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu")
schema = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "status": {"enum": ["open", "closed"]},
    },
    "required": ["name", "age", "tags", "status"],
    "additionalProperties": False,
}
ok = True
for dtype in ("float32", "bfloat16"):
    dec = SpeculativeDecoder.from_pretrained(
        target=ZOO / "pycode" / "target", draft=ZOO / "pycode" / "draft", dtype=dtype, device=DEV
    )
    c = JsonSchema(schema)
    g = SamplingConfig(temperature=0)
    plain = dec.generate("record = ", 96, tree=None, sampling=g, constraint=c)
    for tree in (
        TreeConfig(),
        TreeConfig(1, 4),
        TreeConfig(3, 3, "topk"),
        TreeConfig(2, 3, "without_replacement"),
    ):
        spec = dec.generate("record = ", 96, tree=tree, sampling=g, constraint=c)
        same = spec.token_ids == plain.token_ids
        ok &= same or dtype == "bfloat16"
        print(
            dtype,
            "greedy parity",
            tree.strategy,
            tree.width,
            tree.depth,
            same,
            spec.stats.tokens_per_step,
            spec.stats.forced_accepted,
        )
    print(dtype, "plain text", repr(plain.text), plain.finish_reason)
    for T in (0.0, 1.0):
        for tree in (None, TreeConfig(), TreeConfig(2, 3, "iid")):
            for seed in range(3):
                out = dec.generate(
                    "record = ",
                    96,
                    tree=tree,
                    sampling=SamplingConfig(temperature=T),
                    seed=seed,
                    constraint=c,
                )
                try:
                    d = json.loads(out.text)
                    valid = set(d) == {"name", "age", "tags", "status"} and d["status"] in ("open", "closed")
                except ValueError:
                    valid = out.finish_reason == "length"
                ok &= valid
            print(
                dtype,
                "T",
                T,
                "tree",
                None if tree is None else (tree.strategy, tree.width, tree.depth),
                "valid",
                valid,
                repr(out.text)[:80],
            )
    outs = dec.generate_batch(
        ["a = "] * 4, 48, sampling=g, constraint=[c, None, Choice(("yes", "no")), Regex("[0-9]{3}-[0-9]{4}")]
    )
    solo = [
        dec.generate("a = ", 48, sampling=g, constraint=x).token_ids
        for x in [c, None, Choice(("yes", "no")), Regex("[0-9]{3}-[0-9]{4}")]
    ]
    eq = [o.token_ids == s for o, s in zip(outs, solo)]
    ok &= all(eq) or dtype == "bfloat16"
    print(dtype, "batch == solo", eq, [o.text for o in outs[2:]])
print("ALL OK" if ok else "FAILED")
