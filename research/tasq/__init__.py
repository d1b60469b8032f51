"""TaSQ: 1-bit vector-quantised KV cache tailored to the model (query-weighted, head-
normalised, covariance-grouped), folded into the projection weights."""
from research.tasq.artifacts import restore_state, save_state
from research.tasq.baselines import CQState, cq_style, int8_kv, kivi_kv, sign_kv
from research.tasq.config import TaSQConfig
from research.tasq.cq import CQCodec
from research.tasq.fingerprint import model_fingerprint
from research.tasq.fold import fold_kv_scales
from research.tasq.kivi import KIVICodec
from research.tasq.metrics import (attention_output_error, bits_per_channel, cache_param_bytes,
                                   max_batch_with_codebooks)
from research.tasq.sign import SignCodec
from research.tasq.transform import TaSQState, apply_state, calibrate_state, plain_vq, tasq
from research.tasq.vq import VQCodec

__all__ = ["TaSQConfig", "TaSQState", "tasq", "plain_vq", "apply_state", "calibrate_state",
           "fold_kv_scales", "model_fingerprint", "save_state", "restore_state",
           "int8_kv", "kivi_kv", "sign_kv", "cq_style", "CQState", "VQCodec", "CQCodec",
           "KIVICodec", "SignCodec", "attention_output_error", "bits_per_channel",
           "cache_param_bytes", "max_batch_with_codebooks"]
