"""Parallelism planner: hardware specs, an analytic cost model and a search that writes a runnable config.

`longctx plan --model llama3-8b --gpus 64 --gpus-per-node 8 --hardware h100 --seq-len 1M` prints a
ranked table and writes the best plan as TOML (see cli.py in this package).
"""
