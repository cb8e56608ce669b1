"""Anthropic Messages API on top of the chat-completions path (translation in, reply shapes out)."""
