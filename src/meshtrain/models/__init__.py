"""Models built in plain PyTorch, with no distributed code.

`gpt.GPT` is a nanoGPT-class decoder; `vit.ViT` is NERSC's ViT weather forecaster (with
`weather_metrics` for RMSE in physical units). Parallel layouts live in meshtrain.parallel and refer
to these modules by their parameter names, so those names are part of the interface.
"""
