"""A bfloat16 checkpoint of random weights (HF's own initialization, seed 0) at the shape of a config, with the
shipped model's tokenizer: what the quantized benchmarks quantize (a dummy-weight model cannot be quantized).

    python benchmarks/quantized/random_checkpoint.py ops/configs/llama-12l-768-bf16 /tmp/llama-12l-768-bf16
"""

import os
import shutil
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM

TOKENIZER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "ops", "models", "tiny-python")


def main() -> None:
    config_dir, out = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(out)
    for name in os.listdir(TOKENIZER):
        if name.startswith("tokenizer") or name in ("special_tokens_map.json", "generation_config.json"):
            shutil.copy(os.path.join(TOKENIZER, name), out)
    print(out)


if __name__ == "__main__":
    main()
