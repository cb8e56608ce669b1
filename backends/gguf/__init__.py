"""GGUF files converted into Hugging Face folders: any `--model x.gguf`, and the default model
(backends/default_model.py)."""
