"""The draft model: a small LlamaForCausalLM shaped and initialised from the target.

Shape (recipe defaults): 2 layers, hidden = the target's / 4 in multiples of 32, heads of 32,
half as many KV heads, MLP 3 x hidden, tied embeddings, the target's RoPE and context. A
draft's cost per forward is mostly per-layer overhead at these sizes, so depth is the knob
that matters for c = t_draft / t_target; width buys acceptance.

Initialisation (`embeddings="pca"`): the target's output embedding W [V, H] (its tied
embedding for most small models) projected on its top `hidden` right singular vectors,
E = W V_h [V, h]. W V_h V_h^T is the best rank-h approximation of W, so a draft whose final
hidden state approximates the target's, projected, starts with the target's logit geometry.
A draft as wide as the target copies W unchanged. `freeze_embeddings` keeps E fixed: the
embedding then is the target's (projected), shared rather than learned.

`from_target`: the draft is a slice of the target, at its width: its embedding, its first
`layers - 1` decoder layers, its last layer and its final norm (`target_layers`), then
trained like any draft. A pretrained slice starts far from noise (the target's own
features and output geometry), which a draft trained on a few hundred thousand positions
cannot learn from scratch; it costs the target's per-layer width, so c grows with `layers`.

Output: a standard HF directory (config.json, model.safetensors, the target's tokenizer,
generation_config.json with the target's EOS) that treespec and `transformers` load as is;
a subset-vocabulary draft adds `vocab_map.json` (`treespec.backends.subset`), which every loader reads.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..backends.subset import VocabMap, wrap


def draft_config(target_config, recipe, vocab_rows: int):
    """The draft's LlamaConfig: `recipe`'s shape, the target's RoPE, norms and context."""
    from transformers import LlamaConfig

    t = target_config
    if recipe.from_target:
        return _target_slice_config(t, recipe.layers, vocab_rows)
    hidden = recipe.hidden_size or max(
        2 * recipe.head_dim, round(t.hidden_size / 4 / recipe.head_dim) * recipe.head_dim
    )
    heads = hidden // recipe.head_dim
    kv = recipe.kv_heads or max(1, heads // 2)
    if heads % kv:
        raise ValueError(f"{heads} attention heads are not a multiple of kv_heads {kv}")
    rope = getattr(t, "rope_parameters", None) or {
        "rope_type": "default",
        "rope_theta": getattr(t, "rope_theta", 10000.0),
    }
    return LlamaConfig(
        vocab_size=vocab_rows,
        hidden_size=hidden,
        intermediate_size=recipe.intermediate_size or 3 * hidden,
        num_hidden_layers=recipe.layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=recipe.head_dim,
        max_position_embeddings=t.max_position_embeddings,
        rms_norm_eps=getattr(t, "rms_norm_eps", 1e-5),
        rope_parameters=dict(rope),
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )


def target_layers(n_target: int, n: int) -> list[int]:
    """The target layers a `from_target` draft of `n` layers copies: the first n - 1 and the last."""
    if not 1 <= n <= n_target:
        raise ValueError(f"from_target needs 1 <= layers <= the target's {n_target} layers, got {n}")
    return [0] if n == 1 else list(range(n - 1)) + [n_target - 1]


def _target_slice_config(t, layers: int, vocab_rows: int):
    """The target's own config (tied or not, as it is) with `layers` decoder layers, `vocab_rows`
    embedding rows and sdpa."""
    import copy

    if getattr(t, "model_type", None) != "llama":
        raise ValueError(f"from_target needs a Llama-architecture target, got {t.model_type!r}")
    target_layers(t.num_hidden_layers, layers)
    config = copy.deepcopy(t)
    config.num_hidden_layers, config.vocab_size = layers, vocab_rows
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:layers]
    config._attn_implementation = "sdpa"
    return config


def build_draft(target, recipe, vocab_map: VocabMap | None, seed: int):
    """A new fp32 draft for `target` (an HF causal LM), initialised per `recipe`."""
    from transformers import LlamaForCausalLM

    rows = target.config.vocab_size if vocab_map is None else vocab_map.size + 1
    config = draft_config(target.config, recipe, rows)
    torch.manual_seed(seed)
    draft = LlamaForCausalLM(config).float()
    if recipe.embeddings == "pca" and not recipe.from_target:  # a slice copies its rows below
        with torch.no_grad():
            draft.get_input_embeddings().weight.copy_(
                projected_embeddings(target, config.hidden_size, vocab_map)
            )
    if recipe.from_target:
        with torch.no_grad():
            src = target.model
            for mine, theirs in zip(
                draft.model.layers, target_layers(len(src.layers), recipe.layers), strict=True
            ):
                for name, value in src.layers[theirs].state_dict().items():
                    mine.state_dict()[name].copy_(value.float())
            draft.model.norm.weight.copy_(src.norm.weight.float())
            # output rows, then input rows (one matrix when tied, as the target's then is)
            for get in ("get_output_embeddings", "get_input_embeddings"):
                rows = getattr(target, get)().weight.detach().float().cpu()
                getattr(draft, get)().weight.copy_(subset_rows(rows, vocab_map))
    if recipe.freeze_embeddings:
        draft.get_input_embeddings().weight.requires_grad_(False)
    return draft


def projected_embeddings(target, hidden: int, vocab_map: VocabMap | None) -> torch.Tensor:
    """[rows, hidden]: the target's output embedding on its top `hidden` right singular vectors
    (unchanged when `hidden` is the target's width); a subset keeps its K rows and gives row K
    (every other token) the mean of the rest."""
    W = target.get_output_embeddings().weight.detach().float().cpu()  # [V, H]
    if hidden < W.shape[1]:
        _, _, Vh = torch.linalg.svd(W, full_matrices=False)  # Vh [H, H]
        W = W @ Vh[:hidden].T  # [V, hidden]
    elif hidden > W.shape[1]:
        raise ValueError(
            f"embeddings='pca' needs hidden_size <= the target's {W.shape[1]}; use embeddings='random'"
        )
    return subset_rows(W, vocab_map)


def subset_rows(W: torch.Tensor, vocab_map: VocabMap | None) -> torch.Tensor:
    """[rows, H]: the rows of `W` [V, H] a draft over `vocab_map` keeps, and for row K (every
    other token) their mean."""
    if vocab_map is None:
        return W
    hidden = W.shape[1]
    outside = torch.ones(len(W), dtype=torch.bool)
    outside[vocab_map.ids] = False
    rest = W[outside].mean(0, keepdim=True) if outside.any() else torch.zeros(1, hidden)
    return torch.cat([W[vocab_map.ids], rest])


def draft_eos(target, vocab_map: VocabMap | None) -> list[int]:
    """The target's EOS ids, as draft rows (ids outside a subset are dropped)."""
    gen = getattr(target, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    eos = target.config.eos_token_id if eos is None else eos
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    if vocab_map is None:
        return eos
    return [int(vocab_map.row_of[e]) for e in eos if vocab_map.row_of[e] >= 0]


def save_draft(draft, out_dir: Path, target, tokenizer, vocab_map: VocabMap | None, dtype: str) -> None:
    """Write `draft` as an HF directory next to the target's tokenizer and EOS."""
    import copy

    from transformers import GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    model = copy.deepcopy(draft).to(getattr(torch, dtype))
    eos = draft_eos(target, vocab_map)
    remap = (
        (lambda i: i)
        if vocab_map is None
        else (lambda i: None if i is None or vocab_map.row_of[i] < 0 else int(vocab_map.row_of[i]))
    )
    for name in ("bos_token_id", "pad_token_id"):
        setattr(model.config, name, remap(getattr(target.config, name, None)))
    model.config.eos_token_id = eos[0] if len(eos) == 1 else (eos or None)
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id,
    )
    model.save_pretrained(str(out_dir))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out_dir))
    if vocab_map is not None:
        vocab_map.save(out_dir)


def load_draft(path, dtype: torch.dtype = torch.float32, device="cpu"):
    """(HF model, VocabMap or None) of a distilled draft directory."""
    from transformers import AutoModelForCausalLM

    model = (
        AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa")
        .to(device)
        .eval()
    )
    return model, VocabMap.load(Path(path))


def draft_runner(model, vocab_map: VocabMap | None, backend: str = "auto"):
    """The treespec Runner of a draft model: its backend runner, wrapped for a subset vocabulary."""
    from ..backends import make_runner

    runner = make_runner(model, backend)
    return wrap(runner, vocab_map)


def load_draft_runner(path, dtype: torch.dtype = torch.float32, device="cpu", backend: str = "auto"):
    """A Runner for any distilled draft directory, subset vocabulary included: what
    `SpeculativeDecoder.from_pretrained(draft=path)` loads (`treespec.loading.load_runner`)."""
    from .. import loading

    return loading.load_runner(path, dtype, loading.resolve_device(device), backend)
