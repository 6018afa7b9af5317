"""Datasets (parquet -> chat template -> token ids) and the built-in tasks."""
