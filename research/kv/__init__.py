"""KV caches: layouts, codecs and eviction policies behind one interface (base.KVCache)."""
# Load research.model first: its llama module imports research.kv.dense, which imports
# research.model.attention; entering the cycle from research.kv.dense failed otherwise.
import research.model  # noqa: E402,F401
