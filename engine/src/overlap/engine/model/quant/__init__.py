"""Quantized checkpoints: the format picks how a projection's weight is stored and computed, the model code stays
format-blind.

- `formats`: reads `quantization_config` (compressed-tensors, fp8, GPTQ, AWQ) into a `QuantFormat` and each
  projection's tensors into one canonical `QuantizedWeight` (or a float tensor, where the format is dequantized at
  load), refusing what it cannot compute with the tensor or field it trips on.
- `weight`: `QuantizedWeight`, one layout for every integer format (unsigned codes, scales and zero points per group,
  an optional column order for act-order), which the loader fuses and shards like a float tensor.
- `kernels`: the linear method a `QuantizedWeight` runs with on this machine (`quantized_method`).
"""
