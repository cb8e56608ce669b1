"""OpenAI's text completions (POST /v1/completions): protocol.py, reply.py, route.py."""
