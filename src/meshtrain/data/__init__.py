"""Datasets: `text` (shipped Shakespeare corpus, char and GPT-2 BPE tokenizers, prepare, token windows)."""
