"""The OpenAI Responses API, said through the chat path (see routes/responses.py)."""
