"""llmcompressor's round-to-nearest quantization of a checkpoint (no calibration data), lm_head left as it is:
run in a virtual environment with llmcompressor (benchmarks/quantized/make_checkpoints.sh).

    python llmcompressor_rtn.py MODEL W8A8|W4A16 OUT [GROUP_SIZE]
"""

import sys

from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier


def main() -> None:
    model, scheme, out = sys.argv[1:4]
    if len(sys.argv) > 4:  # 4-bit weights by groups of another size
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        weights = QuantizationArgs(
            num_bits=4, type="int", symmetric=True, strategy="group", group_size=int(sys.argv[4])
        )
        scheme = QuantizationScheme(targets=["Linear"], weights=weights)
        recipe = QuantizationModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])
    else:
        recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
    oneshot(model=model, recipe=recipe, output_dir=out)


if __name__ == "__main__":
    main()
