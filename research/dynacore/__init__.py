"""DynaCore: disaggregated quantization, one weight set per serving phase (W8A8 for the
compute-bound prefill, W4A16 for the memory-bound decode), plus the disaggregated-serving
cost tools (KV size, transfer, roofline). See experiments/dynacore/README.md."""
from research.dynacore.quant import (QuantConfig, QuantizedLinear, quantize_weight, w4a16,
                                     w8a8, w8a16)
from research.dynacore.transform import (PhaseWeights, dynacore, linear_weights, quantize,
                                         restore_state, save_state, weight_bytes)

__all__ = ["QuantConfig", "QuantizedLinear", "quantize_weight", "w4a16", "w8a8", "w8a16",
           "PhaseWeights", "dynacore", "linear_weights", "quantize", "restore_state",
           "save_state", "weight_bytes"]
