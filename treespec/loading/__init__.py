"""The one loader: what a path is, what its weights compute in, and the runners and tokenizers
behind it. Every front end loads through here; nothing here decides how to decode.

    paths.py     path_kind(path)       a GGUF file, an EAGLE-3 head directory, a local model
                                       directory or a hub id
                 checkpoint(path)      the model directory behind it (a GGUF file converted once
                                       into a cached directory, `loading.gguf`)
    weights.py   resolve_device / resolve_dtype   what a user typed, as a device and dtype that exist
                 quantize_setting      a --quantize flag as the loader takes it ("none": dense)
                 resolve_weights       the target's dtype and weights format, "auto" decided
                 resolve_quantize      a draft model's or a feature head's weights format
    models.py    load_models(...)      target, draft (model or head), tokenizers and what they were
                                       loaded from (the key of their measured costs): the one
                                       path `SpeculativeDecoder.from_pretrained` takes
                 load_runner(path)     a `Runner`: native straight from safetensors where it
                                       supports the architecture, else Hugging Face's
                 load_tokenizer(path)  the tokenizer saved with a model (None if there is none)
    gguf.py      GGUF files read and converted
"""

from .models import LoadedModels, load_head, load_models, load_runner, load_tokenizer, prepare_ranks
from .paths import PathKind, checkpoint, path_kind
from .weights import quantize_setting, resolve_device, resolve_dtype, resolve_quantize, resolve_weights

__all__ = [
    "LoadedModels",
    "PathKind",
    "checkpoint",
    "load_head",
    "load_models",
    "load_runner",
    "load_tokenizer",
    "path_kind",
    "prepare_ranks",
    "quantize_setting",
    "resolve_device",
    "resolve_dtype",
    "resolve_quantize",
    "resolve_weights",
]
