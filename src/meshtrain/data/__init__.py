"""Datasets: `text` (shipped Shakespeare corpus, char and GPT-2 BPE tokenizers, prepare, token windows), sharded
corpora (`shards`: format, manifest, reader; `corpus` + `corpus_sources`: the parallel prepare; `streams`: which
windows stream, data.order), and `era5` (NERSC's ERA5 h5 layout: reader, dp-sharded loader; `era5_synthetic` writes
that layout)."""
