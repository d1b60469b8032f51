"""KV caches: layouts, codecs and eviction policies behind one interface (base.KVCache)."""
