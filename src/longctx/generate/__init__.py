"""Text generation: the KV-cache engine (engine.py), sampling (sampling.py), `longctx generate` (cli.py)."""
