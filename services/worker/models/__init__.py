"""The architectures pagedserve implements, by the name in a checkpoint's `architectures`."""

from services.worker.models.gpt2 import GPT2LMHeadModel
from services.worker.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from services.worker.models.opt import OPTForCausalLM

ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
}
# Pooling models (--runner pooling) of the same families: a bare decoder (an embedding model's), and a classifier
for _family, _model in (("Llama", LlamaForCausalLM), ("Mistral", LlamaForCausalLM), ("Qwen2", Qwen2ForCausalLM),
                        ("Qwen3", Qwen3ForCausalLM)):  # fmt: skip
    ARCHITECTURES[f"{_family}Model"] = ARCHITECTURES[f"{_family}ForSequenceClassification"] = _model
