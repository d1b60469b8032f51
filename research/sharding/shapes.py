"""Model shapes the scale-out code is sized for (from the models' published configs)."""
from research.model.config import ModelConfig

# HuggingFaceTB/SmolLM2-135M(-Instruct): the embedded GGUF's metadata (research.model.load)
SMOLLM2_135M = ModelConfig(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                           head_dim=64, ffn_dim=1536, rope_theta=100000.0, norm_eps=1e-5,
                           max_position=8192, bos_token_id=1, eos_token_id=2)
# meta-llama/Llama-3.1-8B config.json (untied LM head, GQA 32 q / 8 KV heads)
LLAMA31_8B = ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                         head_dim=128, ffn_dim=14336, rope_theta=500000.0, norm_eps=1e-5,
                         tie_embeddings=False, max_position=131072)
