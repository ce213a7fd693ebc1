"""Quantized checkpoints: how each linear layer's weight is stored (`schemes`), read (`layouts`), held
(`weights`) and multiplied (`methods`), and the loader's part in it (`loading`). docs/features/quantization.md."""
