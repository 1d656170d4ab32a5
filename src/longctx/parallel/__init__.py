"""Parallelism over the job floor's mesh, one folder each: context/ (a sequence over head x ctx:
Ulysses around ring), expert/ (MoE experts over expert groups: one dispatcher), fsdp/ (hybrid
ZeRO). parallelize.py composes them on a model, in a fixed order."""
