"""Anthropic's Messages API on top of the chat path: protocol.py (wire types), translate.py (a
Messages body -> the chat request it means), reply.py (chat output -> Anthropic's replies and
stream events), route.py (POST /v1/messages and /v1/messages/count_tokens)."""
