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
