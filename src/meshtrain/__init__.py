"""meshtrain: parallel training of AI models on PyTorch's own distributed engine.

The command line (`meshtrain train gpt`, `meshtrain launch`, `meshtrain plan`, ...) drives meshtrain's own training
loop. The names below are for a training script of one's own; they are the public API, kept stable under semantic
versioning (see CHANGELOG.md): within a major version they are not removed and their documented arguments keep
their meaning. Everything else under `meshtrain.` is internal and may change in any release.

    import meshtrain

    with meshtrain.distributed() as info:                       # rank, world, device, backend: any launcher
        dims = meshtrain.ParallelDims(world_size=info.world_size, tp=2)
        mesh = dims.build_mesh(info.torch_device.type) if info.world_size > 1 else None
        model = meshtrain.parallelize(model.to(info.torch_device), dims, mesh, blocks="layers", tp_plan=plan)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        checkpoints = meshtrain.Checkpoints(run_dir)
        recorder = meshtrain.MetricsRecorder(run_dir, info, batch_size=8, tokens_per_sample=256)
        ...

Set-up: `setup`, `cleanup`, `distributed`, `DistInfo`, `collective`.
Layout: `ParallelDims` (the mesh's sizes and order; `build_mesh`), `parallelize`, `gradient_sync`, `shard_sequence`.
Checkpoints: `Checkpoints` (DCP, atomic, resume under any layout).
Metrics: `MetricsRecorder` (the log line, metrics.jsonl for `meshtrain report`, MFU, per-rank spread).
Errors: `MeshtrainError` and the kinds below it: `CollectiveError`, `MeshError`, `CheckpointError`,
`TrainingDiverged`.
"""

from importlib import import_module

__version__ = "0.2.0"

_PUBLIC = {
    "setup": "meshtrain.runtime.setup",
    "cleanup": "meshtrain.runtime.setup",
    "distributed": "meshtrain.runtime.setup",
    "DistInfo": "meshtrain.runtime.setup",
    "collective": "meshtrain.runtime.setup",
    "CollectiveError": "meshtrain.runtime.setup",
    "ParallelDims": "meshtrain.parallel.mesh",
    "MeshError": "meshtrain.parallel.mesh",
    "parallelize": "meshtrain.parallel.parallelize",
    "gradient_sync": "meshtrain.parallel.data_parallel",
    "shard_sequence": "meshtrain.parallel.context_parallel",
    "Checkpoints": "meshtrain.train.checkpoint",
    "CheckpointError": "meshtrain.train.checkpoint",
    "MetricsRecorder": "meshtrain.train.recorder",
    "TrainingDiverged": "meshtrain.train.recorder",
    "MeshtrainError": "meshtrain.errors",
}
__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str):
    # Imported on first use: `meshtrain --help` and the launcher should not pay for torch.distributed's imports.
    if name in _PUBLIC:
        value = getattr(import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'meshtrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
