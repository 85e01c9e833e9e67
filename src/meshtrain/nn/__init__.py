"""The parts models are built from, in plain PyTorch, below both the models and the parallel plans that reshape them:
transformer.py (attention, the MLP, the pre-norm block, rotary tables, GPT-2's init)."""
