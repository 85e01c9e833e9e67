"""ParallelDims: the one object that says how the ranks form a mesh and answers every "which ranks?" question.

    dims = ParallelDims(world_size=8, tp=2, pp=2)        # dp_shard=-1 fills the rest: 2
    dims.group_of(rank, "tp")                            # pure arithmetic, no processes
    mesh = dims.build_mesh("cuda")                       # one DeviceMesh, named dims
    dp_mesh = submesh(mesh, "dp")                        # dp_replicate x dp_shard, or None

Expert parallelism (ep) borrows ranks instead of adding them: it splits dp_shard into (efsdp, ep), ep inner, so the
ep ranks of a group are the closest data-parallel ranks. Every rank still reads its own batch and the dense layers
stay data parallel over all dp ranks; a mixture-of-experts layer's routed experts are cut into ep equal slices and
the rank at ep coordinate i holds slice i (experts i·E/ep .. (i+1)·E/ep - 1). Ranks that share an ep coordinate
(the "edp" group: dp_replicate × efsdp, dp/ep ranks, × cp under context parallelism) hold the same experts and
average their gradients together. tp and pp leave ep alone: a tp group's ranks route the same tokens with the same
experts, and each pipeline stage has its own MoE layers, sharded over the ep ranks of that stage.

    dims = ParallelDims(world_size=8, ep=4)              # dp_shard 8 = efsdp 2 × ep 4
    dims.group_of(5, "ep")      -> [4, 5, 6, 7]          # the ranks rank 5 exchanges tokens with
    dims.group_of(5, "edp")     -> [1, 5]                # the ranks that hold rank 5's experts
    dims.experts_of(5, 16)      -> range(4, 8)

The order string follows NERSC: the FIRST dim named has adjacent ranks. With "tp-cp-dp-pp", the ranks
of a TP group are consecutive, so a node holds whole TP groups. In the DeviceMesh, dims run from the
outermost (last named, largest stride) to the innermost (first named, stride 1). "dp" in the order is
dp_replicate x dp_shard, dp_shard inner: HSDP shards within the closer ranks and replicates across.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshtrain import registry
from meshtrain.errors import MeshtrainError
from meshtrain.parallel import backends

if TYPE_CHECKING:  # for annotations only
    from meshtrain.config import RunConfig

DEFAULT_ORDER = "tp-cp-dp-pp"
ORDER_DIMS = ("tp", "cp", "dp", "pp")
DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# Flattened dims, each over its parts. "dp": the ranks that see different batches (data loading,
# gradient reduction); "dp_shard_cp": what FSDP shards over when cp > 1 (cp ranks hold the same
# weights); "dp_cp": the ranks a loss is averaged over when cp splits the sequence.
FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}
# The expert view of the same ranks: dp_shard = efsdp × ep (ep inner). "edp": the ranks that hold the same experts
# and saw other tokens (what their gradients are averaged over, and what FSDP shards them over): efsdp, with
# dp_replicate under hsdp and cp under context parallelism (cp ranks route other positions of the same sequences).
# tp ranks hold other slices of the same experts (each expert's hidden width cut over tp): not in edp.
EXPERT_DIMS = ("efsdp", "ep")
EXPERT_FLATTENED = {"edp": ("dp_replicate", "efsdp", "cp")}


class MeshError(MeshtrainError, ValueError):
    """The parallel sizes do not fit the job or the model; the message names the numbers and the fix."""

    same_on_every_rank = True


@dataclass(frozen=True)
class ParallelDims:
    """The sizes of the five parallel dims (pp, dp_replicate, dp_shard, cp, tp) over `world_size` ranks and the
    order string that says which dim has adjacent ranks; checked on creation (the product is the world size;
    dp_shard=-1 fills what is left). Answers "which ranks?" by arithmetic (`coords`, `group_of`, `dp_rank`) and
    builds the one DeviceMesh (`build_mesh`), whose dims `submesh` hands out by name."""

    dp_replicate: int = 1
    dp_shard: int = -1  # -1: whatever is left of the world
    cp: int = 1
    tp: int = 1
    pp: int = 1
    order: str = DEFAULT_ORDER
    world_size: int = 1
    ep: int = 1  # expert parallel: borrowed from dp_shard (module docstring), adds no ranks

    @classmethod
    def resolve(cls, world_size: int, dp_replicate: int = 1, dp_shard: int = -1, cp: int = 1, tp: int = 1,
                pp: int = 1, order: str = DEFAULT_ORDER, ep: int = 1) -> ParallelDims:
        return cls(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp, order=order,
                   world_size=world_size, ep=ep)

    def __post_init__(self):
        parse_order(self.order)
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise MeshError(f"world_size={self.world_size} must be a positive number of ranks")
        for name in DIMS:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1 and not (name == "dp_shard" and value == -1):
                raise MeshError(f"parallel.{name}={value} must be a positive integer"
                                + (" or -1 (whatever is left of the world)" if name == "dp_shard" else ""))
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise MeshError(
                    f"parallel.dp_shard=-1 should fill what is left of the {self.world_size} ranks, but "
                    f"dp_replicate={self.dp_replicate} × cp={self.cp} × tp={self.tp} × pp={self.pp} = {others} "
                    f"does not divide {self.world_size}: choose sizes whose product divides {self.world_size}")
            object.__setattr__(self, "dp_shard", self.world_size // others)  # frozen: set once, here
        product = others * self.dp_shard
        if product != self.world_size:
            raise MeshError(
                f"parallel.dp_replicate={self.dp_replicate} × dp_shard={self.dp_shard} × cp={self.cp} × "
                f"tp={self.tp} × pp={self.pp} = {product}, but the job has {self.world_size} ranks: make the "
                f"product {self.world_size} (dp_shard=-1 fills what is left)")
        if not isinstance(self.ep, int) or self.ep < 1:
            raise MeshError(f"parallel.ep={self.ep} must be a positive integer (1: every rank holds every expert)")
        if self.dp_shard % self.ep:
            raise MeshError(
                f"parallel.ep={self.ep} does not divide the {self.dp_shard} data-parallel ranks of parallel.dp_shard: "
                "expert parallelism borrows its ranks from dp_shard (each ep group is ep of them, and every group "
                f"holds all experts); pick an ep that divides {self.dp_shard}")

    # ---- sizes and flags -------------------------------------------------------------------------------
    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def efsdp(self) -> int:
        """The dp_shard ranks that hold the same experts within one replica: dp_shard / ep."""
        return self.dp_shard // self.ep

    def size(self, dim: str) -> int:
        """The size of a mesh dim, an expert dim ("ep", "efsdp") or a flattened one ("dp", "dp_shard_cp", "dp_cp",
        "edp")."""
        return math.prod(getattr(self, d) for d in _parts(dim))

    def enabled(self, dim: str) -> bool:
        """Whether `dim` (or a flattened one) spans more than one rank."""
        return self.size(dim) > 1

    @property
    def layout(self) -> tuple[str, ...]:
        """All five dims, outermost (largest stride) first: the reverse of the order string."""
        names: list[str] = []
        for dim in reversed(parse_order(self.order)):
            names += ["dp_replicate", "dp_shard"] if dim == "dp" else [dim]
        return tuple(names)

    @property
    def mesh_dims(self) -> tuple[str, ...]:
        """The dims the DeviceMesh has: those of size > 1 in layout order, or dp_shard alone on one rank."""
        return tuple(d for d in self.layout if getattr(self, d) > 1) or ("dp_shard",)

    @property
    def expert_layout(self) -> tuple[str, ...]:
        """The layout's dims with dp_shard split into (efsdp, ep), ep inner: how the experts see the same ranks."""
        names: list[str] = []
        for dim in self.layout:
            names += list(EXPERT_DIMS) if dim == "dp_shard" else [dim]
        return tuple(names)

    # ---- pure rank arithmetic ---------------------------------------------------------------------------
    def _strides(self) -> dict[str, int]:
        """Each dim's stride in rank numbers, the expert dims' too (ep has dp_shard's, efsdp ep times that)."""
        strides, stride = {}, 1
        for dim in reversed(self.expert_layout):  # innermost first: stride 1
            strides[dim] = stride
            stride *= getattr(self, dim)
        strides["dp_shard"] = strides["ep"]
        return strides

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each of pp, dp_replicate, dp_shard, cp, tp."""
        if not 0 <= rank < self.world_size:
            raise MeshError(f"rank {rank} is outside the job's {self.world_size} ranks")
        strides = self._strides()
        return {dim: rank // strides[dim] % getattr(self, dim) for dim in DIMS}

    def expert_coords(self, rank: int) -> dict[str, int]:
        """This rank's index along the expert view's dims (pp, dp_replicate, efsdp, ep, cp, tp)."""
        if not 0 <= rank < self.world_size:
            raise MeshError(f"rank {rank} is outside the job's {self.world_size} ranks")
        strides = self._strides()
        return {dim: rank // strides[dim] % getattr(self, dim) for dim in self.expert_layout}

    def rank_of(self, coords: dict[str, int]) -> int:
        strides = self._strides()
        return sum(coords[dim] * strides[dim] for dim in DIMS)

    def group_of(self, rank: int, dim: str) -> list[int]:
        """The global ranks that share every coordinate of `rank` except those of `dim` (sorted); `dim` may be an
        expert dim ("ep", "efsdp", "edp")."""
        strides, coords = self._strides(), self.coords(rank) | self.expert_coords(rank)
        offset, ranks = rank, [0]
        for part in _parts(dim):  # the rank with coordinate 0 along `dim`, then every step along its parts
            offset -= coords[part] * strides[part]
            ranks = [r + i * strides[part] for r in ranks for i in range(getattr(self, part))]
        return sorted(offset + r for r in ranks)

    def experts_of(self, rank: int, n_experts: int) -> range:
        """The routed experts (of n_experts per layer) this rank holds: its ep coordinate's contiguous slice."""
        if n_experts % self.ep:
            raise MeshError(f"model.n_experts={n_experts} is not divisible by parallel.ep={self.ep}: every expert-"
                            f"parallel rank holds an equal share of the experts; pick an ep that divides {n_experts}")
        per_rank = n_experts // self.ep
        first = self.expert_coords(rank)["ep"] * per_rank
        return range(first, first + per_rank)

    def dp_rank(self, rank: int) -> int:
        """The data-loading rank: tp/cp/pp ranks of one replica share it, so they read the same batch."""
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def is_first_stage(self, rank: int) -> bool:
        return self.coords(rank)["pp"] == 0

    def is_last_stage(self, rank: int) -> bool:
        return self.coords(rank)["pp"] == self.pp - 1

    @classmethod
    def from_config(cls, cfg: RunConfig, world_size: int, local_world_size: int | None = None) -> ParallelDims:
        """The layout of a run config on `world_size` ranks, every rule that needs the world size, the node size
        or the model's shape checked (check_layout): what `train` and a planner accept is one set."""
        p = cfg.parallel
        dims = cls.resolve(world_size, dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, cp=p.cp, tp=p.tp, pp=p.pp,
                           order=p.order, ep=p.ep)
        check_layout(dims, cfg, registry.spec_of(cfg), local_world_size or world_size)
        return dims

    # ---- the real mesh ------------------------------------------------------------------------------------
    def build_mesh(self, device_type: str):
        """One DeviceMesh over all ranks (collective: every rank must call it), plus its flattened dims."""
        from torch.distributed.device_mesh import init_device_mesh

        names = self.mesh_dims
        mesh = init_device_mesh(device_type, tuple(getattr(self, d) for d in names), mesh_dim_names=names)
        # Flattening creates process groups, which every rank must create together, so do it now, once;
        # submesh() later finds them in the root mesh's cache instead of creating groups on one rank.
        for name in FLATTENED:
            submesh(mesh, name)
        if self.ep > 1:
            # The experts' view of the same ranks (dp_shard unflattened into efsdp × ep) shares the mesh's root, so
            # FSDP2 can shard ep's DTensors over efsdp; kept on the mesh object, found by submesh("ep" ...).
            mesh.expert_view = mesh._unflatten("dp_shard", (self.efsdp, self.ep), EXPERT_DIMS)
            for name in ("ep", "efsdp", "edp"):
                submesh(mesh, name)
        return mesh


def parse_order(order: str) -> tuple[str, ...]:
    dims = tuple(order.split("-")) if isinstance(order, str) else ()
    if sorted(dims) != sorted(ORDER_DIMS):
        missing = [d for d in ORDER_DIMS if d not in dims]
        extra = [d for d in dims if d not in ORDER_DIMS or dims.count(d) > 1]
        raise MeshError(
            f"parallel.order={order!r} must name each of tp, cp, dp, pp exactly once, joined by '-'"
            + (f"; missing {', '.join(missing)}" if missing else "")
            + (f"; unknown or repeated {', '.join(dict.fromkeys(extra))}" if extra else "")
            + f" (e.g. {DEFAULT_ORDER!r}: the first named has adjacent ranks)")
    return dims


def _parts(dim: str) -> tuple[str, ...]:
    parts = FLATTENED.get(dim) or EXPERT_FLATTENED.get(dim) or (dim,)
    if any(p not in DIMS + EXPERT_DIMS for p in parts):
        known = DIMS + tuple(FLATTENED) + EXPERT_DIMS + tuple(EXPERT_FLATTENED)
        raise MeshError(f"unknown mesh dim {dim!r}: use one of {', '.join(known)}")
    return parts


def check_layout(dims: ParallelDims, cfg: RunConfig, spec, local_world_size: int) -> None:
    """Raise MeshError unless `cfg`'s model (its ModelSpec's shape) can be laid out as `dims` on nodes of
    `local_world_size` ranks with cfg.train's backend and dtype. After this, the parallelize functions assume a
    valid layout."""
    p, t, shape = cfg.parallel, cfg.train, spec.shape(cfg)
    # The checks run in this order so that the first error a user sees stays the same across versions.
    if dims.ep > 1:
        _check_expert_parallel(dims, spec, shape, t.backend)
    _check_model_has_plans(dims, spec, shape, t.backend)
    _check_tensor_parallel(dims, shape, local_world_size)
    if dims.cp > 1:
        _check_context_parallel(dims, p, shape)
    if dims.pp > 1:
        _check_pipeline_parallel(dims, p, shape, t.dtype)
    _check_backend_combinations(dims, t.backend)


def _config_key(shape, what: str) -> str:
    """The config key a user changes to fix the model's `what` (e.g. "heads" -> "model.n_head")."""
    return shape.keys.get(what, what)


def _check_model_has_plans(dims: ParallelDims, spec, shape, backend: str) -> None:
    """The model must have a parallelize plan for every dim (and DeepSpeed) the job asks for."""
    missing = [d for d in ("tp", "cp", "pp") if getattr(dims, d) > 1 and d not in shape.parallelisms]
    engine = backends.get(backend).engine
    if missing or (engine and backend not in shape.parallelisms):
        what = ", ".join(f"parallel.{d}={getattr(dims, d)}" for d in missing) or f"train.backend={backend}"
        raise MeshError(f"{what}: the {spec.name} model has no plan for it in this version; it supports "
                        f"{', '.join(sorted(shape.parallelisms)) or 'data parallelism only'} (ZeRO-2/3 through "
                        "train.backend=zero2 / fsdp)")


def _check_expert_parallel(dims: ParallelDims, spec, shape, backend: str) -> None:
    """ep > 1: a model with experts, a plan for them, ep dividing the experts, and a layout ep composes with."""
    if not shape.experts:
        raise MeshError(f"parallel.ep={dims.ep}: the {spec.name} model has no experts to shard; expert parallelism is "
                        "for a mixture of experts (meshtrain train moe); set parallel.ep=1")
    if "ep" not in shape.parallelisms:
        raise MeshError(f"parallel.ep={dims.ep}: the {spec.name} model has no expert-parallel plan in this version; "
                        "set parallel.ep=1")
    if shape.experts % dims.ep:
        raise MeshError(f"{_config_key(shape, 'experts')}={shape.experts} is not divisible by parallel.ep={dims.ep}: "
                        "every expert-parallel rank holds an equal share of the experts; pick an ep that divides "
                        f"{shape.experts}")
    # tp, cp and pp compose when the model plans them (_check_model_has_plans, next); the backend must take ep.
    chosen = backends.get(backend)
    if "ep" not in chosen.composes_with:
        raise MeshError(f"parallel.ep={dims.ep} with train.backend={backend}: {chosen.alone_because}; or set "
                        "parallel.ep=1")


def _check_tensor_parallel(dims: ParallelDims, shape, local_world_size: int) -> None:
    """tp must fit in a node and divide the heads, kv heads and MLP width (checked even at tp=1: always true)."""
    if dims.tp > local_world_size:
        raise MeshError(
            f"parallel.tp={dims.tp} is larger than the {local_world_size} ranks of a node: tensor parallelism "
            f"all-reduces every layer and belongs inside a node (use tp <= {local_world_size})")
    for what, count in (("heads", shape.heads), ("kv_heads", shape.kv_heads), ("mlp_hidden", shape.mlp_hidden)):
        if count % dims.tp:
            raise MeshError(f"{_config_key(shape, what)}={count} is not divisible by parallel.tp={dims.tp}: each "
                            "tensor-parallel rank needs whole attention heads and an equal share of the MLP; pick a tp "
                            f"that divides {count}")


def _check_context_parallel(dims: ParallelDims, p, shape) -> None:
    """cp > 1: the tokens must split evenly, and the chosen cp_impl must be able to run this model."""
    key = lambda what: _config_key(shape, what)  # noqa: E731
    chunks = 2 * dims.cp if shape.causal and p.cp_impl == "ring" else dims.cp
    if shape.tokens is not None and shape.tokens % chunks:
        why = ("ring attention balances the causal load by cutting each sequence into 2·cp chunks"
               if chunks > dims.cp else "each cp rank holds an equal, contiguous share of the tokens")
        raise MeshError(f"{key('tokens')}={shape.tokens} tokens are not divisible by {chunks} (parallel.cp="
                        f"{dims.cp}, cp_impl={p.cp_impl}): {why}")
    if p.cp_impl == "ulysses" and (shape.heads // dims.tp) % dims.cp:
        raise MeshError(f"parallel.cp_impl=ulysses gives each of the cp={dims.cp} ranks whole heads, but each "
                        f"tensor-parallel rank has {shape.heads // dims.tp} of {key('heads')}={shape.heads}: pick "
                        "a cp that divides them, or parallel.cp_impl=ring")
    if p.cp_impl == "ring" and shape.dropout > 0:
        raise MeshError(f"{key('dropout')}={shape.dropout} with parallel.cp_impl=ring: ring attention has no "
                        "attention dropout; set it to 0 or use parallel.cp_impl=ulysses")


def _check_pipeline_parallel(dims: ParallelDims, p, shape, dtype: str) -> None:
    """pp > 1: enough blocks and microbatches for the stages, a runnable schedule, and no fp16 loss scaling."""
    key = lambda what: _config_key(shape, what)  # noqa: E731
    stages, microbatches = dims.pp * p.virtual_stages, p.microbatches or dims.pp * p.virtual_stages
    if stages > shape.layers:
        raise MeshError(f"parallel.pp={dims.pp} × virtual_stages={p.virtual_stages} = {stages} stages, but "
                        f"{key('layers')}={shape.layers}: every stage needs at least one block")
    if microbatches < dims.pp:
        raise MeshError(f"parallel.microbatches={microbatches} is fewer than parallel.pp={dims.pp} stages: some "
                        f"stages would always sit idle; use at least {dims.pp} microbatches (more shrink the bubble)")
    if shape.batch_size % microbatches:
        raise MeshError(f"{key('batch_size')}={shape.batch_size} does not split into parallel.microbatches="
                        f"{microbatches} for the pipeline: make the batch a multiple of {microbatches} (or change "
                        "microbatches)")
    from meshtrain.parallel.pipeline_schedules import PipelineError, check_schedule

    try:
        check_schedule(p.pp_schedule, dims.pp, p.virtual_stages, microbatches)
    except PipelineError as e:
        raise MeshError(f"parallel.pp_schedule={p.pp_schedule}: {e}") from None
    if dtype == "fp16":
        raise MeshError("train.dtype=fp16 with parallel.pp > 1: the GradScaler cannot scale a loss inside the "
                        "pipeline schedule; use train.dtype=bf16")


def _check_backend_combinations(dims: ParallelDims, backend: str) -> None:
    """The data-parallel backend must be able to wrap the tp/cp/pp layout it is combined with."""
    chosen = backends.get(backend)
    if dims.tp > 1 and chosen.all_reduces and dims.size("dp_cp") > 1:
        # DDP spans the context-parallel ranks too (they are replicas to it), so cp alone counts as well.
        raise MeshError(f"train.backend={backend} with parallel.tp={dims.tp} and {dims.size('dp_cp')} data- or "
                        "context-parallel ranks: DDP does not replicate tensor-parallel (DTensor) parameters; use "
                        "train.backend=fsdp (fsdp x tp) or zero2")
    sharded_with = [d for d in ("dp", "cp") if dims.size(d) > 1]
    order = parse_order(dims.order)
    if dims.tp > 1 and chosen.sharded and any(order.index(d) < order.index("tp") for d in sharded_with):
        raise MeshError(f"train.backend={backend} with parallel.tp={dims.tp} and parallel.order={dims.order}: FSDP2 "
                        f"shards tensor-parallel weights only when tp is inner to {' and '.join(sharded_with)} in the "
                        "mesh; name tp before them (e.g. parallel.order=tp-cp-dp-pp, which also keeps tp inside a "
                        "node)")


def submesh(mesh, name: str):
    """The named dim of `mesh` (flattened from its parts for "dp", "dp_shard_cp", "dp_cp"), or None if size 1.

    Parts of size 1 are not in the mesh, so "dp" with dp_replicate=1 is simply mesh["dp_shard"]. Parts are
    sliced in the mesh's own order: DeviceMesh only slices dims in ascending layout order.
    """
    parts = _parts(name)
    if any(p in EXPERT_DIMS for p in parts):
        mesh = getattr(mesh, "expert_view", None)  # built by build_mesh when ep > 1
        if mesh is None:
            return None
    names = mesh.mesh_dim_names
    present = [d for d in names if d in parts and mesh.size(names.index(d)) > 1]  # the expert view keeps size 1
    if not present:
        return None
    if len(present) == 1:
        return mesh[present[0]]
    # torch >= 2.5; private, but torchtitan relies on it. Same name + same ranks returns the cached mesh.
    return mesh[tuple(present)]._flatten(name)


def expert_mesh(mesh):
    """The mesh the routed experts are cut over: the expert view's "ep" dim, with "tp" beside it where tp > 1 (each
    expert's hidden width cut over tp: expert tensor parallelism), or None without ep."""
    view = getattr(mesh, "expert_view", None)  # built by build_mesh when ep > 1
    if view is None:
        return None
    names = view.mesh_dim_names
    dims = [d for d in names if d == "ep" or (d == "tp" and view.size(names.index(d)) > 1)]  # in the view's order
    return view[tuple(dims)] if len(dims) > 1 else view["ep"]
