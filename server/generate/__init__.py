"""Turning tokens into replies: one request's run through the engine as text, its grammar, its images, reasoning
and tool calls split from content, and the isolated subprocesses that try grammars.

- generation.py: One request's run through the engine, as text: what every API route streams from
- chat_output.py: From generated text to what a chat reply holds: reasoning, content, tool calls
- reasoning.py: Splits reasoning from content, streaming, for each family's thinking markers
- grammar.py: Constrained decoding: what a request asks for, compiled into an llguidance grammar
- grammar_worker.py: A process that tries grammars before the daemon builds them, so one that compiles too
  long is killed
- isolated.py: Python subprocesses that import only kvfork's code, wherever they are started from
- images.py: Images a request carries: where each comes from, and each one decoded and known by its pixels
"""
