"""longctx: train decoder LLMs on very long contexts."""

__version__ = "0.1.0"
