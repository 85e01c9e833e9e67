"""The distributed runtime: who am I, which device, the process group, launching, collectives.

Its modules are imported by name (meshtrain.runtime.setup, .env, ...), none of them here: setup imports torch, and
meshtrain.config and the command line's parser, which import runtime.env and runtime.log, stay without it.
"""
