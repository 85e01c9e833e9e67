"""The distributed runtime: who am I, which device, the process group, launching, collectives.

Its modules are imported by name (meshtrain.runtime.setup, .env, ...), none of them here: setup imports torch, and
what only reads the launch environment or the config (`meshtrain launch`, `submit`, `doctor`, meshtrain.config)
starts without it, a second and more of CPU sooner on every job.
"""
