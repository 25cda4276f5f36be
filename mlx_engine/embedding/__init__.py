"""Embedding models: sentence-transformers folders and GGUF files with a pooling type, run as packed forwards of a
decoder the engine already runs (`packed.py`), pooled, normalized and truncated as the checkpoint says. `layout.py`
reads no MLX (front ends may import it); `engine.EmbeddingEngine` is what `Engine.load` returns for such a model."""
