"""Models built in plain PyTorch, with no distributed code.

`gpt.GPT` is a nanoGPT-class decoder. Parallel layouts live elsewhere (`parallelize_<model>`), and
they refer to these modules by their parameter names, so those names are part of the interface.
"""
