"""What a trace's fake tensors and fake process group cannot answer, answered without data (plan/measured/trace.py
enters them all, `stand_ins`): DDP's start-up checks, its bucket hook and re-bucketing; what a pipeline's stages tell
each other as data; device meshes, which read their rank maps; attention without dropout (fused, as a GPU's);
initialisers that read their draws back. docs/plan.md, "Traced plans", says why each is safe to stand in.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parallel import distributed as ddp_module
from torch.utils._python_dispatch import _disable_current_modes

from meshtrain.parallel import pipeline as pipeline_module
from meshtrain.plan.activations import fsdp_mixed
from meshtrain.plan.workload import ModelFacts
from meshtrain.train.trainer import AUTOCAST


@contextlib.contextmanager
def stand_ins(cfg, dims):
    """Every stand-in below, for tracing `cfg`'s layout `dims`."""
    with fake_ddp(), fake_pipeline(cfg, dims), real_meshes(), fused_attention(), no_redraws():
        yield


def fake_ddp_parts(layout) -> None:
    """DDP's bucket hook and buckets, as a fake group can run them (_all_reduce_in_place, _KeepBuckets)."""
    for part in layout.parts:
        if isinstance(part, DistributedDataParallel):
            part.register_comm_hook(part.process_group, _all_reduce_in_place)
            part.reducer = _KeepBuckets(part.reducer)


@contextlib.contextmanager
def fake_ddp():
    """DDP's constructor checks every rank's parameter shapes and broadcasts rank 0's weights through data it reads
    on the host; a fake tensor has none, and the fake group returns no data, so both are skipped (every rank builds
    the same model from the same seed: there is nothing to check or copy)."""
    with mock.patch.object(ddp_module, "_verify_param_shape_across_processes", lambda *a, **k: None), \
            mock.patch.object(ddp_module, "_sync_module_states", lambda *a, **k: None):
        yield


@contextlib.contextmanager
def fake_pipeline(cfg, dims):
    """What a pipeline's ranks tell each other as data, told here without a message (a fake group returns none):
    the embedding group ({first-stage rank, last-stage rank}: agreed by an all_gather_object) made from this rank's
    own pair; torch's start-up vote on static or dynamic shapes (always dynamic: meshtrain gives no static shapes);
    and the metadata of the tensors a stage receives, which a neighbouring rank sends pickled: forward, the
    previous stage's output, a micro-batch's hidden states [samples, tokens / cp, width] in the dtype the blocks
    compute their stream in (16-bit under FSDP2's mixed precision, fp32 otherwise, as autocast leaves the stream);
    backward, the gradient of this stage's own output, whose metadata torch already holds."""
    from torch.distributed.pipelining import schedules, stage
    from torch.distributed.pipelining._utils import (
        InferenceMode,
        _derive_grad_metas,
        _StageBackwardMeta,
        _StageForwardMeta,
        extract_tensor_meta,
    )

    facts = ModelFacts.of(cfg)
    microbatches = cfg.parallel.microbatches or dims.pp * cfg.parallel.virtual_stages
    shape = (facts.batch_size // microbatches, facts.tokens // dims.cp, facts.shape.width)
    dtype = AUTOCAST[cfg.train.dtype] if fsdp_mixed(cfg, dims) else torch.float32

    def own_group(pair):
        if pair is None:
            return None
        with _disable_current_modes():
            return dist.new_group(list(pair))

    def vote(self, stages, has_backward, p2p_done):
        for one in stages:
            one._inference_mode = InferenceMode.DYNAMIC

    def recv_meta(self, src_stage):
        if src_stage < self.stage_index:
            hidden = torch.empty(shape, dtype=dtype, device="meta", requires_grad=True)
            return _StageForwardMeta(forward_metas=(extract_tensor_meta(hidden),))
        return _StageBackwardMeta(backward_metas=_derive_grad_metas(self._stage_meta.outputs))

    with mock.patch.object(pipeline_module, "_embedding_group", own_group), \
            mock.patch.object(schedules._PipelineSchedule, "_warmup_p2p", vote), \
            mock.patch.object(stage.PipelineStage, "_recv_meta", recv_meta), \
            mock.patch.object(stage.PipelineStage, "_send_meta", lambda *a, **k: None):
        yield


@contextlib.contextmanager
def fused_attention():
    """Attention without its dropout: a CPU's fused (flash) attention takes no dropout, and with dropout torch's SDPA
    falls back to its math path, which keeps every score matrix for the backward (a 6.7B decoder at 4,096 tokens:
    2 GiB a layer). A GPU's fused kernels apply dropout inside and keep none, and the planner counts attention as
    fused: the trace counts it so too (docs/plan.md)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def without_dropout(query, key, value, attn_mask=None, dropout_p=0.0, *args, **kwargs):
        return sdpa(query, key, value, attn_mask, 0.0, *args, **kwargs)

    with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", without_dropout):
        yield


@contextlib.contextmanager
def no_redraws():
    """nn.init.trunc_normal_ leaves a fake tensor as it is (as torch leaves a meta tensor): it draws by rejection,
    reading each draw back on the host to decide whether to draw again, and a fake tensor holds no values (the ViT's
    init). Nothing is counted before the measured step, so the draws' temporaries it skips count nowhere."""
    trunc_normal = torch.nn.init.trunc_normal_

    def values_free(tensor, *args, **kwargs):
        return tensor if is_fake(tensor) else trunc_normal(tensor, *args, **kwargs)

    with mock.patch.object(torch.nn.init, "trunc_normal_", values_free):
        yield


@contextlib.contextmanager
def real_meshes():
    """DeviceMeshes made during the trace (FSDP2 joins its dp mesh to tp's) from real tensors: a mesh reads its rank
    map as data, which a fake tensor has not (and the tensors' bytes are not the model's)."""
    init = DeviceMesh.__init__

    def real_init(*args, **kwargs):
        with _disable_current_modes():
            init(*args, **kwargs)

    with mock.patch.object(DeviceMesh, "__init__", real_init):
        yield


def _all_reduce_in_place(group, bucket):
    """DDP's default hook, less what the fake group cannot give: a future holding the reduced bucket (the fake
    all-reduce returns none). The bucket is reduced in place, as the default does, so its bytes are the same."""
    buffer = bucket.buffer()
    dist.all_reduce(buffer, group=group)
    future = torch.futures.Future()
    future.set_result(buffer)
    return future


class _KeepBuckets:
    """DDP's reducer, less the one re-bucketing at the second forward (buckets reordered as the first backward made
    gradients ready): the ranks agree on the order by broadcasting it and reading it back, which a fake group cannot.
    The buckets keep their first order, and their bytes (the gradients' once over) are the same."""

    def __init__(self, reducer):
        self._reducer = reducer

    def __getattr__(self, name):
        return getattr(self._reducer, name)

    def _rebuild_buckets(self) -> bool:
        return False
