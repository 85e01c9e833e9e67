"""The distributed runtime: who am I, which device, the process group, launching, collectives."""

from meshtrain.runtime.env import LaunchEnv, LaunchEnvError, detect, expand_nodelist, read_hostfile
from meshtrain.runtime.log import configure_logging, get_logger
from meshtrain.runtime.setup import CollectiveError, DistInfo, cleanup, collective, distributed, setup

__all__ = [
    "CollectiveError", "DistInfo", "LaunchEnv", "LaunchEnvError", "cleanup", "collective", "configure_logging",
    "detect", "distributed", "expand_nodelist", "get_logger", "read_hostfile", "setup",
]
