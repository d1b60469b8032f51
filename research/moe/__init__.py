"""Small MoE language models trained on servax's corpus (routing skew from a real router)."""
from research.moe.training import TrainConfig, TrainResult, routing_traces, train

__all__ = ["TrainConfig", "TrainResult", "routing_traces", "train"]
