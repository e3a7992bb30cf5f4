"""The app's default model: re-exported from the `tiny-models` package, where it lives."""

from tiny_models import ALPHABET, SPECIAL_TOKENS, build_char_tokenizer, build_tiny_qwen2

__all__ = ["ALPHABET", "SPECIAL_TOKENS", "build_char_tokenizer", "build_tiny_qwen2"]
