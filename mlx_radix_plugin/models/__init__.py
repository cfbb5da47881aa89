"""Models: the GGUF converter, the default model, random-weight models of real shapes, and
the shape of a model's cache (``CacheList`` layers)."""
