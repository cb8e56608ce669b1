"""Text: the chat template, tokenizer, incremental detokenizer and stop strings."""
