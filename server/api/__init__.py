"""The HTTP APIs kvfork speaks, one package each, laid out alike:

    chat/         POST /v1/chat/completions             protocol.py  reply.py  route.py
    completions/  POST /v1/completions                  protocol.py  reply.py  route.py
    messages/     POST /v1/messages (Anthropic)         protocol.py  translate.py  reply.py  route.py
    responses/    POST, GET, DELETE /v1/responses       protocol.py  translate.py  reply.py  store.py  route.py

protocol.py holds the API's wire types, translate.py says its request as the chat request it means,
reply.py says the output in its shape, route.py is the handler. Every route is `prepare.py` (a body
-> a `Job`: template, tokens, sampling, grammar) then `respond.py` (the one driver: generation, then
the API's reply with start / piece / finish; a stream goes out through sse.py). openai.py holds the
OpenAI shapes more than one route speaks. The daemon's own endpoints (models, health, metrics,
loads, named sessions) are in server/routes/.
"""
