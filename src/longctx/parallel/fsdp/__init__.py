"""FSDP2 over the model (hybrid ZeRO / HSDP): the units, their gradient buckets, mixed precision and
where the model states live (memory.model_states)."""
