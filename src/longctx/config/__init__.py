"""The run configuration: its sections and knobs (schema), loading and writing (load), the rules
of impossible values (rules), Hugging Face config.json mapping (hf), which tokenizer a run means
(tokenizer) and what a resume continues (resume). Pure Python: no torch.
"""

from .fields import SECTIONS, fields_by_key
from .load import (
    build_config,
    build_model_config,
    load_config,
    parse_overrides,
    read_raw,
    read_toml,
    to_dict,
    to_toml,
)
from .presets import MODEL_PRESETS
from .schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    DraftConfig,
    MemoryConfig,
    MetricsConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
)

__all__ = [
    "MODEL_PRESETS", "SECTIONS", "CheckpointConfig", "Config", "DataConfig", "DraftConfig", "MemoryConfig",
    "MetricsConfig", "ModelConfig", "ParallelConfig", "TrainConfig", "build_config", "build_model_config",
    "fields_by_key", "load_config", "parse_overrides", "read_raw", "read_toml", "to_dict", "to_toml",
]
