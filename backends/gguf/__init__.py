"""A llama GGUF converted into a Hugging Face folder (the default model's route: backends/default_model.py)."""
