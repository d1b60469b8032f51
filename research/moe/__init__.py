"""Small MoE language models trained on servax's corpus (routing skew from a real router)."""
from research.moe.data import BOS, VOCAB_SIZE, batch_at, decode, encode
from research.moe.training import TrainConfig, TrainResult, routing_traces, train

__all__ = ["TrainConfig", "TrainResult", "routing_traces", "train", "encode", "decode",
           "batch_at", "BOS", "VOCAB_SIZE"]
