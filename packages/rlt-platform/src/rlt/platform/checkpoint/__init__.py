"""Checkpoints in the Hugging Face layout: loading, tokenizers, and the tiny-checkpoint writer."""

from rlt.platform.checkpoint.loader import LoadedCheckpoint, load_checkpoint, read_config
from rlt.platform.checkpoint.tokenizer import RltTokenizer

__all__ = ["LoadedCheckpoint", "RltTokenizer", "load_checkpoint", "read_config"]
