"""Starting the daemon: the serve command (one model, or a pool's), the aiohttp application it listens with,
where the model comes from, loading it, listening, the distributed ranks and the cache
command.

- serve.py: Run the daemon: listen first (so /health can say "loading"), load, serve until a signal
- pool_daemon.py: The daemon serving several models (`--model NAME=PATH` repeated, `--models-dir`): the
  listener and the routes of `Daemon` (server/launch/serve.py), the models in a `ModelPool`
- app.py: The aiohttp application: routes, the error and auth middlewares, and how it listens
- listening.py: What a daemon (one model's, server/launch/serve.py, or several models', server/launch/pool_daemon.py)
  listens with: its state's application on the configured host and port
- distributed.py: `kvfork serve --distributed`: the same command on every rank, started by a launcher
- model_load.py: Loading a model into its ModelState: the engine's weights and the tokenizer together, then the
  prefix cache's warm prompts; the daemon's one model and each model of a pool load so
- model_source.py: Where `serve`'s model comes from: a folder on this machine, a hub id already in the local
  cache, or one still to download (the default model: to fetch and convert)
- warm.py: `--prefix-cache-warm FILE`: prompts computed at start, so a team's system prompt is warm before the
  first request comes (and, with the disk tier, restored rather than computed on later starts)
- cache_command.py: `kvfork cache ls` / `kvfork cache clear`: show and empty the prefix cache's disk tier
  ($KVFORK_HOME/kv)
"""
