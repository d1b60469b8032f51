"""TaSQ: 1-bit vector-quantised KV cache tailored to the model (query-weighted, head-
normalised, covariance-grouped), folded into the projection weights."""
from research.tasq.config import TaSQConfig
from research.tasq.fingerprint import model_fingerprint
from research.tasq.fold import fold_kv_scales
from research.tasq.transform import TaSQState, apply_state, calibrate_state, plain_vq, tasq

__all__ = ["TaSQConfig", "TaSQState", "tasq", "plain_vq", "apply_state", "calibrate_state",
           "fold_kv_scales", "model_fingerprint"]
