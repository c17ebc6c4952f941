"""Hugging Face glue: layer-kind detection, attention registration and per-family quirks."""
