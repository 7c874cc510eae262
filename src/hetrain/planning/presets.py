"""Well-known models as the cost model sees them: parameters, training FLOPs and activation bytes
per sample, with the assumptions stated. Estimates, not measurements: `hetrain plan` measures.

Transformers (decoder LMs and ViT), per sample of T tokens, L layers, width d, vocabulary V:
  FLOPs        T · (6·N + 12·L·d·T)              forward + backward; the second term is attention
                                                 (the PaLM / nanoGPT estimate)
  activations  L · k·T·d  +  T·V·6  +  2·T·d      bytes at 16-bit: k·T·d per layer (k = 34 for a GELU
                                                 MLP, Korthikanti et al. 2022, with SDPA/flash
                                                 attention so no T² scores are kept; 46 for Llama's
                                                 SwiGLU MLP and RMSNorm), logits in bf16 plus the
                                                 loss's fp32 log-softmax (ViT: one class row), the
                                                 embedding output
  checkpointing per-block: keeps each block's input (2·T·d), one block's activations during
                recompute, and the logits
Convolutional nets: FLOPs = 3 × 2 × multiply-adds of the forward; activations ≈ 3 saved tensors
(conv input, norm input, activation output) per convolution output, at 16-bit.
"""

from __future__ import annotations

from ..errors import UsageError, did_you_mean
from .profile import ModelSpec


def transformer(name: str, *, params: int, layers: int, d_model: int, seq_len: int, vocab: int,
                k: float = 34.0, per_token_logits: bool = True, note: str = "") -> ModelSpec:
    """A transformer's ModelSpec from its shape, with the formulas of the module docstring."""
    T, d, L = seq_len, d_model, layers
    flops = T * (6 * params + 12 * L * d * T)
    logits = (T if per_token_logits else 1) * vocab * 6
    per_layer = k * T * d
    act = L * per_layer + logits + 2 * T * d
    kept = 2 * T * d * L + per_layer + logits + 2 * T * d
    return ModelSpec(
        name=name, params=params, flops_per_sample=float(flops), activation_bytes_per_sample=float(act),
        activation_precision="bf16", checkpoint_fraction=min(1.0, kept / act), blocks=L,
        assumptions=(f"{L} layers, d={d}, {T} tokens/sample, vocabulary {vocab}; FLOPs T·(6N + 12·L·d·T); "
                     f"activations {k:g}·T·d bytes per layer at bf16 with flash/SDPA attention + logits"
                     + (f"; {note}" if note else "")))


PRESETS: dict[str, ModelSpec] = {
    "gpt2-124m": transformer("gpt2-124m", params=124_439_808, layers=12, d_model=768, seq_len=1024,
                             vocab=50257, note="GPT-2 small at its 1024-token context"),
    "gpt2-350m": transformer("gpt2-350m", params=354_823_168, layers=24, d_model=1024, seq_len=1024,
                             vocab=50257, note="GPT-2 medium at its 1024-token context"),
    "llama-1b": transformer("llama-1b", params=1_235_814_400, layers=16, d_model=2048, seq_len=2048,
                            vocab=128256, k=46.0, note="Llama 3.2 1B shape (GQA, SwiGLU), 2048-token samples"),
    "llama-3b": transformer("llama-3b", params=3_212_749_824, layers=28, d_model=3072, seq_len=2048,
                            vocab=128256, k=46.0, note="Llama 3.2 3B shape, 2048-token samples"),
    "llama-8b": transformer("llama-8b", params=8_030_261_248, layers=32, d_model=4096, seq_len=2048,
                            vocab=128256, k=46.0, note="Llama 3.1 8B shape, 2048-token samples"),
    "vit-b16": transformer("vit-b16", params=86_567_656, layers=12, d_model=768, seq_len=197, vocab=1000,
                           per_token_logits=False, note="ViT-B/16 at 224×224 (196 patches + class token)"),
    "resnet50": ModelSpec(
        name="resnet50", params=25_557_032, flops_per_sample=3 * 2 * 4.1e9,
        activation_bytes_per_sample=54e6, activation_precision="bf16", checkpoint_fraction=0.3,
        assumptions=("224×224 images; 4.1 G multiply-adds forward (×2 FLOPs, ×3 with backward); ~9M "
                     "convolution-output elements, 3 saved tensors each at bf16 ≈ 54 MB/sample; "
                     "checkpointing per stage keeps ~30%")),
    "demo-gpt": transformer("demo-gpt", params=829_696, layers=4, d_model=128, seq_len=64, vocab=256,
                            note="the GPT of `hetrain demo` (4 heads, tied embeddings)"),
}


def preset(name: str) -> ModelSpec:
    """The preset called `name`; an unknown name is a UsageError that lists close ones."""
    key = name.strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    raise UsageError(f"unknown model preset {name!r}{did_you_mean(key, PRESETS)}",
                     f"use one of {', '.join(PRESETS)}, or give --params, --flops-per-sample and "
                     "--activation-bytes")
