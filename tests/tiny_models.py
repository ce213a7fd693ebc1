"""Tiny random-weight models with an offline-trained tokenizer, saved in HF format for tests."""

from __future__ import annotations

import glob
import os
import sysconfig

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_DECODER = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
CONFIGS = {
    "llama": (LlamaConfig, _DECODER),
    "qwen2": (Qwen2Config, _DECODER),
    # Llama 3's RoPE scaling, tied embeddings, and a head_dim that is not hidden / heads.
    "llama3": (
        LlamaConfig,
        dict(
            _DECODER,
            tie_word_embeddings=True,
            head_dim=32,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    # A window shorter than the prompts, so the sliding window matters.
    "mistral": (MistralConfig, dict(_DECODER, sliding_window=8)),
    "qwen3": (Qwen3Config, dict(_DECODER, head_dim=16)),
    "opt": (
        OPTConfig,
        dict(
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            word_embed_proj_dim=64,
            max_position_embeddings=512,
            init_std=0.2,
        ),
    ),
    # OPT-350m's shape: embeddings projected in and out, LayerNorm after each block.
    "opt-post-ln": (
        OPTConfig,
        dict(
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            word_embed_proj_dim=32,
            do_layer_norm_before=False,
            max_position_embeddings=512,
            init_std=0.2,
        ),
    ),
    "gpt2": (GPT2Config, dict(n_embd=64, n_layer=2, n_head=4, n_positions=512)),
}


ARCHITECTURE_OF = {"gpt2": "GPT2LMHeadModel"}


def corpus(limit: int = 40) -> list[str]:
    """Text every machine has offline: the standard library's own sources."""
    stdlib = sysconfig.get_paths()["stdlib"]
    texts = []
    for path in sorted(glob.glob(os.path.join(stdlib, "*.py")))[:limit]:
        with open(path, encoding="utf-8", errors="ignore") as f:
            texts.append(f.read())
    return texts


def build_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )


def build_model(
    directory: str, family: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides
) -> str:
    """Save a tiny random-weight model of `family` with its tokenizer into `directory`, its weights
    (and the dtype its config declares) in `dtype`."""
    tokenizer = build_tokenizer()
    config_class, family_defaults = CONFIGS[family]
    settings = dict(
        vocab_size=len(tokenizer),
        # Wider than the default init, so next-token logits are far apart and float rounding
        # never changes a greedy choice.
        initializer_range=0.2,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=tokenizer.eos_token_id,
    )
    if family in ("llama", "qwen2", "mistral", "qwen3"):
        settings["tie_word_embeddings"] = False
    settings.update(family_defaults)
    settings.update(overrides)
    config = config_class(**settings)
    config.architectures = [ARCHITECTURE_OF.get(family, config_class.__name__.replace("Config", "ForCausalLM"))]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(dtype)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.eos_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def hf_greedy(directory: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The oracle: HF transformers' own greedy generate, one prompt at a time (no padding)."""
    return _hf_generate(directory, prompt_ids, max_new_tokens)[0]


def hf_beam_search(
    directory: str, prompt_ids: list[int], width: int, max_new_tokens: int, **options
) -> list[list[int]]:
    """The oracle for beam search: HF's `generate(num_beams=width, num_return_sequences=width)`."""
    return _hf_generate(directory, prompt_ids, max_new_tokens, num_beams=width, num_return_sequences=width, **options)


def _hf_generate(directory: str, prompt_ids: list[int], max_new_tokens: int, **options) -> list[list[int]]:
    """Generated ids of each returned sequence, up to and including the first EOS."""
    return _generated(_hf_model(directory), prompt_ids, max_new_tokens, **options)


def _generated(model, prompt_ids: list[int], max_new_tokens: int, **options) -> list[list[int]]:
    out = _greedy(model, prompt_ids, max_new_tokens, **options)
    rows = out[:, len(prompt_ids) :].tolist()
    return [_through_eos(row, model.generation_config.eos_token_id) for row in rows]


def _greedy(model, prompt_ids: list[int], max_new_tokens: int, **options):
    with torch.no_grad():
        return model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            **options,
        )


def _through_eos(row: list[int], eos: int) -> list[int]:
    return row[: row.index(eos) + 1] if eos in row else row


_HF_MODELS: dict[tuple[str, torch.dtype], object] = {}


def _hf_model(directory: str, dtype: torch.dtype = torch.float32):
    if (directory, dtype) not in _HF_MODELS:
        _HF_MODELS[directory, dtype] = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
    return _HF_MODELS[directory, dtype]


def hf_greedy_with_logprobs(
    directory: str, prompt_ids: list[int], max_new_tokens: int, dtype: torch.dtype, top: int = 5
) -> tuple[list[int], list[dict[int, float]]]:
    """HF's greedy generate with the model in `dtype` (bf16 on a CPU: what the closeness rule compares
    against), and each position's `top` log-probabilities by token id, up to and including EOS."""
    return greedy_with_logprobs(_hf_model(directory, dtype), prompt_ids, max_new_tokens, top)


def greedy_with_logprobs(
    model, prompt_ids: list[int], max_new_tokens: int, top: int = 5
) -> tuple[list[int], list[dict[int, float]]]:
    """`model`'s greedy generate (an HF model), with each position's `top` log-probabilities by token id."""
    out = _greedy(model, prompt_ids, max_new_tokens, output_logits=True, return_dict_in_generate=True)
    tokens = _through_eos(out.sequences[0, len(prompt_ids) :].tolist(), model.generation_config.eos_token_id)
    tops = []
    for logits in out.logits[: len(tokens)]:
        values, indices = torch.log_softmax(logits[0].float(), -1).topk(top)
        tops.append(dict(zip(indices.tolist(), values.tolist())))
    return tokens, tops


def check_logprobs_close(
    ours: list[tuple[list[int], list[dict]]], reference: list[tuple[list[int], list[dict]]]
) -> list[int]:
    """vLLM's rule for outputs in a half type (its tests' `check_logprobs_close`): at each position the
    two greedy tokens are equal, or each side's token is among the other's top log-probabilities, after
    which that sequence's comparison ends. Returns how many leading tokens each pair shares."""
    agreed = []
    for s, ((tokens, tops), (expected, expected_tops)) in enumerate(zip(ours, reference, strict=True)):
        assert tokens and expected, f"sequence {s}: no tokens"
        same = 0
        for i, (token, other) in enumerate(zip(tokens, expected)):
            if token != other:
                assert token in expected_tops[i] and other in tops[i], (
                    f"sequence {s}, position {i}: {token} (ours, top {sorted(tops[i])}) against {other} "
                    f"(reference, top {sorted(expected_tops[i])})"
                )
                break
            same += 1
        agreed.append(same)
    return agreed


def make_lora_adapter(
    base_dir: str,
    out_dir: str,
    rank: int = 4,
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    seed: int = 0,
    alpha: float = 8.0,
    use_rslora: bool = False,
    layers: list[int] | None = None,
) -> str:
    """A random LoRA adapter of the base model, saved by peft in its own format (B is random too, so that
    the adapter changes the model's tokens)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets),
        init_lora_weights=False,
        use_rslora=use_rslora,
        layers_to_transform=layers,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    with torch.no_grad():  # peft's random B is small: larger, so that every adapter's greedy tokens differ
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(8.0)
    model.save_pretrained(out_dir)
    return out_dir


_HF_LORA_MODELS: dict[tuple[str, str], object] = {}


def hf_lora_greedy(base_dir: str, adapter_dir: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The oracle with an adapter: HF transformers' greedy generate on the base model with peft applying it."""
    return hf_lora_generate(base_dir, adapter_dir, prompt_ids, max_new_tokens)[0]


def hf_lora_generate(
    base_dir: str, adapter_dir: str, prompt_ids: list[int], max_new_tokens: int, **options
) -> list[list[int]]:
    """As `_hf_generate`, with peft applying the adapter (beam search with `num_beams` and
    `num_return_sequences`)."""
    from peft import PeftModel

    key = (base_dir, adapter_dir)
    if key not in _HF_LORA_MODELS:
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        _HF_LORA_MODELS[key] = PeftModel.from_pretrained(base, adapter_dir).eval()
    return _generated(_HF_LORA_MODELS[key], prompt_ids, max_new_tokens, **options)
