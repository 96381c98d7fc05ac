"""Everything that touches `transformers`: the HF runner, model loading, EOS lookup, logging.

`transformers` is imported inside functions only, so `import treespec` stays light and the
native backend works from safetensors without it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from .base import Feed, Runner, Scores, features_of, forward_grouped, lanes_mask
from .checkpoint import eos_ids

# Attention implementations that take a custom 4D mask as given. flash_attention_* ignore
# 4D masks and flex_attention rebuilds its own, so tree attention would silently be wrong.
TREE_MASK_ATTENTION = ("sdpa", "eager")


class HFRunner(Runner):
    """A Hugging Face causal LM over a `DynamicCache` (tested on Llama, with sdpa and eager
    attention, and GPT-2). Lanes of one model (`lanes(n)`, batched decoding) run as one
    padded forward per round (`batched_forward`)."""

    def __init__(self, model: torch.nn.Module):
        impl = getattr(model.config, "_attn_implementation", None) or "eager"
        if impl not in TREE_MASK_ATTENTION:
            raise ValueError(
                f"attention implementation {impl!r} does not honour custom 4D tree masks; load the "
                f"model with attn_implementation='sdpa' (or 'eager')"
            )
        self.model = model
        self.attn_impl = impl
        self.vocab_size = int(model.config.vocab_size)
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.eos_token_ids = eos_token_ids(model)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.blocks = decoder_blocks(model)  # where features are tapped
        self.n_layers = None if self.blocks is None else len(self.blocks[0])
        super().__init__()

    def input_embeddings(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight.detach()

    def new_lane(self) -> HFRunner:
        lane = HFRunner(self.model)  # the modules are shared; each lane has its own DynamicCache
        lane.taps = self.taps
        return lane

    def reset_cache(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)

    def mask_4d(self, visible: torch.Tensor) -> torch.Tensor:
        """[B, 1, n, S+n] bool visibility (True: attend) -> the 4D mask the attention
        implementation expects."""
        if self.attn_impl == "sdpa":
            return visible  # bool, True = attend
        # eager adds the mask to the scores: 0 where visible, dtype min elsewhere
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        return torch.where(visible, zero, torch.finfo(self.dtype).min)

    @torch.inference_mode()
    def forward(self, tokens, positions, visible, need_logits):
        with tap_inputs(self.blocks, self.taps) as found:
            out = self.model(
                input_ids=tokens[None],  # [1, n]
                position_ids=positions[None],  # [1, n]
                # [1, 1, n, S+n]
                attention_mask=None if visible is None else self.mask_4d(visible[None, None]),
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=0 if need_logits else 1,  # 0 = all rows
            )
        features = features_of(self.taps, found)  # [1, n, F]
        return Scores(out.logits[0] if need_logits else None, None if features is None else features[0])

    @classmethod
    def forward_many(cls, runners: list[HFRunner], feeds: list[Feed], need_logits: bool) -> list[Scores]:
        """Lanes of one model run as ONE batched forward (`batched_forward`); a lone runner,
        or lanes whose caches are not plain `DynamicLayer`s (sliding windows, quantized
        caches), run one forward each."""

        def model_forward(lanes: list[HFRunner], lane_feeds: list[Feed]) -> list[Scores]:
            if len(lanes) > 1 and all(lane.plain_cache() for lane in lanes):
                return batched_forward(lanes, lane_feeds, need_logits)
            return [
                r.forward(f.tokens, f.positions, f.visible, need_logits) for r, f in zip(lanes, lane_feeds)
            ]

        return forward_grouped(runners, feeds, lambda r: id(r.model), model_forward)

    def plain_cache(self) -> bool:
        """Whether every layer of the cache is a plain `DynamicLayer` (what `batched_forward`
        copies; not a sliding window's or a quantized cache's)."""
        from transformers.cache_utils import DynamicLayer

        return all(type(layer) is DynamicLayer for layer in self.cache.layers)

    @torch.inference_mode()
    def keep_slots(self, nodes: list[int]) -> None:
        c, k = self.n_committed, len(nodes)
        idx = torch.tensor(nodes, dtype=torch.long, device=self.device) + c
        for layer in self.cache.layers:
            if not getattr(layer, "is_initialized", False):
                continue
            # gather first (a copy), then write: never an overlapping in-place copy
            keys, values = (
                layer.keys.index_select(-2, idx),
                layer.values.index_select(-2, idx),
            )  # [B, H, k, D]
            layer.keys[..., c : c + k, :] = keys
            layer.values[..., c : c + k, :] = values

    def truncate(self, n_slots: int) -> None:
        for layer in self.cache.layers:
            if getattr(layer, "is_initialized", False):
                layer.keys = layer.keys[..., :n_slots, :]
                layer.values = layer.values[..., :n_slots, :]


def decoder_blocks(model) -> tuple[list[torch.nn.Module], torch.nn.Module] | None:
    """A Llama-like HF model's decoder layers and final norm (where features are tapped), or
    None where the model has no such layout."""
    inner = getattr(model, "model", None)
    layers, norm = getattr(inner, "layers", None), getattr(inner, "norm", None)
    if layers is None or norm is None:
        return None
    return list(layers), norm


class tap_inputs:
    """Within the block: the input hidden states of the layers in `taps` (the layer count:
    the final norm's input) are recorded by forward pre-hooks, {layer: [B, n, H]}."""

    def __init__(self, blocks, taps: tuple[int, ...]):
        self.blocks, self.taps, self.found, self.hooks = blocks, taps, {}, []

    def __enter__(self) -> dict[int, torch.Tensor]:
        if self.taps:
            layers, norm = self.blocks
            for t in self.taps:
                module = layers[t] if t < len(layers) else norm

                def hook(_module, args, kwargs, t=t):
                    self.found[t] = args[0] if args else kwargs["hidden_states"]

                self.hooks.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        return self.found

    def __exit__(self, *exc) -> None:
        for h in self.hooks:
            h.remove()


@torch.inference_mode()
def batched_forward(lanes: list[HFRunner], feeds: list[Feed], need_logits: bool) -> list[Scores]:
    """B lanes of one model in one forward. Each lane's cache (S_b slots) is copied into one
    batched `DynamicCache`, right-padded to S = max S_b; the new tokens are padded to
    [B, n_max]; a [B, 1, n_max, S + n_max] mask lets lane b's row i see its own S_b slots
    and its own new ancestors only (padding rows see slot 0, and their outputs are dropped).
    After the forward each lane appends its own new keys and values. The copy is the price
    of HF's cache layout (one tensor per layer for the whole batch); the native backend's
    lanes share one static cache and pay nothing."""
    from transformers import DynamicCache

    first, B = lanes[0], len(lanes)
    device = first.device
    starts = [lane.cache.get_seq_length() for lane in lanes]  # S_b
    ns = [f.tokens.shape[0] for f in feeds]
    S, n_max = max(starts), max(ns)
    tokens = torch.zeros(B, n_max, dtype=torch.long, device=device)  # [B, n_max]
    positions = torch.zeros(B, n_max, dtype=torch.long, device=device)  # [B, n_max]
    for b, (f, n) in enumerate(zip(feeds, ns)):
        tokens[b, :n], positions[b, :n] = f.tokens, f.positions
    # new tokens after the padded cache: [B, 1, n_max, S + n_max]
    mask = lanes_mask(starts, ns, [f.visible for f in feeds], device, new_at=[S] * B)[:, None]
    cache = DynamicCache()
    if S > 0:  # every layer's keys and values, each lane right-padded to S slots
        ref = next(lane for lane, S_b in zip(lanes, starts) if S_b > 0).cache.layers
        for i, like in enumerate(ref):
            layers = [lane.cache.layers[i] if S_b else None for lane, S_b in zip(lanes, starts)]
            keys = torch.cat([_padded(None if la is None else la.keys, like.keys, S) for la in layers])
            values = torch.cat([_padded(None if la is None else la.values, like.values, S) for la in layers])
            cache.update(keys, values, i)  # [B, H, S, D] each
    with tap_inputs(first.blocks, first.taps) as found:
        out = first.model(
            input_ids=tokens,
            position_ids=positions,
            attention_mask=first.mask_4d(mask),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=0 if need_logits else 1,
        )
    for b, (lane, n) in enumerate(zip(lanes, ns)):
        for i, layer in enumerate(cache.layers):
            lane.cache.update(layer.keys[b : b + 1, :, S : S + n], layer.values[b : b + 1, :, S : S + n], i)
    features = features_of(first.taps, found)  # [B, n_max, F]
    return [
        Scores(
            out.logits[b, :n] if need_logits else None,  # [n_b, V]
            None if features is None else features[b, :n],  # [n_b, F]
        )
        for b, n in enumerate(ns)
    ]


def _padded(t: torch.Tensor | None, like: torch.Tensor, S: int) -> torch.Tensor:
    """A lane's cached keys or values [1, H, S_b, D] right-padded with zeros to [1, H, S, D];
    None (an empty cache): zeros shaped as `like`'s heads and head dim."""
    if t is None:
        return like.new_zeros(1, like.shape[1], S, like.shape[3])
    S_b = t.shape[-2]
    return torch.nn.functional.pad(t, (0, 0, 0, S - S_b)) if S_b < S else t


def eos_token_ids(model) -> frozenset[int]:
    """EOS ids from the model's generation config (falling back to its config)."""
    for cfg in (getattr(model, "generation_config", None), getattr(model, "config", None), model):
        eos = getattr(cfg, "eos_token_id", None)
        if eos is None:
            eos = getattr(cfg, "eos_token_ids", None)
        if eos is not None:
            return eos_ids(eos)
    return frozenset()


# what a Hugging Face hub id looks like: "name" or "org/name"
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


def resolve_path(path) -> str | Path:
    """A local directory (checked for config.json) or, otherwise, a hub id as given.

    A string is a local path when it is a `Path`, starts with ".", "/" or "~", exists, cannot
    be a hub id ("name" or "org/name") or starts with a directory that exists here
    ("models/llama" with a local "models/"): then a missing directory is an error, never a
    hub download attempt.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"a model path must be a string or a Path, got {type(path).__name__}")
    text = os.fspath(path)
    local = Path(text).expanduser()
    first = text.replace(os.sep, "/").split("/")[0]
    looks_local = (
        isinstance(path, os.PathLike)
        or text.startswith((".", "/", "~", os.sep))
        or local.exists()
        or not HUB_ID.fullmatch(text)
        or ".." in text
        or (text != first and Path(first).is_dir())
    )
    if not looks_local:
        return text
    if not local.exists():
        raise ValueError(
            f"no model at {text!r}: {local.absolute()} does not exist; give a directory with "
            "config.json and weights"
        )
    if not (local / "config.json").is_file():
        raise ValueError(f"no model at {text!r}: expected a directory with config.json and weights")
    return local


def load_model(path, dtype: torch.dtype, device, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """An HF causal LM in eval mode from a local directory or a (cached) hub id."""
    from transformers import AutoModelForCausalLM

    path = resolve_path(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype, attn_implementation=attn_implementation
        )
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error type for corrupt files
        where = (
            f"{str(path)!r} (no local directory of that name in {Path.cwd()}, so read as a hub id)"
            if isinstance(path, str)
            else repr(str(path))
        )
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise ValueError(
            f"cannot load a causal LM from {where}: {first} "
            f"(give a local directory with config.json and intact weights, or a hub id that is cached)"
        ) from e
    if device is not None:
        model = model.to(device)
    return model.eval()


# tokenizer_config.json classes that are tokenizer.json alone: loaded without AutoTokenizer,
# which reads the model's config first (more imports, the same object)
GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path):
    """The tokenizer saved with a model, or None (token-id prompts still work)."""
    where = resolve_path(path)
    try:
        config = where / "tokenizer_config.json" if isinstance(where, Path) else None
        if config is not None and config.is_file() and (where / "tokenizer.json").is_file():
            if json.loads(config.read_text()).get("tokenizer_class") in GENERIC_TOKENIZERS:
                from transformers import PreTrainedTokenizerFast

                return PreTrainedTokenizerFast.from_pretrained(str(where))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(where))
    except (OSError, ValueError):
        return None


def quiet_transformers() -> None:
    """Progress bars and advisory warnings from transformers would interleave with output."""
    from huggingface_hub.utils import logging as hub_logging
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    hub_logging.set_verbosity_error()
