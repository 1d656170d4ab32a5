"""Expert parallelism (parallel.expert): one dispatcher object for every MoE layer, chosen from
config (flat or hierarchical exchange, pipelined chunks, FlexMoE copies) and installed in one place
(install.py)."""
