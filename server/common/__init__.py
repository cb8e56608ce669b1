"""What the routes share: the daemon's flags and the state every route reads.

- config.py: The daemon's own flags (the engine's are in server/engine/config.py); see server/settings.py
- state.py: What every route reads: the engine, the tokenizer, the names the model answers to
"""
