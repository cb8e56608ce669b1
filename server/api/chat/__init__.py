"""OpenAI's chat completions (POST /v1/chat/completions): protocol.py, reply.py, route.py."""
