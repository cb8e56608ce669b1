"""OpenAI's Responses API on top of the chat path: protocol.py (wire types), translate.py (a
Responses body -> the chat request it means), reply.py (chat output -> a Response or its stream
events), store.py (stored responses, for previous_response_id), route.py (POST, GET and DELETE
/v1/responses)."""
