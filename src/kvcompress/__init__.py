"""kvcompress: KV-cache compression for HuggingFace transformers causal LMs.

    import kvcompress as kvc
    model, tokenizer = kvc.load_model()
    result = kvc.generate(model, tokenizer, prompt, method=kvc.SnapKV(budget=1024))
"""

from .cache import CacheMisuseError, KVCompressCache, UnsupportedModelError
from .attention import sdpa_choices
from .decode import Compile
from .generation import Prefill, PromptTooLongError, compress, generate, prefill, teacher_forced_logprobs
from .result import Result, load
from .saved import CacheFileError
from .methods import H2O, KVzip, METHODS, ExpectedAttention, FullKV, InvalidParameterError, Loki, Method, Quest, ShadowKV, SnapKV, StreamingLLM, method_from_name, method_from_spec, register_method
from .models import ModelNotAvailableError, load_model

__all__ = [
    "CacheFileError",
    "CacheMisuseError",
    "Compile",
    "ExpectedAttention",
    "FullKV",
    "H2O",
    "InvalidParameterError",
    "KVCompressCache",
    "KVzip",
    "Loki",
    "METHODS",
    "Method",
    "ModelNotAvailableError",
    "Prefill",
    "PromptTooLongError",
    "Quest",
    "Result",
    "ShadowKV",
    "SnapKV",
    "StreamingLLM",
    "UnsupportedModelError",
    "compress",
    "generate",
    "load",
    "load_model",
    "prefill",
    "teacher_forced_logprobs",
    "method_from_name",
    "method_from_spec",
    "register_method",
    "sdpa_choices",
]
