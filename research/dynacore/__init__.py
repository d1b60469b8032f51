"""DynaCore: disaggregated quantization, one weight set per serving phase (W8A8 for the
compute-bound prefill, W4A16 for the memory-bound decode), plus the disaggregated-serving
cost tools: the KV-size / transfer / billing calculator (disagg.py), the MODELED
roofline (roofline.py), the handoff-protocol quality metrics and a two-process KV handoff. See
experiments/dynacore/README.md."""
from research.dynacore.disagg import (LINKS, LLAMA_31_70B, Pool, crossover_tokens, kv_bytes,
                                      kv_bytes_per_token, request_cost, tasq_codebook_bytes,
                                      transfer_s)
from research.dynacore.roofline import (B200, BF16, GPU, GPUS, H200, W4A16_G64, W8A8, Scheme,
                                        linear_params, tpot_s, ttft_s)
from research.dynacore.handoff import DecodeProcess, insert_records, prefix_records
from research.dynacore.quality import Scores, evaluate_pairs, handoff_logits, windows
from research.dynacore.calib import InputStats, input_stats
from research.dynacore.gptq import ZERO_POINTS, gptq_quantize, rtn_quantize
from research.dynacore.quant import (METHODS, QuantConfig, QuantizedLinear, quantize_weight,
                                     w4a16, w8a8, w8a16)
from research.dynacore.transform import (PhaseWeights, calibrate_weights, calibration_stats,
                                         dynacore, quantize, restore_state, save_state,
                                         weight_bytes)
from research.dynacore.weights import linear_weights

__all__ = ["LINKS", "LLAMA_31_70B", "Pool", "crossover_tokens", "kv_bytes",
           "kv_bytes_per_token", "request_cost", "tasq_codebook_bytes", "transfer_s", "B200",
           "BF16", "GPU", "GPUS", "H200", "W4A16_G64", "W8A8", "Scheme", "linear_params",
           "tpot_s", "ttft_s", "DecodeProcess", "insert_records", "prefix_records",
           "Scores", "evaluate_pairs", "handoff_logits", "windows", "QuantConfig",
           "QuantizedLinear", "quantize_weight", "w4a16", "w8a8", "w8a16", "PhaseWeights",
           "dynacore", "linear_weights", "quantize", "restore_state", "save_state",
           "weight_bytes", "InputStats", "input_stats", "ZERO_POINTS", "gptq_quantize",
           "rtn_quantize", "METHODS", "calibrate_weights", "calibration_stats"]
