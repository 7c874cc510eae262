"""Well-known models as the cost model sees them: parameters, training FLOPs and activation bytes
per sample, with the assumptions stated. Estimates, not measurements: `hetrain plan` measures.

Transformers (decoder LMs and ViT), per sample of T tokens, L layers, width d, vocabulary V:
  FLOPs        T · (6·N + 12·L·d·T)              forward + backward; the second term is attention
                                                 (the PaLM / nanoGPT estimate). Fine-tuning N_t of
                                                 the N: T · (4·N + 2·N_t + 12·L·d·T) (the backward
                                                 still computes every layer's input gradient, 2·N
                                                 per token, but weight gradients only for the N_t)
  activations  L · k·T·d  +  T·V·6  +  2·T·d      bytes at 16-bit: k·T·d per layer (k = 34 for a GELU
                                                 MLP, Korthikanti et al. 2022, with SDPA/flash
                                                 attention so no T² scores are kept; 46 for Llama's
                                                 SwiGLU MLP and RMSNorm), logits in bf16 plus the
                                                 loss's fp32 log-softmax (ViT: one class row), the
                                                 embedding output
  checkpointing per-block: keeps each block's input (2·T·d), one block's activations during
                recompute, and the logits
LoRA (Hu et al. 2021): an adapted linear in→out of rank r adds r·(in + out) trainable parameters
(A: r×in, B: out×r). The presets adapt q, k, v and o of every layer (the QLoRA / common choice;
PEFT's default for Llama is q and v only: give --trainable-params for that): per layer
r·(2d + 2(d + kv) + 2d) = r·(6d + 2·kv), kv the key/value width (8 KV heads × 128 = 1024 for
Llama 3 8B and Mistral 7B). The memory model keeps the frozen base at the training precision
(bf16 weights under --precision bf16, as PEFT loads it) with no gradients or optimizer state, and
the adapters in fp32 with theirs (memory.py); LoRA's extra activations (x·A per adapted linear,
r values a token) are left out: under 1% of a layer's at r ≤ 64.
Convolutional nets: FLOPs = 3 × 2 × multiply-adds of the forward; activations ≈ 3 saved tensors
(conv input, norm input, activation output) per convolution output, at 16-bit.
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import UsageError, did_you_mean
from .memory import check_trainable
from .profile import ModelSpec


def transformer(name: str, *, params: int, layers: int, d_model: int, seq_len: int, vocab: int,
                k: float = 34.0, per_token_logits: bool = True, note: str = "",
                trainable: int | None = None) -> ModelSpec:
    """A transformer's ModelSpec from its shape, with the formulas of the module docstring;
    `trainable`: fine-tuning only that many of the parameters."""
    T, d, L = seq_len, d_model, layers
    n_t = params if trainable is None else trainable
    flops = T * (4 * params + 2 * n_t + 12 * L * d * T)
    logits = (T if per_token_logits else 1) * vocab * 6
    per_layer = k * T * d
    act = L * per_layer + logits + 2 * T * d
    kept = 2 * T * d * L + per_layer + logits + 2 * T * d
    return ModelSpec(
        name=name, params=params, flops_per_sample=float(flops), activation_bytes_per_sample=float(act),
        activation_precision="bf16", checkpoint_fraction=min(1.0, kept / act), blocks=L, trainable_params=trainable,
        assumptions=(f"{L} layers, d={d}, {T} tokens/sample, vocabulary {vocab}; FLOPs "
                     + ("T·(6N + 12·L·d·T); " if trainable is None else "T·(4N + 2·N_trainable + 12·L·d·T); ")
                     + f"activations {k:g}·T·d bytes per layer at bf16 with flash/SDPA attention + logits"
                     + (f"; {note}" if note else "")))


# The shapes of the transformer presets (the arguments of `transformer`), kept so that a
# fine-tuned variant can be rebuilt from them (`fine_tuned`).
SHAPES: dict[str, dict] = {
    "gpt2-124m": dict(params=124_439_808, layers=12, d_model=768, seq_len=1024, vocab=50257,
                      note="GPT-2 small at its 1024-token context"),
    "gpt2-350m": dict(params=354_823_168, layers=24, d_model=1024, seq_len=1024, vocab=50257,
                      note="GPT-2 medium at its 1024-token context"),
    "llama-1b": dict(params=1_235_814_400, layers=16, d_model=2048, seq_len=2048, vocab=128256, k=46.0,
                     note="Llama 3.2 1B shape (GQA, SwiGLU), 2048-token samples"),
    "llama-3b": dict(params=3_212_749_824, layers=28, d_model=3072, seq_len=2048, vocab=128256, k=46.0,
                     note="Llama 3.2 3B shape, 2048-token samples"),
    "llama-8b": dict(params=8_030_261_248, layers=32, d_model=4096, seq_len=2048, vocab=128256, k=46.0,
                     note="Llama 3.1 8B shape (MLP 14336, 8 KV heads), 2048-token samples"),
    "mistral-7b": dict(params=7_241_732_096, layers=32, d_model=4096, seq_len=2048, vocab=32000, k=46.0,
                       note="Mistral 7B v0.1 shape (MLP 14336, 8 KV heads), 2048-token samples"),
    # Sailor (SOSP 2025) trains "OPT-350" as a Megatron GPT of OPT-350M's shape (its artifact's
    # training_config_opt_350.json): 24 layers, d 1024, 16 heads, 2048-token samples, OPT's
    # vocabulary; tied embeddings, so 24·12,596,224 + 50272·1024 + 2048·1024 + 2048 parameters.
    # (Hugging Face's OPT-350M projects its embeddings to 512 and has 331M.)
    "opt-350m": dict(params=355_887_104, layers=24, d_model=1024, seq_len=2048, vocab=50272,
                     note="OPT-350M's shape as Sailor trains it (Megatron GPT), 2048-token samples"),
    "vit-b16": dict(params=86_567_656, layers=12, d_model=768, seq_len=197, vocab=1000, per_token_logits=False,
                    note="ViT-B/16 at 224×224 (196 patches + class token)"),
    "demo-gpt": dict(params=829_696, layers=4, d_model=128, seq_len=64, vocab=256,
                     note="the GPT of `hetrain demo` (4 heads, tied embeddings)"),
}

PRESETS: dict[str, ModelSpec] = {
    **{name: transformer(name, **shape) for name, shape in SHAPES.items()},
    "resnet50": ModelSpec(
        name="resnet50", params=25_557_032, flops_per_sample=3 * 2 * 4.1e9,
        activation_bytes_per_sample=54e6, activation_precision="bf16", checkpoint_fraction=0.3,
        assumptions=("224×224 images; 4.1 G multiply-adds forward (×2 FLOPs, ×3 with backward); ~9M "
                     "convolution-output elements, 3 saved tensors each at bf16 ≈ 54 MB/sample; "
                     "checkpointing per stage keeps ~30%")),
    # From EfficientNet-B0's block table (Tan & Le 2019, Table 1: stem 32, MBConv stages
    # e1-16, e6-24×2, e6-40×2, e6-80×3, e6-112×3, e6-192×4, e6-320, head 1280) walked at 224×224:
    # 5,288,548 parameters (timm's and torchvision's count), 0.386 G multiply-adds, 6.74M
    # convolution outputs (expand, depthwise, project; squeeze-excite is negligible).
    "efficientnet-b0": ModelSpec(
        name="efficientnet-b0", params=5_288_548, flops_per_sample=3 * 2 * 0.386e9,
        activation_bytes_per_sample=3 * 2 * 6.74e6, activation_precision="bf16", checkpoint_fraction=0.3,
        assumptions=("224×224 images; 0.386 G multiply-adds forward (×2 FLOPs, ×3 with backward); 6.74M "
                     "convolution-output elements, 3 saved tensors each at 16-bit ≈ 40 MB/sample (as for "
                     "resnet50); checkpointing per stage keeps ~30%")),
}

# Key/value projection width of the presets with grouped-query attention (the others: d).
KV_DIM = {"llama-1b": 512, "llama-3b": 1024, "llama-8b": 1024, "mistral-7b": 1024}
LORA_PRESET_RANK = 16            # the rank of the '-lora' presets


def lora_params(name: str, rank: int) -> int:
    """Trainable parameters of LoRA at `rank` on q, k, v, o of every layer of preset `name`."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise UsageError(f"--lora {rank!r} is not a rank", "give a positive whole rank, e.g. --lora 16")
    base = name.removesuffix("-lora")
    if base not in SHAPES:
        raise UsageError(f"--lora {rank} on {name!r}: its layer shapes are not known (not a transformer preset)",
                         f"use one of {', '.join(SHAPES)}, or give --trainable-params N (LoRA of rank r "
                         "adds r·(in+out) per adapted in→out linear)")
    shape = SHAPES[base]
    d = shape["d_model"]
    return shape["layers"] * rank * (6 * d + 2 * KV_DIM.get(base, d))


def fine_tuned(name: str, *, trainable: int | None = None, lora_rank: int | None = None) -> ModelSpec:
    """Preset `name` fine-tuned: `trainable` parameters, or LoRA at `lora_rank` (not both)."""
    if trainable is not None and lora_rank is not None:
        raise UsageError("--lora and --trainable-params both given", "give one of them: the rank for a "
                         "preset's LoRA adapters, or the trainable parameter count")
    spec = preset(name)
    base = spec.name.removesuffix("-lora")
    if lora_rank is not None:
        trainable = lora_params(base, lora_rank)
    if trainable is None:
        return spec
    how = (f"LoRA rank {lora_rank} on q,k,v,o of every layer: {trainable:,} trainable parameters"
           if lora_rank is not None else f"{trainable:,} trainable parameters")
    if base not in SHAPES:      # not rebuilt from a shape: FLOPs as for full training (ModelSpec checks the count)
        return replace(spec, trainable_params=trainable, assumptions=f"{spec.assumptions}; fine-tuning {how} "
                       "(FLOPs as for full training)")
    shape = SHAPES[base]
    check_trainable(shape["params"], trainable, f"model {base!r}")
    name_out = f"{base}-lora" if lora_rank == LORA_PRESET_RANK else (
        f"{base}-lora{lora_rank}" if lora_rank is not None else f"{base}-ft")
    return transformer(name_out, **{**shape, "note": f"{shape['note']}; fine-tuning {how}, frozen base "
                                    "at the training precision"}, trainable=trainable)


def preset(name: str) -> ModelSpec:
    """The preset called `name`; an unknown name is a UsageError that lists close ones."""
    key = name.strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    raise UsageError(f"unknown model preset {name!r}{did_you_mean(key, PRESETS)}",
                     f"use one of {', '.join(PRESETS)}, or give --params, --flops-per-sample and "
                     "--activation-bytes")


for _base in ("llama-8b", "mistral-7b"):
    PRESETS[f"{_base}-lora"] = fine_tuned(_base, lora_rank=LORA_PRESET_RANK)
