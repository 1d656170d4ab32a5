"""Text generation as a library: the contracts (contracts.py: cache, backend, drafter, rounds), one decode
loop (loop.py) that plain (engine.py), chain and tree speculative decoding (speculative.py, cape.py) share,
one Result (results.py); sampling (sampling.py); `longctx generate` (cli.py)."""
