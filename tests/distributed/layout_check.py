"""Under torchrun: any layout the trainer can build trains exactly like one process, and its checkpoints reshard.

    python -m torch.distributed.run --nproc-per-node N layout_check.py CASE [CASE ...] [--save DIR] [--load DIR]

CASE is `backend:key=value,...` over cfg.parallel (and `ac=full|selective`; `compile=blocks|model`: a compiled case
runs the model at a width torch's CPU inductor compiles right, machine.hardware.inductor_safe_width; `loss_chunks=N`:
the layout's model computes its loss N tokens at a time, the reference the whole; `float8=tensorwise|rowwise`:
torchao's float8 linears in the layout's blocks and in the reference's, computed by torch's CPU float8 matmul), e.g.
`fsdp:tp=2`, `ddp:pp=2,pp_schedule=gpipe`, `fsdp:tp=2,pp=2,ac=full`. Each case goes through what the loop uses —
build_gpt_layout, build_optimizer (of SGD on local shards: ShardwiseSGD) and the layout's micro-step, tied-embedding,
clipping and eval methods — for STEPS steps of ACCUM micro-steps on the same global batches as a single-process
reference (torch.optim.SGD), and compares loss, every gradient (gathered) and every parameter after each step
(within TOL; a compiled case within COMPILED_TOL: inductor's kernels sum in another order), then the eval loss (the
MoE: also its routers' biases after each step's bias update, made as its workload makes it, and the evaluation's
routing figures, balance loss and expert shares, as its workload reports them); each rank records per case its
verdict, the worst differences and the seconds the case took (meshtrain.runtime.results.record).

--save DIR: after the last case, write a distributed checkpoint of it to DIR (parallel.state_dict +
train.checkpoint.Checkpointer). --load DIR: for each case, load DIR into the fresh layout and write the
whole model and optimizer state, gathered, to DIR/gathered-CASE.pt for the test to compare.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.tensor import DTensor
from torch.optim.sgd import sgd as _sgd

from meshtrain.machine.hardware import inductor_safe_width
from meshtrain.models.gpt.config import GPTRunConfig
from meshtrain.models.gpt.model import GPT, GPTConfig
from meshtrain.models.gpt.parallelize import build_gpt_layout
from meshtrain.models.language import resolve_loss_chunks
from meshtrain.models.llama.config import LlamaRunConfig
from meshtrain.models.llama.model import Llama, LlamaConfig
from meshtrain.models.llama.parallelize import build_llama_layout
from meshtrain.models.moe.config import MoERunConfig
from meshtrain.models.moe.model import MoE, MoEConfig, MoEDecoder
from meshtrain.models.moe.parallelize import build_moe_layout
from meshtrain.models.moe.workload import figures_of, from_every_stage, routing_group, tallied, update_biases
from meshtrain.parallel import float8
from meshtrain.parallel.mesh import ParallelDims, submesh
from meshtrain.parallel.state_dict import (
    full_model_state,
)
from meshtrain.runtime.results import full, record
from meshtrain.runtime.setup import distributed
from meshtrain.train import checkpoint
from meshtrain.train.metrics import StepTimer
from meshtrain.train.optim import build_optimizer

ACCUM, MICRO, STEPS, TOL, COMPILED_TOL = 2, 4, 2, 1e-5, 1e-4
CONFIG = GPTConfig(block_size=16, vocab_size=65, n_layer=4, n_head=4, n_embd=32, dropout=0.0, bias=True)
# The Llama-style decoder at the same size: 4 query heads over 2 key/value heads, SwiGLU 64 wide, untied head.
LLAMA = LlamaConfig(block_size=16, vocab_size=65, n_layer=4, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=64)
# The mixture of experts on the Llama's parts: 2 MoE layers of 8 experts, top 2, with the balance loss in the gradient.
MOE = MoEConfig(block_size=16, vocab_size=65, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=64, n_experts=8,
                top_k=2, expert_hidden=32, expert_matmul="loop")
MODELS = {"gpt": (GPT, CONFIG, GPTRunConfig, build_gpt_layout), "llama": (Llama, LLAMA, LlamaRunConfig, build_llama_layout),
          "moe": (MoEDecoder, MOE, MoERunConfig, build_moe_layout)}


class ShardwiseSGD(torch.optim.SGD):
    """torch's SGD, its own single-tensor update (torch.optim.sgd.sgd), run on the local shards of each DTensor whose
    gradient and momentum are placed as it is (every parameter the layouts make): the same kernels on the same
    numbers, so the same step. Why: DTensor works out the placements of each of SGD's per-parameter ops (weight
    decay's add, momentum's mul_ and add_, the update) afresh for each shape and layout, up to 0.16 s of CPU a call
    on a 3-D mesh (FSDP2's _StridedShard over tp), a quarter of the 8-rank launch's CPU. A parameter placed
    otherwise is updated through the DTensor ops."""

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "the layouts step without a closure"
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for shardwise in (True, False):
                self._update([p for p in params if _shardwise(p, self.state[p]) == shardwise], group,
                             _local if shardwise else lambda tensor: tensor)

    def _update(self, params: list, group: dict, view) -> None:
        buffers = [None if (b := self.state[p].get("momentum_buffer")) is None else view(b) for p in params]
        _sgd([view(p) for p in params], [view(p.grad) for p in params], buffers, foreach=False,
             **{key: group[key] for key in ("weight_decay", "momentum", "lr", "dampening", "nesterov", "maximize")})
        for p, buffer in zip(params, buffers, strict=True):  # a first step's buffer, made from local shards
            self.state[p]["momentum_buffer"] = _like(p, buffer) if view is _local else buffer


def _shardwise(param: torch.Tensor, state: dict) -> bool:
    """A plain tensor, or a DTensor whose gradient and momentum are DTensors placed on its mesh as it is."""
    if not isinstance(param, DTensor):
        return True
    others = [param.grad, *([state["momentum_buffer"]] if state.get("momentum_buffer") is not None else [])]
    return all(isinstance(t, DTensor) and t.device_mesh == param.device_mesh and t.placements == param.placements
               for t in others)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as a DTensor placed as `param` is (a plain tensor stays one)."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


SGD = dict(optimizer_class=ShardwiseSGD, lr=0.1, momentum=0.9)
BIAS_RATE = 0.05  # the moe's router biases move after every step (fast enough to change the next step's routing)
INTS = {"tp", "cp", "pp", "ep", "dp_replicate", "dp_shard", "microbatches", "virtual_stages", "zero_stage"}


def options_of(case: str) -> dict[str, str]:
    return dict(item.split("=") for item in filter(None, case.partition(":")[2].split(",")))


def parse(case: str):
    """"BACKEND:key=value,..." -> the run config; model=llama picks the Llama-style decoder (default: the GPT)."""
    options = options_of(case)
    cfg = MODELS[options.get("model", "gpt")][2]()
    cfg.train.backend, cfg.train.dtype = case.partition(":")[0], "fp32"
    # they compose with every layout
    train_keys = {"ac": "activation_checkpointing", "compile": "compile", "float8": "float8"}
    for key, value in options.items():
        if key in ("model", "idle", "inductor", "shared"):  # idle: the moe routes to none of half of its experts
            continue  # (run_case); inductor=false: compiled by dynamo and AOT autograd alone (build); shared: model_config
        if key in train_keys:
            setattr(cfg.train, train_keys[key], value)
            continue
        if key == "loss_chunks":  # train.loss_chunks: the layout's model chunks its loss, the reference does not
            cfg.train.loss_chunks = value
            continue
        value = int(value) if key in INTS else (value == "true" if value in ("true", "false") else value)
        setattr(cfg.parallel, key, value)
    return cfg


def model_config(config, cfg, case: str = ""):
    """The model's config; compiled, at a width torch's CPU inductor compiles right (pytorch/pytorch#196681); with
    shared=true, the moe's with a shared expert."""
    if "shared=true" in case:
        config = dataclasses.replace(config, n_shared_experts=1)
    return config if cfg.train.compile == "off" else dataclasses.replace(config, n_embd=inductor_safe_width())


def worst(mine: dict, ref: dict) -> float:
    """Max abs difference relative to the reference's scale, over the names this rank holds."""
    out = 0.0
    for name, value in mine.items():
        r = ref[name.replace("._checkpoint_wrapped_module", "")]  # activation checkpointing's wrapper
        out = max(out, (full(value) - r).abs().max().item() / max(r.abs().max().item(), 1e-2))
    return out


def model_of(cfg) -> tuple:
    return next(entry for entry in MODELS.values() if type(cfg) is entry[2])


def idle_upper_experts(model, idle: bool):
    """With idle: every router's bias keeps the upper half of the experts from being chosen, so that under ep the ranks
    holding them receive no rows at all (their backward must still join every all-to-all and reduction)."""
    if idle:
        for moe in model.moe_layers():
            moe.router.expert_bias[moe.router.n_experts // 2:] = -1e3
    return model


def build(cfg, info, case: str = ""):
    cfg.optimizer.grad_clip, cfg.model.batch_size, cfg.train.grad_accum = 1.0, MICRO, ACCUM  # DeepSpeed's config
    m = cfg.model
    model_class, config, _, build_layout = model_of(cfg)
    config = model_config(config, cfg, case)
    for key in ("block_size", "n_layer", "n_head", "n_embd", "n_kv_head", "ffn_hidden", "n_experts", "top_k",
                "expert_hidden"):
        if hasattr(m, key):
            setattr(m, key, getattr(config, key))
    torch.manual_seed(0)
    dims = ParallelDims.from_config(cfg, info.world_size, info.local_world_size)
    mesh = dims.build_mesh(info.torch_device.type) if info.world_size > 1 else None
    config = dataclasses.replace(config, loss_chunks=resolve_loss_chunks(cfg.train.loss_chunks, config.vocab_size))
    with _without_inductor("inductor=false" in case):
        layout = build_layout(idle_upper_experts(model_class(config), "idle=true" in case), cfg, dims, mesh,
                              info.torch_device, info.rank)
    optimizer = layout.attach_optimizer(build_optimizer(layout.model.configure_optimizer_groups(0.1), info.torch_device,
                                                        cfg.train.backend, info.world_size, **SGD))
    return dims, layout, optimizer


@contextmanager
def _without_inductor(asked: bool):
    """torch.compile's backend aot_eager while the layout is built (compile binds its backend then): dynamo's graphs
    and AOT autograd's joint graph run eagerly, without inductor's code generation. What a compiled case of the
    mixture of experts checks is how its eager dispatch and the all-to-all meet the graphs, which is AOT autograd's
    (inductor's kernels are the GPT cases'); cold, inductor took 67 s of CPU for it on 2 ranks."""
    if not asked:
        yield
        return
    compile_ = torch.compile
    torch.compile = functools.partial(compile_, backend="aot_eager")
    try:
        yield
    finally:
        torch.compile = compile_


def reference_backward(reference, x, y, dp_size: int, microbatches: int = 1) -> torch.Tensor:
    """One process's loss and gradients on the whole batch. A mixture of experts routes and balances per forward, so
    it runs each rank's micro-batches as they do (its balance loss is a mean over each forward's tokens, not the
    whole batch's), each cut into the pipeline's `microbatches` (a stage's forward); the language-model loss is the
    same mean either way. cp and tp ranks route parts of one forward together: one chunk here."""
    if not isinstance(reference, MoEDecoder):
        _, loss = reference(x, y)
        loss.backward()
        return loss
    chunks, rows = dp_size * ACCUM * microbatches, MICRO // microbatches
    losses = []
    for i in range(chunks):
        _, loss = reference(x[i * rows:(i + 1) * rows], y[i * rows:(i + 1) * rows])
        (loss / chunks).backward()
        losses.append(loss.detach())
    return torch.stack(losses).mean()


def step_router_biases(layout, reference) -> float:
    """The auxiliary-loss-free bias update after a step, as the workload makes it (this rank's layers' loads summed
    over routing_group's ranks), and one process's; the largest difference between the two sets of biases."""
    group = routing_group(layout.mesh)

    def summed(load):
        if group is not None:
            dist.all_reduce(load, group=group)
        return load

    mine = [m for m in layout.model.modules() if isinstance(m, MoE)]
    update_biases(mine, BIAS_RATE, summed)
    update_biases(reference.moe_layers(), BIAS_RATE, lambda load: load)
    for moe in mine + reference.moe_layers():
        moe.tally.reset()
    want = {n: b for n, b in reference.named_buffers() if n.endswith("expert_bias")}
    return max([(b - want[n.replace("._checkpoint_wrapped_module", "")]).abs().max().item()
                for n, b in layout.model.named_buffers() if n.endswith("expert_bias")], default=0.0)


def routing_figures_difference(layout, reference) -> float:
    """The evaluation's balance loss and expert shares as the workload reports them (this rank's tallies summed over
    routing_group's ranks, gathered from every pipeline stage) against one process's, which ran every rank's batch
    whole: under a pipeline the layout evaluated microbatches, and the figures must not depend on it."""
    mine = [m for m in layout.model.modules() if isinstance(m, MoE)]
    layers = [int(i) for i, block in layout.model.transformer.h.items() if any(m in mine for m in block.modules())]
    packed, group = tallied(mine, MOE.n_experts), routing_group(layout.mesh)
    if group is not None:
        dist.all_reduce(packed, group=group)
    pp = submesh(layout.mesh, "pp")
    got = figures_of(*from_every_stage(layers, packed, pp.get_group() if pp is not None else None), MOE.top_k)
    want = figures_of(list(range(MOE.n_layer)), tallied(reference.moe_layers(), MOE.n_experts), MOE.top_k)
    shares = torch.tensor(got["expert_share"]["share"]) - torch.tensor(want["expert_share"]["share"])
    return max(abs(got["balance_loss"] / want["balance_loss"] - 1), shares.abs().max().item())


def engine_of(layout):
    """The DeepSpeed engine of an engine's layout (parallel/backends/deepspeed.EngineLayout), else None."""
    return getattr(layout, "engine", None)


def whole_parameters(layout) -> dict:
    """Name -> parameter; under DeepSpeed ZeRO-3 gathered from the partitions (outside: empty tensors)."""
    params = dict(layout.model.named_parameters())
    if engine_of(layout) is None or layout.settings["stage"] < 3:
        return {n: p.detach().clone() for n, p in params.items()}
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {n: p.detach().clone() for n, p in params.items()}


def run_case(case: str, info) -> tuple:
    started = time.perf_counter()
    cfg = parse(case)
    dims, layout, optimizer = build(cfg, info, case)
    torch.manual_seed(0)
    model_class, config, *_ = model_of(cfg)
    config = model_config(config, cfg, case)
    reference = idle_upper_experts(model_class(config), "idle=true" in case)
    # float8: one process's blocks converted as the layout's are (torchao runs float8 matmuls on a CPU too)
    converted = float8.convert_blocks(reference.transformer.h.values(), cfg.train.float8, fsdp=False)
    ref_opt = build_optimizer(reference.configure_optimizer_groups(0.1), torch.device("cpu"),
                              **{**SGD, "optimizer_class": torch.optim.SGD})  # torch's own, on whole tensors
    scaler, timer = torch.amp.GradScaler("cpu", enabled=False), StepTimer(info.torch_device)
    dp_rank, rows = dims.dp_rank(info.rank), ACCUM * MICRO
    diffs = {"loss": 0.0, "grad": 0.0, "param": 0.0, "norm": 0.0}
    for step in range(STEPS + 1):
        batch = torch.randint(0, 65, (dims.dp_size * rows, 17), generator=torch.Generator().manual_seed(step))
        x, y = batch[:, :-1], batch[:, 1:]
        if step == STEPS:  # evaluation after training
            loss = layout.eval_loss(x[dp_rank * rows:(dp_rank + 1) * rows], y[dp_rank * rows:(dp_rank + 1) * rows],
                                    nullcontext())
            dist.all_reduce(loss)
            with torch.no_grad():
                ref_eval = torch.stack([reference(x[r * rows:(r + 1) * rows], y[r * rows:(r + 1) * rows])[1]
                                        for r in range(dims.dp_size)]).mean()
            diffs["eval"] = abs(loss.item() / layout.loss_ranks - ref_eval.item())
            if isinstance(reference, MoEDecoder):
                diffs["routing"] = routing_figures_difference(layout, reference)
            break
        ref_loss = reference_backward(reference, x, y, dims.dp_size,
                                      cfg.parallel.microbatches or dims.pp * cfg.parallel.virtual_stages)
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        loss = torch.zeros(())
        mine = slice(dp_rank * rows, (dp_rank + 1) * rows)
        for micro in range(ACCUM):
            part = slice(mine.start + micro * MICRO, mine.start + (micro + 1) * MICRO)
            loss += layout.train_micro_step(x[part], y[part], accum=ACCUM, sync=micro == ACCUM - 1, autocast=nullcontext(),
                                            scaler=scaler, timer=timer)
        layout.finish_backward()
        # DeepSpeed keeps its gradients in partitions of its own and steps inside the last micro-step: its
        # gradients are seen through the norm and the parameters only.
        # the norm before clipping; then the clipped gradients must match too (read after the step: clipping sums a
        # partial gradient into a new one, parallel/clipping.sum_partial_gradients)
        norm = layout.optimizer_step(optimizer, scaler, 1.0)
        grads = {n: p.grad for n, p in layout.model.named_parameters() if p.grad is not None}
        ref_grads = {n: p.grad for n, p in reference.named_parameters(remove_duplicate=False)}
        dist.all_reduce(loss)
        diffs["loss"] = max(diffs["loss"], abs(loss.item() / layout.loss_ranks - ref_loss.item()))
        diffs["norm"] = max(diffs["norm"], abs(full(norm).item() - ref_norm.item()) / ref_norm.item())
        if engine_of(layout) is None:
            diffs["grad"] = max(diffs["grad"], worst(grads, ref_grads))
        ref_opt.step()
        if isinstance(reference, MoEDecoder):
            diffs["bias"] = max(diffs.get("bias", 0.0), step_router_biases(layout, reference))
        optimizer.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        ref_params = dict(reference.named_parameters(remove_duplicate=False))
        diffs["param"] = max(diffs["param"], worst(whole_parameters(layout), ref_params))
    ok = max(diffs.values()) <= (TOL if cfg.train.compile == "off" else COMPILED_TOL) and (len(grads) > 0 or engine_of(layout) is not None)
    # a float8 case must have computed some of its matmuls in float8, on both sides
    ok = ok and converted == sum(type(m).__name__ == "Float8Linear" for m in layout.model.modules())
    owned = sum(1 for _ in layout.model.named_parameters())
    # grad, param, norm: relative; seconds: what the case costs inside its launch (--durations gives the launch's)
    record(case, equal=ok, worst=diffs, owns=owned, seconds=round(time.perf_counter() - started, 2))
    return layout, optimizer


def gathered_state(layout, optimizer, info) -> dict | None:
    """The whole model and optimizer state on rank 0, from whatever this layout holds where."""
    model_state = full_model_state(layout.model)
    if hasattr(optimizer, "consolidate_state_dict"):
        raise SystemExit("gathering a zero1 optimizer is not needed by these tests")
    optim_state = get_optimizer_state_dict(layout.model, optimizer, options=StateDictOptions(full_state_dict=True))
    optim_state = {n: {k: full(v).detach().cpu() if torch.is_tensor(v) else v for k, v in s.items()}
                   for n, s in optim_state["state"].items()}  # keyed by parameter name
    parts = [None] * info.world_size if info.rank == 0 else None
    first_of_stage = all(c == 0 for d, c in layout.dims.coords(info.rank).items() if d != "pp")
    dist.gather_object((model_state, optim_state) if first_of_stage else ({}, {}), parts, dst=0)
    if info.rank != 0:
        return None
    whole = {"model": {}, "optimizer": {}}
    for model_part, optim_part in parts:
        whole["model"].update(model_part)
        whole["optimizer"].update(optim_part)
    return whole


def main() -> None:
    args = sys.argv[1:]
    save = Path(args[args.index("--save") + 1]) if "--save" in args else None
    load = Path(args[args.index("--load") + 1]) if "--load" in args else None
    cases = [a for a in args if ":" in a]
    with distributed() as info:
        for case in cases:
            if load is None:
                layout, optimizer = run_case(case, info)
                continue
            _, layout, optimizer = build(parse(case), info)
            checkpoint_dir = checkpoint.latest_checkpoint(load)
            layout.load_checkpoint(checkpoint_dir, optimizer, checkpoint.dcp_loader(checkpoint_dir))
            whole = gathered_state(layout, optimizer, info)
            if info.rank == 0:
                torch.save(whole, load / f"gathered-{case.replace(':', '_').replace(',', '_')}.pt")
                print(f"{case}: gathered the loaded state", flush=True)
        if save is not None:
            saver = checkpoint.Checkpointer(save, is_main=info.rank == 0)
            layout.save_checkpoint(saver, STEPS, optimizer, {"iteration": STEPS})
            saver.wait()
            print(f"saved {case} to {save}", flush=True)


if __name__ == "__main__":
    main()
    gc.freeze()  # leave without the interpreter's last collections: 0.5 s a rank
