"""The architectures pagedserve implements, by the name in a checkpoint's `architectures`."""

from services.worker.models.llama import LlamaForCausalLM, Qwen2ForCausalLM

ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}
