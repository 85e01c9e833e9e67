"""Datasets: `text` (shipped Shakespeare corpus, char and GPT-2 BPE tokenizers, prepare, token windows) and
`era5` (NERSC's ERA5 h5 layout: reader, dp-sharded loader; `era5_synthetic` writes that layout)."""
