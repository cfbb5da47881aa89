"""Models: the GGUF converter, the default model, random-weight models of real shapes."""
