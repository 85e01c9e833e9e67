"""Published training figures a cost model can be checked against: each with its source (repository, path, commit or
branch, section) and the configuration it was measured in. Data only; benchmarks/plan_published.py compares.

Every number below was read in the source named by the entry, and "quote" gives the line or table row it came
from, verbatim (table images were transcribed by eye; each transcribed row was checked against the table's own
aggregate column). Fields a source does not state are left out of "figures" or set to None in "layout", and
"notes" says where a layout value is implied by the code rather than stated in the text.

Keys
----
system: a `meshtrain plan` system name (perlmutter, perlmutter-80, dgx-h100, ...) where the machine is one of
    them; otherwise a descriptive name ("a100-80gb-selene", "h100-96gb-grand-teton", "h100-cluster",
    "a100-single") and "notes" names the nearest known system.
layout.backend: "ddp" for plain data parallelism (including a single process with no DDP wrapper),
    "zero1" for a sharded optimizer (Megatron's distributed optimizer), "fsdp" for FSDP2 (torchtitan).
layout.dtype: "fp32" (no TF32), "tf32" (fp32 storage, TF32 tensor-core matmuls), "fp16"/"bf16" (torch.autocast
    mixed precision: fp32 weights and optimizer state, fp16 adds a GradScaler), "bf16+float8" (torchtitan's
    Float8 nn.Linear on top of bf16 FSDP mixed precision), "mixed16" (16-bit mixed precision whose fp16/bf16
    choice the source does not state; both have the same tensor-core peak on A100 and H100).
figures.samples_per_s: samples per second for the WHOLE job (all GPUs), as NERSC's logs print it
    (global_batch_size x iterations / epoch wall time); divide by "gpus" for a per-GPU rate.
figures.tokens_per_s_per_gpu, tflops_per_gpu, mfu (a fraction, 0.41 = 41%): per GPU, as published.

Ambiguities worth knowing
-------------------------
* NERSC memory ("Memory usage after forward pass: X GB"): train_mp.py reads pynvml nvmlDeviceGetMemoryInfo(...)
  .used on rank 0's GPU and divides by 1024**3, so it is GiB although printed "GB", and it is the whole device's
  used memory as nvidia-smi shows it: CUDA context, NCCL and DALI buffers, and everything PyTorch's caching
  allocator has reserved (not torch.cuda.max_memory_allocated). It is sampled right after the forward pass of the
  second iteration (i == 1) of each epoch, before that iteration's backward; since the allocator keeps what the
  previous backward reserved, from epoch 2 on it is close to the reserved high-water mark. Only rank 0 is read.
  "Scaffolding memory high watermark" (memory_gib_before_training) is the same nvml reading after the model,
  optimizer and data loaders are built, before the first step.
* NERSC throughput: per epoch, timed around the training loop only (validation excluded), including data
  loading; the single-GPU runs use the `short` config (512 training samples = 32 steps of 16 per epoch), so
  per-epoch startup is a visible part of it. Epoch 1 includes warm-up (and torch.compile where enabled); entries
  quote the last epoch shown.
* NERSC model-parallel runs (SC23, SC24): the `mp` config sets enable_fused (and in SC24's repo enable_jit), but
  train_mp.py at the time overwrote both with the command-line flags (params.update({"enable_fused":
  args.enable_fused, "enable_jit": args.enable_jit})), and the README's commands pass neither, so those runs
  used plain (unfused) Adam and no torch.compile. DL4Sci25's train_mp.py applies the flag only when given, so
  its `mp` config's enable_jit: true holds there (torch.compile, and fused Adam, which that script ties to it).
* NERSC tensor parallelism is Megatron-style TP of attention heads and MLP hidden dim with NO sequence
  parallelism (LayerNorms and the activations between blocks are replicated on the tp ranks); the repos' `cp`
  (context parallelism over the patch sequence) is an optional exercise with no published figures.
* NERSC tp=4 runs: the README says the tp=1 run of `mp` was on "an 80G GPU"; it does not say which kind of node
  the 16-GPU tp=4 run used. Perlmutter's default (40 GB) nodes are assumed (the reading fits either).
* The brief's "SC23/SC24 branches" of NERSC/dl-at-scale-training are separate repositories:
  NERSC/sc23-dl-tutorial, NERSC/sc24-dl-tutorial; NERSC/dl-at-scale-training (main,
  cae476341f13108147df57ebcc5045346adb17f1, Feb 2025) carries the SC24 README's figures unchanged (same log lines;
  only the container tag in the text, 24.08.01, and links differ), so the nersc-sc24 entries cite it too;
  NERSC/dl4sci25-dl-at-scale (June 2025) has its own runs (its `mp` model is embed 1536, not 1024).
* Megatron-LM 2021 (Narayanan et al., SC21, Table 1): microbatch sizes are not given per row; eq. (3) of the
  paper "assumes activation recomputation", so full recomputation is recorded. All rows use the interleaved
  pipeline schedule with the scatter/gather optimisation (paper §5.1). A100 peak taken as 312 TFLOP/s (16-bit).
* Megatron-LM 2024 H100 table (README image images/model_table.png): precision, microbatch and recomputation
  are not stated; MFU = TFLOP/s / ~989 for every row, i.e. a 16-bit dense peak (not FP8). The README's
  --overlap-param-gather implies the distributed optimizer (arguments.py asserts it) and --tp-comm-overlap implies
  sequence parallelism (asserted likewise) wherever tp > 1.
* torchtitan (Dec 2024 benchmark): memory is torch.cuda max reserved (GiB), max over ranks; TPS/GPU read at
  iteration 90. The H100s are Grand Teton's 96 GB HBM2e parts at a 500 W limit, not DGX H100 (80 GB, 700 W).
  Sequence length is not stated for its Tables 1 and 3: 8192 is recorded from train_configs/llama3_8b.toml at
  the torchtitan commit the benchmark names (9dec370). The text says 1D 8B training "without Float8 achieves 33%
  to 39% MFU (with or without torch.compile, respectively)" against the SXM peak; which number belongs to which
  row is ambiguous, so no MFU is recorded for those rows.
* nanoGPT: the README gives no MFU; the 37% single-A100 figure is from transformer_sizing.ipynb. The README's
  "~250ms / iter to 135ms / iter" does not say which script, batch or GPU; the defaults of train.py and bench.py
  at that commit (batch 8 x 1024 tokens, bf16) are recorded. The README's "about 4 days" on 8 x A100 40GB
  (config/train_gpt2.py says "~5 days") is a wall-clock figure for 600k iterations, recorded as train_days.

Not found: per-GPU memory for Megatron-LM's tables and for nanoGPT (none is published), and numeric throughput
for NERSC's data-parallel scaling configs (bs64_opt/bs256_opt/bs1024_opt: the README shows only a TensorBoard
screenshot of RMSE against time, tutorial_images/dp_timings.png).
"""

PUBLISHED = [
    # ========== NERSC SC24 tutorial (Nov 2024, Perlmutter A100, nersc/pytorch:24.08.01) =================
    {"id": "nersc-sc24-vit-base-1gpu-baseline",
     "what": "ViT weather model, `short` config, 1 GPU, batch 16, PyTorch DataLoader with 0 workers "
             "(data-bound)",
     "source": "https://github.com/NERSC/sc24-dl-tutorial/blob/1fe335c15ccd6258d670728f8630ac1c2a054b80/README.md "
               "(same figures: NERSC/dl-at-scale-training@cae4763 README.md), section 'Single GPU "
               "performance profiling and optimization'",
     "system": "perlmutter", "gpus": 1, "gpus_per_node": 4,
     "model": {"kind": "vit", "img_size": [360, 720], "patch_size": 8, "channels": 20, "embed_dim": 384,
               "depth": 12, "num_heads": 8, "mlp_ratio": 4, "qkv_bias": True},
     "layout": {"backend": "ddp", "tp": 1, "pp": 1, "cp": 1, "sequence_parallel": False,
                "activation_checkpointing": "none", "micro_batch": 16, "global_batch": 16, "dtype": "tf32",
                "compile": False, "fused_optimizer": False, "data_loader": "pytorch, 0 workers"},
     "figures": {"samples_per_s": 8.808822},
     "quote": "2024-11-08 22:26:50,466 - root - INFO - Time taken for epoch 4 is 58.123552 sec, avg 8.808822 "
              "samples/sec | After the first epoch, we see that the throughput achieved is about 8.8 "
              "samples/s.",
     "notes": "Data loading bound: a compute model will over-predict; kept as the tutorial's starting point."},
    {"id": "nersc-sc24-vit-base-1gpu-4workers",
     "what": "as the baseline with --num_data_workers 4 (still data-bound)",
     "source": "https://github.com/NERSC/sc24-dl-tutorial/blob/1fe335c15ccd6258d670728f8630ac1c2a054b80/README.md "
               "(same figures: NERSC/dl-at-scale-training@cae4763 README.md), section 'Improving the native "
               "PyTorch dataloader performance'",
     "system": "perlmutter", "gpus": 1, "gpus_per_node": 4,
     "model": {"kind": "vit", "img_size": [360, 720], "patch_size": 8, "channels": 20, "embed_dim": 384,
               "depth": 12, "num_heads": 8, "mlp_ratio": 4, "qkv_bias": True},
     "layout": {"backend": "ddp", "tp": 1, "pp": 1, "cp": 1, "sequence_parallel": False,
                "activation_checkpointing": "none", "micro_batch": 16, "global_batch": 16, "dtype": "tf32",
                "compile": False, "fused_optimizer": False, "data_loader": "pytorch, 4 workers"},
     "figures": {"samples_per_s": 12.584423},
     "quote": "2024-11-08 22:25:45,206 - root - INFO - Time taken for epoch 4 is 40.685218 sec, avg "
              "12.584423 samples/sec | Increasing the number of workers to 4 improves throughput to around "
              "12.5 samples per second, while increasing to more workers yields a slight degradation in "
              "performance.",
     "notes": "8 workers: 12.061094 samples/s, 16 workers: 10.628197 (epoch 4 lines of the same section)."},
    {"id": "nersc-sc24-vit-base-1gpu-dali-tf32",
     "what": "ViT base, 1 GPU, batch 16, DALI loader, fp32 weights with TF32 matmuls (no AMP)",
     "source": "https://github.com/NERSC/sc24-dl-tutorial/blob/1fe335c15ccd6258d670728f8630ac1c2a054b80/README.md "
               "(same figures: NERSC/dl-at-scale-training@cae4763 README.md), section 'Using NVIDIA DALI'",
     "system": "perlmutter", "gpus": 1, "gpus_per_node": 4,
     "model": {"kind": "vit", "img_size": [360, 720], "patch_size": 8, "channels": 20, "embed_dim": 384,
               "depth": 12, "num_heads": 8, "mlp_ratio": 4, "qkv_bias": True},
     "layout": {"backend": "ddp", "tp": 1, "pp": 1, "cp": 1, "sequence_parallel": False,
                "activation_checkpointing": "none", "micro_batch": 16, "global_batch": 16, "dtype": "tf32",
                "compile": False, "fused_optimizer": False, "data_loader": "dali, 8 workers"},
     "figures": {"samples_per_s": 13.192617},
     "quote": "2024-11-08 22:40:51,877 - root - INFO - Time taken for epoch 4 is 38.809587 sec, avg "
              "13.192617 samples/sec",
     "notes": "TF32 by default: the README attributes it to CUDNN/CUBLAS defaults; disabling it (next entry) "
              "drops throughput to ~10.1, so this run is TF32-compute-bound."},
    {"id": "nersc-sc24-vit-base-1gpu-dali-fp32-notf32",
     "what": "as dali-tf32 with NVIDIA_TF32_OVERRIDE=0 (true fp32 matmuls)",
     "source": "https://github.com/NERSC/sc24-dl-tutorial/blob/1fe335c15ccd6258d670728f8630ac1c2a054b80/README.md "
               "(same figures: NERSC/dl-at-scale-training@cae4763 README.md), section 'Enabling Mixed "
               "Precision Training'",
     "system": "perlmutter", "gpus": 1, "gpus_per_node": 4,
     "model": {"kind": "vit", "img_size": [360, 720], "patch_size": 8, "channels": 20, "embed_dim": 384,
               "depth": 12, "num_heads": 8, "mlp_ratio": 4, "qkv_bias": True},
     "layout": {"backend": "ddp", "tp": 1, "pp": 1, "cp": 1, "sequence_parallel": False,
                "activation_checkpointing": "none", "micro_batch": 16, "global_batch": 16, "dtype": "fp32",
                "compile": False, "fused_optimizer": False, "data_loader": "dali, 8 workers"},
     "figures": {"samples_per_s": 10.077626},
     "quote": "2024-11-08 22:41:38,333 - root - INFO - Time taken for epoch 4 is 50.805618 sec, avg "
              "10.077626 samples/sec"},
    {"id": "nersc-sc24-vit-base-1gpu-amp-fp16",
     "what": "ViT base, 1 GPU, batch 16, DALI, AMP fp16 (--amp_mode=fp16)",
     "source": "https://github.com/NERSC/sc24-dl-tutorial/blob/1fe335c15ccd6258d670728f8630ac1c2a054b80/README.md "
               "(same figures: NERSC/dl-at-scale-training@cae4763 README.md), section 'Enabling Mixed "
               "Precision Training'",
     "system": "perlmutter", "gpus": 1, "gpus_per_node": 4,
     "model": {"kind": "vit", "img_size": [360, 720], "patch_size": 8, "channels": 20, "embed_dim": 384,
               "depth": 12, "num_heads": 8, "mlp_ratio": 4, "qkv_bias": True},
     "layout": {"backend": "ddp", "tp": 1, "pp": 1, "cp": 1, "sequence_parallel": False,
                "activation_checkpointing": "none", "micro_batch": 16, "global_batch": 16, "dtype": "fp16",
                "compile": False, "fused_optimizer": False, "data_loader": "dali, 8 workers"},
     "figures": {"samples_per_s": 53.38105},
     "quote": "2024-11-08 22:50:15,578 - root - INFO - Time taken for epoch 4 is 9.591419 sec, avg 53.381050 "
              "samples/sec"},
    {"id": "nersc-sc24-vit-base-1gpu-amp-bf16",
     "what": "ViT base, 1 GPU, batch 16, DALI, AMP bf16 (--amp_mode=bf16)",
     "source": "https://github.com/NERSC/sc24-dl-tutorial/blob/1fe335c15ccd6258d670728f8630ac1c2a054b80/README.md "
               "(same figures: NERSC/dl-at-scale-training@cae4763 README.md), section 'Enabling Mixed "
               "Precision Training'",
     "system": "perlmutter", "gpus": 1, "gpus_per_node": 4,
     "model": {"kind": "vit", "img_size": [360, 720], "patch_size": 8, "channels": 20, "embed_dim": 384,
               "depth": 12, "num_heads": 8, "mlp_ratio": 4, "qkv_bias": True},
     "layout": {"backend": "ddp", "tp": 1, "pp": 1, "cp": 1, "sequence_parallel": False,
                "activation_checkpointing": "none", "micro_batch": 16, "global_batch": 16, "dtype": "bf16",
                "compile": False, "fused_optimizer": False, "data_loader": "dali, 8 workers"},
     "figures": {"samples_per_s": 53.206519},
     "quote": "2024-11-08 22:48:27,196 - root - INFO - Time taken for epoch 4 is 9.622881 sec, avg 53.206519 "
              "samples/sec | ... improving throughput to over 53 samples/s in each case.",
     "notes": "epoch 2: 53.982490, epoch 3: 53.727041."},
    {"id": "nersc-sc24-vit-base-1gpu-bf16-fused",
     "what": "ViT base, 1 GPU, batch 16, DALI, AMP bf16, fused Adam (--enable_fused)",
     "source": "https://github.com/NERSC/sc24-dl-tutorial/blob/1fe335c15ccd6258d670728f8630ac1c2a054b80/README.md "
               "(same figures: NERSC/dl-at-scale-training@cae4763 README.md), section 'Just-in-time (JIT) "
               "compiliation via `torch.compile` and fused optimizers'",
     "system": "perlmutter", "gpus": 1, "gpus_per_node": 4,
     "model": {"kind": "vit", "img_size": [360, 720], "patch_size": 8, "channels": 20, "embed_dim": 384,
               "depth": 12, "num_heads": 8, "mlp_ratio": 4, "qkv_bias": True},
     "layout": {"backend": "ddp", "tp": 1, "pp": 1, "cp": 1, "sequence_parallel": False,
                "activation_checkpointing": "none", "micro_batch": 16, "global_batch": 16, "dtype": "bf16",
                "compile": False, "fused_optimizer": True, "data_loader": "dali, 8 workers"},
     "figures": {"samples_per_s": 53.312592},
     "quote": "2024-11-08 22:58:58,428 - root - INFO - Time taken for epoch 4 is 9.603735 sec, avg 53.312592 "
              "samples/sec"},
    {"id": "nersc-sc24-vit-base-1gpu-bf16-fused-compile",
     "what": "ViT base, 1 GPU, batch 16, DALI, AMP bf16, fused Adam, torch.compile (--enable_jit)",
     "source": "https://github.com/NERSC/sc24-dl-tutorial/blob/1fe335c15ccd6258d670728f8630ac1c2a054b80/README.md "
               "(same figures: NERSC/dl-at-scale-training@cae4763 README.md), section 'Just-in-time (JIT) "
               "compiliation via `torch.compile` and fused optimizers'",
     "system": "perlmutter", "gpus": 1, "gpus_per_node": 4,
     "model": {"kind": "vit", "img_size": [360, 720], "patch_size": 8, "channels": 20, "embed_dim": 384,
               "depth": 12, "num_heads": 8, "mlp_ratio": 4, "qkv_bias": True},
     "layout": {"backend": "ddp", "tp": 1, "pp": 1, "cp": 1, "sequence_parallel": False,
                "activation_checkpointing": "none", "micro_batch": 16, "global_batch": 16, "dtype": "bf16",
                "compile": True, "fused_optimizer": True, "data_loader": "dali, 8 workers"},
     "figures": {"samples_per_s": 54.984018},
     "quote": "2024-11-08 23:00:36,256 - root - INFO - Time taken for epoch 4 is 9.311797 sec, avg 54.984018 "
              "samples/sec",
     "notes": "epoch 2: 52.162874, epoch 3: 53.020490 (epoch 1, with compilation: 8.695034)."},
    {"id": "nersc-sc24-vit-mp-tp1-4gpu",
     "what": "`mp` config (ViT embed 1024), tensor_parallel=1: pure data parallel over 4 GPUs of one 80 GB "
             "node",
     "source": "https://github.com/NERSC/sc24-dl-tutorial/blob/1fe335c15ccd6258d670728f8630ac1c2a054b80/README.md "
               "(same figures: NERSC/dl-at-scale-training@cae4763 README.md), section 'Model parallelism' > "
               "'Running the model parallel code'",
     "system": "perlmutter-80", "gpus": 4, "gpus_per_node": 4,
     "model": {"kind": "vit", "img_size": [360, 720], "patch_size": 8, "channels": 20, "embed_dim": 1024,
               "depth": 12, "num_heads": 8, "mlp_ratio": 4, "qkv_bias": True},
     "layout": {"backend": "ddp", "tp": 1, "pp": 1, "cp": 1, "dp": 4, "sequence_parallel": False,
                "activation_checkpointing": "none", "micro_batch": 16, "global_batch": 64, "dtype": "fp16",
                "compile": False, "fused_optimizer": False, "data_loader": "dali, 8 workers"},
     "figures": {"samples_per_s": 93.092973, "memory_gib_per_gpu": 44.92926025390625,
                 "memory_gib_before_training": 10.4781494140625},
     "quote": "2024-11-12 03:40:29,132 - root - INFO -  Memory usage after forward pass: 44.92926025390625 "
              "GB. | 2024-11-12 03:47:16,095 - root - INFO - Time taken for epoch 4 is 407.678463 sec, avg "
              "93.092973 samples/sec | Scaffolding memory high watermark: 10.4781494140625 GB. | If we run "
              "it on an 80G GPU, we can see the estimated memory usage to be around 45GB and hence just "
              "overflows the 40G GPU.",
     "notes": "On a 40 GB node the same run OOMs: 'GPU 2 has a total capacity of 39.39 GiB ... Of the "
              "allocated memory 31.28 GiB is allocated by PyTorch'. Command: sbatch --nodes 1 "
              "submit_pm_mp.sh --config=mp --tensor_parallel=1 (no --enable_fused/--enable_jit, see module "
              "notes). Epoch 1 memory 43.81."},
    {"id": "nersc-sc24-vit-mp-tp4-16gpu",
     "what": "`mp` config (ViT embed 1024), tensor_parallel=4 x data parallel 4 over 16 GPUs (4 nodes)",
     "source": "https://github.com/NERSC/sc24-dl-tutorial/blob/1fe335c15ccd6258d670728f8630ac1c2a054b80/README.md "
               "(same figures: NERSC/dl-at-scale-training@cae4763 README.md), section 'Model parallelism' > "
               "'Running the model parallel code'",
     "system": "perlmutter", "gpus": 16, "gpus_per_node": 4,
     "model": {"kind": "vit", "img_size": [360, 720], "patch_size": 8, "channels": 20, "embed_dim": 1024,
               "depth": 12, "num_heads": 8, "mlp_ratio": 4, "qkv_bias": True},
     "layout": {"backend": "ddp", "tp": 4, "pp": 1, "cp": 1, "dp": 4, "sequence_parallel": False,
                "activation_checkpointing": "none", "micro_batch": 16, "global_batch": 64, "dtype": "fp16",
                "compile": False, "fused_optimizer": False, "data_loader": "dali, 8 workers",
                "parallel_order": "tp-cp-dp"},
     "figures": {"samples_per_s": 125.150175, "memory_gib_per_gpu": 33.2371826171875,
                 "memory_gib_before_training": 10.18255615234375},
     "quote": "2024-11-08 13:07:34,361 - root - INFO -  Memory usage after forward pass: 33.2371826171875 "
              "GB. | 2024-11-08 13:12:37,045 - root - INFO - Time taken for epoch 4 is 303.251674 sec, avg "
              "125.150175 samples/sec | We see that the memory has reduced to 33.2G. Also note that the "
              "throughput is higher.",
     "notes": "Node type (40 vs 80 GB) not stated. tp group within a node (order tp-cp-dp). Command: sbatch "
              "--nodes 4 submit_pm_mp.sh --config=mp --tensor_parallel=4. Epoch 1 memory 31.68."},
    # ========== NERSC SC23 tutorial (Sep-Nov 2023, Perlmutter A100, nersc/pytorch:ngc-23.07-v0) =========
    {"id": "nersc-sc23-vit-base-1gpu-dali-tf32",
     "what": "ViT base, 1 GPU, batch 16, DALI, fp32 weights with TF32 matmuls",
     "source": "https://github.com/NERSC/sc23-dl-tutorial/blob/88d4df2ae2e4ced33f6fc86a5a8f1f4c7068429e/README.md, "
               "section 'Using NVIDIA DALI'",
     "system": "perlmutter", "gpus": 1, "gpus_per_node": 4,
     "model": {"kind": "vit", "img_size": [360, 720], "patch_size": 8, "channels": 20, "embed_dim": 384,
               "depth": 12, "num_heads": 8, "mlp_ratio": 4, "qkv_bias": True},
     "layout": {"backend": "ddp", "tp": 1, "pp": 1, "cp": 1, "sequence_parallel": False,
                "activation_checkpointing": "none", "micro_batch": 16, "global_batch": 16, "dtype": "tf32",
                "compile": False, "fused_optimizer": False, "data_loader": "dali, 8 workers"},
     "figures": {"samples_per_s": 13.281769173080217},
     "quote": "2023-09-26 22:03:31,039 - root - INFO - Time taken for epoch 4 is 38.549081325531006 sec, avg "
              "13.281769173080217 samples/sec"},
    {"id": "nersc-sc23-vit-base-1gpu-dali-fp32-notf32",
     "what": "as dali-tf32 with NVIDIA_TF32_OVERRIDE=0",
     "source": "https://github.com/NERSC/sc23-dl-tutorial/blob/88d4df2ae2e4ced33f6fc86a5a8f1f4c7068429e/README.md, "
               "section 'Enabling Mixed Precision Training'",
     "system": "perlmutter", "gpus": 1, "gpus_per_node": 4,
     "model": {"kind": "vit", "img_size": [360, 720], "patch_size": 8, "channels": 20, "embed_dim": 384,
               "depth": 12, "num_heads": 8, "mlp_ratio": 4, "qkv_bias": True},
     "layout": {"backend": "ddp", "tp": 1, "pp": 1, "cp": 1, "sequence_parallel": False,
                "activation_checkpointing": "none", "micro_batch": 16, "global_batch": 16, "dtype": "fp32",
                "compile": False, "fused_optimizer": False, "data_loader": "dali, 8 workers"},
     "figures": {"samples_per_s": 10.112859752596927},
     "quote": "2023-09-26 22:39:51,199 - root - INFO - Time taken for epoch 4 is 50.62860679626465 sec, avg "
              "10.112859752596927 samples/sec"},
    {"id": "nersc-sc23-vit-base-1gpu-amp-fp16",
     "what": "ViT base, 1 GPU, batch 16, DALI, AMP fp16",
     "source": "https://github.com/NERSC/sc23-dl-tutorial/blob/88d4df2ae2e4ced33f6fc86a5a8f1f4c7068429e/README.md, "
               "section 'Enabling Mixed Precision Training'",
     "system": "perlmutter", "gpus": 1, "gpus_per_node": 4,
     "model": {"kind": "vit", "img_size": [360, 720], "patch_size": 8, "channels": 20, "embed_dim": 384,
               "depth": 12, "num_heads": 8, "mlp_ratio": 4, "qkv_bias": True},
     "layout": {"backend": "ddp", "tp": 1, "pp": 1, "cp": 1, "sequence_parallel": False,
                "activation_checkpointing": "none", "micro_batch": 16, "global_batch": 16, "dtype": "fp16",
                "compile": False, "fused_optimizer": False, "data_loader": "dali, 8 workers"},
     "figures": {"samples_per_s": 42.499671983153895},
     "quote": "2023-09-26 22:43:33,977 - root - INFO - Time taken for epoch 4 is 12.047151803970337 sec, avg "
              "42.499671983153895 samples/sec",
     "notes": "AMP bf16 (same section): 42.620959661033474 samples/s at epoch 4."},
    {"id": "nersc-sc23-vit-base-1gpu-bf16-fused-compile",
     "what": "ViT base, 1 GPU, batch 16, DALI, AMP bf16, fused Adam, torch.compile",
     "source": "https://github.com/NERSC/sc23-dl-tutorial/blob/88d4df2ae2e4ced33f6fc86a5a8f1f4c7068429e/README.md, "
               "section 'Just-in-time (JIT) compiliation via `torch.compile` and fused optimizers'",
     "system": "perlmutter", "gpus": 1, "gpus_per_node": 4,
     "model": {"kind": "vit", "img_size": [360, 720], "patch_size": 8, "channels": 20, "embed_dim": 384,
               "depth": 12, "num_heads": 8, "mlp_ratio": 4, "qkv_bias": True},
     "layout": {"backend": "ddp", "tp": 1, "pp": 1, "cp": 1, "sequence_parallel": False,
                "activation_checkpointing": "none", "micro_batch": 16, "global_batch": 16, "dtype": "bf16",
                "compile": True, "fused_optimizer": True, "data_loader": "dali, 8 workers"},
     "figures": {"samples_per_s": 42.83777982234843},
     "quote": "2023-09-26 23:13:56,639 - root - INFO - Time taken for epoch 4 is 11.952066659927368 sec, avg "
              "42.83777982234843 samples/sec",
     "notes": "bf16 + fused without compile: 42.63348428183284 (epoch 4). SC23 is ~20% slower than SC24's "
              "identical runs (older container)."},
    {"id": "nersc-sc23-vit-mp-tp1-4gpu",
     "what": "`mp` config (ViT embed 1024), row_parallel_size=1: data parallel over 4 GPUs of one 80 GB node",
     "source": "https://github.com/NERSC/sc23-dl-tutorial/blob/88d4df2ae2e4ced33f6fc86a5a8f1f4c7068429e/README.md, "
               "section 'Model parallelism' > 'Running the model parallel code'",
     "system": "perlmutter-80", "gpus": 4, "gpus_per_node": 4,
     "model": {"kind": "vit", "img_size": [360, 720], "patch_size": 8, "channels": 20, "embed_dim": 1024,
               "depth": 12, "num_heads": 8, "mlp_ratio": 4, "qkv_bias": True},
     "layout": {"backend": "ddp", "tp": 1, "pp": 1, "cp": 1, "dp": 4, "sequence_parallel": False,
                "activation_checkpointing": "none", "micro_batch": 16, "global_batch": 64, "dtype": "fp16",
                "compile": False, "fused_optimizer": False, "data_loader": "dali, 8 workers"},
     "figures": {"samples_per_s": 48.01662782862127, "memory_gib_per_gpu": 41.20123291015625,
                 "memory_gib_before_training": 10.2071533203125},
     "quote": "2023-11-03 04:42:04,724 - root - INFO -  Memory usage after forward pass: 41.20123291015625 "
              "GB. | 2023-11-03 04:55:13,705 - root - INFO - Time taken for epoch 3 is 790.3928642272949 "
              "sec, avg 48.01662782862127 samples/sec | If we run it on an 80G GPU, we can see the estimated "
              "memory usage to be around 41GB and hence just overflows the 40G GPU.",
     "notes": "OOM on 40 GB: 'Of the allocated memory 31.34 GiB is allocated by PyTorch, and 1.40 GiB is "
              "reserved by PyTorch but unallocated.' Command: --config=mp --row_parallel_size=1. Epoch 1 "
              "memory 40.08."},
    {"id": "nersc-sc23-vit-mp-tp4-16gpu",
     "what": "`mp` config (ViT embed 1024), row_parallel_size=4 x data parallel 4 over 16 GPUs (4 nodes)",
     "source": "https://github.com/NERSC/sc23-dl-tutorial/blob/88d4df2ae2e4ced33f6fc86a5a8f1f4c7068429e/README.md, "
               "section 'Model parallelism' > 'Running the model parallel code'",
     "system": "perlmutter", "gpus": 16, "gpus_per_node": 4,
     "model": {"kind": "vit", "img_size": [360, 720], "patch_size": 8, "channels": 20, "embed_dim": 1024,
               "depth": 12, "num_heads": 8, "mlp_ratio": 4, "qkv_bias": True},
     "layout": {"backend": "ddp", "tp": 4, "pp": 1, "cp": 1, "dp": 4, "sequence_parallel": False,
                "activation_checkpointing": "none", "micro_batch": 16, "global_batch": 64, "dtype": "fp16",
                "compile": False, "fused_optimizer": False, "data_loader": "dali, 8 workers"},
     "figures": {"samples_per_s": 114.43958207729146, "memory_gib_per_gpu": 32.7415771484375,
                 "memory_gib_before_training": 8.9056396484375},
     "quote": "2023-11-04 05:07:04,120 - root - INFO -  Memory usage after forward pass: 32.7415771484375 "
              "GB. | 2023-11-04 05:12:35,057 - root - INFO - Time taken for epoch 3 is 331.6335074901581 "
              "sec, avg 114.43958207729146 samples/sec | We see that the memory has reduced to 32.7G.",
     "notes": "Node type not stated. Epoch 1 memory 28.62."},
    # ========== NERSC DL4Sci25 training (June 2025, Perlmutter A100, nersc/pytorch:24.08.01) ============
    {"id": "nersc-dl4sci25-vit-base-1gpu-amp-fp16",
     "what": "ViT base, 1 GPU, batch 16, PyTorch DataLoader 8 workers (no DALI in this repo), AMP fp16",
     "source": "https://github.com/NERSC/dl4sci25-dl-at-scale/blob/85d671daaf7d7f2eeccc2573fcbed6da825bff95/README.md, "
               "section 'Single GPU quick optimization tips' > 'Enabling Mixed Precision Training'",
     "system": "perlmutter", "gpus": 1, "gpus_per_node": 4,
     "model": {"kind": "vit", "img_size": [360, 720], "patch_size": 8, "channels": 20, "embed_dim": 384,
               "depth": 12, "num_heads": 8, "mlp_ratio": 4, "qkv_bias": True},
     "layout": {"backend": "ddp", "tp": 1, "pp": 1, "cp": 1, "sequence_parallel": False,
                "activation_checkpointing": "none", "micro_batch": 16, "global_batch": 16, "dtype": "fp16",
                "compile": False, "fused_optimizer": False, "data_loader": "pytorch, 8 workers"},
     "figures": {"samples_per_s": 35.940697},
     "quote": "2025-06-19 21:16:49,282 - root - INFO - Time taken for epoch 4 is 14.245689 sec, avg "
              "35.940697 samples/sec | ... improving throughput to over 37 samples/s in each case.",
     "notes": "epoch 3: 37.654960. Possibly partly data-bound (PyTorch loader, not DALI)."},
    {"id": "nersc-dl4sci25-vit-base-1gpu-fp16-compile-fused",
     "what": "ViT base, 1 GPU, batch 16, PyTorch DataLoader 8 workers, AMP fp16, torch.compile + fused Adam",
     "source": "https://github.com/NERSC/dl4sci25-dl-at-scale/blob/85d671daaf7d7f2eeccc2573fcbed6da825bff95/README.md, "
               "section 'Just-in-time (JIT) compiliation via `torch.compile` and fused optimizers'",
     "system": "perlmutter", "gpus": 1, "gpus_per_node": 4,
     "model": {"kind": "vit", "img_size": [360, 720], "patch_size": 8, "channels": 20, "embed_dim": 384,
               "depth": 12, "num_heads": 8, "mlp_ratio": 4, "qkv_bias": True},
     "layout": {"backend": "ddp", "tp": 1, "pp": 1, "cp": 1, "sequence_parallel": False,
                "activation_checkpointing": "none", "micro_batch": 16, "global_batch": 16, "dtype": "fp16",
                "compile": True, "fused_optimizer": True, "data_loader": "pytorch, 8 workers"},
     "figures": {"samples_per_s": 40.921871},
     "quote": "2025-06-19 21:21:12,433 - root - INFO - Time taken for epoch 4 is 12.511647 sec, avg "
              "40.921871 samples/sec",
     "notes": "epoch 2: 43.924494, epoch 3: 41.666471."},
    {"id": "nersc-dl4sci25-vit-mp1536-tp1-4gpu",
     "what": "DL4Sci25 `mp` config (ViT embed 1536), tensor_parallel=1: data parallel over 4 GPUs of an 80 "
             "GB node",
     "source": "https://github.com/NERSC/dl4sci25-dl-at-scale/blob/85d671daaf7d7f2eeccc2573fcbed6da825bff95/README.md, "
               "section 'Model parallelism' > 'Running the model parallel code'",
     "system": "perlmutter-80", "gpus": 4, "gpus_per_node": 4,
     "model": {"kind": "vit", "img_size": [360, 720], "patch_size": 8, "channels": 20, "embed_dim": 1536,
               "depth": 12, "num_heads": 8, "mlp_ratio": 4, "qkv_bias": True},
     "layout": {"backend": "ddp", "tp": 1, "pp": 1, "cp": 1, "dp": 4, "sequence_parallel": False,
                "activation_checkpointing": "none", "micro_batch": 16, "global_batch": 64, "dtype": "fp16",
                "compile": True, "fused_optimizer": True, "data_loader": "pytorch, 8 workers"},
     "figures": {"samples_per_s": 51.194841, "memory_gib_per_gpu": 54.43212890625,
                 "memory_gib_before_training": 5.67236328125},
     "quote": "2025-06-20 05:40:21,813 - root - INFO -  Memory usage after forward pass: 54.43212890625 GB. "
              "| 2025-06-20 05:52:36,300 - root - INFO - Time taken for epoch 3 is 741.324692 sec, avg "
              "51.194841 samples/sec | If we run it on an 80G GPU, we can see the estimated memory usage to "
              "be around 55GB",
     "notes": "compile/fused from the mp config's enable_jit: true (see module notes). The OOM trace the "
              "README shows for 40 GB is copied verbatim from SC24's (embed 1024) run. Epoch 1 memory 53.38."},
    {"id": "nersc-dl4sci25-vit-mp1536-tp4-16gpu",
     "what": "DL4Sci25 `mp` config (ViT embed 1536), tensor_parallel=4 x data parallel 4 over 16 GPUs",
     "source": "https://github.com/NERSC/dl4sci25-dl-at-scale/blob/85d671daaf7d7f2eeccc2573fcbed6da825bff95/README.md, "
               "section 'Model parallelism' > 'Running the model parallel code'",
     "system": "perlmutter", "gpus": 16, "gpus_per_node": 4,
     "model": {"kind": "vit", "img_size": [360, 720], "patch_size": 8, "channels": 20, "embed_dim": 1536,
               "depth": 12, "num_heads": 8, "mlp_ratio": 4, "qkv_bias": True},
     "layout": {"backend": "ddp", "tp": 4, "pp": 1, "cp": 1, "dp": 4, "sequence_parallel": False,
                "activation_checkpointing": "none", "micro_batch": 16, "global_batch": 64, "dtype": "fp16",
                "compile": True, "fused_optimizer": True, "data_loader": "pytorch, 8 workers"},
     "figures": {"samples_per_s": 71.889093, "memory_gib_per_gpu": 38.7576904296875,
                 "memory_gib_before_training": 3.5721435546875},
     "quote": "2025-06-20 04:56:41,520 - root - INFO -  Memory usage after forward pass: 38.7576904296875 "
              "GB. | 2025-06-20 05:05:21,630 - root - INFO - Time taken for epoch 4 is 527.924314 sec, avg "
              "71.889093 samples/sec | We see that the memory has reduced to 39G.",
     "notes": "Memory grows each epoch (36.15, 38.14, 38.45, 38.76): a reserved-pool reading, not a steady "
              "state. Epoch 3: 72.350747 samples/s. Node type not stated."},
    # ========== Megatron-LM, Narayanan et al. SC21 Table 1 (Selene, DGX A100 80GB) ======================
    {"id": "megatron-sc21-gpt-1.7b",
     "what": "GPT 1.7b weak-scaling run (PTD-P, interleaved 1F1B), end-to-end training throughput",
     "source": "Narayanan et al., 'Efficient Large-Scale Language Model Training on GPU Clusters Using "
               "Megatron-LM', SC21, arXiv:2104.04473, Table 1 (§5.1 End-to-End Performance); the same rows "
               "(model-parallel size t*p only) are in "
               "https://github.com/NVIDIA/Megatron-LM/blob/50a4b5fa0280a160cc1b03a1c15faddbc1b1da9a/images/cases_april2021.png "
               "(README, April 2021)",
     "system": "a100-80gb-selene", "gpus": 32, "gpus_per_node": 8,
     "model": {"kind": "gpt", "n_layer": 24, "n_head": 24, "n_embd": 2304, "block_size": 2048,
               "vocab_size": 51200, "params_billion": 1.7},
     "layout": {"backend": "ddp", "tp": 1, "pp": 1, "cp": 1, "sequence_parallel": False,
                "activation_checkpointing": "full", "micro_batch": None, "global_batch": 512,
                "dtype": "mixed16", "pp_schedule": "interleaved"},
     "figures": {"tflops_per_gpu": 137, "mfu": 0.44, "aggregate_pflops": 4.4},
     "quote": "| 1.7 | 24 | 2304 | 24 | 1 | 1 | 32 | 512 | 137 | 44% | 4.4 |",
     "notes": "Selene: 8 x A100 80GB per node (NVLink/NVSwitch), 8 x 200 Gb/s HDR InfiniBand per node; "
              "nearest meshtrain system: none (perlmutter-80 is 4 per node, 4 x 25 GB/s). FLOPs by the "
              "paper's eq. (3), which counts the recomputation forward; % of a 312 TFLOP/s peak."},
    {"id": "megatron-sc21-gpt-3.6b",
     "what": "GPT 3.6b weak-scaling run (PTD-P, interleaved 1F1B), end-to-end training throughput",
     "source": "Narayanan et al., 'Efficient Large-Scale Language Model Training on GPU Clusters Using "
               "Megatron-LM', SC21, arXiv:2104.04473, Table 1 (§5.1 End-to-End Performance); the same rows "
               "(model-parallel size t*p only) are in "
               "https://github.com/NVIDIA/Megatron-LM/blob/50a4b5fa0280a160cc1b03a1c15faddbc1b1da9a/images/cases_april2021.png "
               "(README, April 2021)",
     "system": "a100-80gb-selene", "gpus": 64, "gpus_per_node": 8,
     "model": {"kind": "gpt", "n_layer": 30, "n_head": 32, "n_embd": 3072, "block_size": 2048,
               "vocab_size": 51200, "params_billion": 3.6},
     "layout": {"backend": "ddp", "tp": 2, "pp": 1, "cp": 1, "sequence_parallel": False,
                "activation_checkpointing": "full", "micro_batch": None, "global_batch": 512,
                "dtype": "mixed16", "pp_schedule": "interleaved"},
     "figures": {"tflops_per_gpu": 138, "mfu": 0.44, "aggregate_pflops": 8.8},
     "quote": "| 3.6 | 32 | 3072 | 30 | 2 | 1 | 64 | 512 | 138 | 44% | 8.8 |",
     "notes": "Selene: 8 x A100 80GB per node (NVLink/NVSwitch), 8 x 200 Gb/s HDR InfiniBand per node; "
              "nearest meshtrain system: none (perlmutter-80 is 4 per node, 4 x 25 GB/s). FLOPs by the "
              "paper's eq. (3), which counts the recomputation forward; % of a 312 TFLOP/s peak."},
    {"id": "megatron-sc21-gpt-7.5b",
     "what": "GPT 7.5b weak-scaling run (PTD-P, interleaved 1F1B), end-to-end training throughput",
     "source": "Narayanan et al., 'Efficient Large-Scale Language Model Training on GPU Clusters Using "
               "Megatron-LM', SC21, arXiv:2104.04473, Table 1 (§5.1 End-to-End Performance); the same rows "
               "(model-parallel size t*p only) are in "
               "https://github.com/NVIDIA/Megatron-LM/blob/50a4b5fa0280a160cc1b03a1c15faddbc1b1da9a/images/cases_april2021.png "
               "(README, April 2021)",
     "system": "a100-80gb-selene", "gpus": 128, "gpus_per_node": 8,
     "model": {"kind": "gpt", "n_layer": 36, "n_head": 32, "n_embd": 4096, "block_size": 2048,
               "vocab_size": 51200, "params_billion": 7.5},
     "layout": {"backend": "ddp", "tp": 4, "pp": 1, "cp": 1, "sequence_parallel": False,
                "activation_checkpointing": "full", "micro_batch": None, "global_batch": 512,
                "dtype": "mixed16", "pp_schedule": "interleaved"},
     "figures": {"tflops_per_gpu": 142, "mfu": 0.46, "aggregate_pflops": 18.2},
     "quote": "| 7.5 | 32 | 4096 | 36 | 4 | 1 | 128 | 512 | 142 | 46% | 18.2 |",
     "notes": "Selene: 8 x A100 80GB per node (NVLink/NVSwitch), 8 x 200 Gb/s HDR InfiniBand per node; "
              "nearest meshtrain system: none (perlmutter-80 is 4 per node, 4 x 25 GB/s). FLOPs by the "
              "paper's eq. (3), which counts the recomputation forward; % of a 312 TFLOP/s peak."},
    {"id": "megatron-sc21-gpt-18.4b",
     "what": "GPT 18.4b weak-scaling run (PTD-P, interleaved 1F1B), end-to-end training throughput",
     "source": "Narayanan et al., 'Efficient Large-Scale Language Model Training on GPU Clusters Using "
               "Megatron-LM', SC21, arXiv:2104.04473, Table 1 (§5.1 End-to-End Performance); the same rows "
               "(model-parallel size t*p only) are in "
               "https://github.com/NVIDIA/Megatron-LM/blob/50a4b5fa0280a160cc1b03a1c15faddbc1b1da9a/images/cases_april2021.png "
               "(README, April 2021)",
     "system": "a100-80gb-selene", "gpus": 256, "gpus_per_node": 8,
     "model": {"kind": "gpt", "n_layer": 40, "n_head": 48, "n_embd": 6144, "block_size": 2048,
               "vocab_size": 51200, "params_billion": 18.4},
     "layout": {"backend": "ddp", "tp": 8, "pp": 1, "cp": 1, "sequence_parallel": False,
                "activation_checkpointing": "full", "micro_batch": None, "global_batch": 1024,
                "dtype": "mixed16", "pp_schedule": "interleaved"},
     "figures": {"tflops_per_gpu": 135, "mfu": 0.43, "aggregate_pflops": 34.6},
     "quote": "| 18.4 | 48 | 6144 | 40 | 8 | 1 | 256 | 1024 | 135 | 43% | 34.6 |",
     "notes": "Selene: 8 x A100 80GB per node (NVLink/NVSwitch), 8 x 200 Gb/s HDR InfiniBand per node; "
              "nearest meshtrain system: none (perlmutter-80 is 4 per node, 4 x 25 GB/s). FLOPs by the "
              "paper's eq. (3), which counts the recomputation forward; % of a 312 TFLOP/s peak."},
    {"id": "megatron-sc21-gpt-39.1b",
     "what": "GPT 39.1b weak-scaling run (PTD-P, interleaved 1F1B), end-to-end training throughput",
     "source": "Narayanan et al., 'Efficient Large-Scale Language Model Training on GPU Clusters Using "
               "Megatron-LM', SC21, arXiv:2104.04473, Table 1 (§5.1 End-to-End Performance); the same rows "
               "(model-parallel size t*p only) are in "
               "https://github.com/NVIDIA/Megatron-LM/blob/50a4b5fa0280a160cc1b03a1c15faddbc1b1da9a/images/cases_april2021.png "
               "(README, April 2021)",
     "system": "a100-80gb-selene", "gpus": 512, "gpus_per_node": 8,
     "model": {"kind": "gpt", "n_layer": 48, "n_head": 64, "n_embd": 8192, "block_size": 2048,
               "vocab_size": 51200, "params_billion": 39.1},
     "layout": {"backend": "ddp", "tp": 8, "pp": 2, "cp": 1, "sequence_parallel": False,
                "activation_checkpointing": "full", "micro_batch": None, "global_batch": 1536,
                "dtype": "mixed16", "pp_schedule": "interleaved"},
     "figures": {"tflops_per_gpu": 138, "mfu": 0.44, "aggregate_pflops": 70.8},
     "quote": "| 39.1 | 64 | 8192 | 48 | 8 | 2 | 512 | 1536 | 138 | 44% | 70.8 |",
     "notes": "Selene: 8 x A100 80GB per node (NVLink/NVSwitch), 8 x 200 Gb/s HDR InfiniBand per node; "
              "nearest meshtrain system: none (perlmutter-80 is 4 per node, 4 x 25 GB/s). FLOPs by the "
              "paper's eq. (3), which counts the recomputation forward; % of a 312 TFLOP/s peak."},
    {"id": "megatron-sc21-gpt-76.1b",
     "what": "GPT 76.1b weak-scaling run (PTD-P, interleaved 1F1B), end-to-end training throughput",
     "source": "Narayanan et al., 'Efficient Large-Scale Language Model Training on GPU Clusters Using "
               "Megatron-LM', SC21, arXiv:2104.04473, Table 1 (§5.1 End-to-End Performance); the same rows "
               "(model-parallel size t*p only) are in "
               "https://github.com/NVIDIA/Megatron-LM/blob/50a4b5fa0280a160cc1b03a1c15faddbc1b1da9a/images/cases_april2021.png "
               "(README, April 2021)",
     "system": "a100-80gb-selene", "gpus": 1024, "gpus_per_node": 8,
     "model": {"kind": "gpt", "n_layer": 60, "n_head": 80, "n_embd": 10240, "block_size": 2048,
               "vocab_size": 51200, "params_billion": 76.1},
     "layout": {"backend": "ddp", "tp": 8, "pp": 4, "cp": 1, "sequence_parallel": False,
                "activation_checkpointing": "full", "micro_batch": None, "global_batch": 1792,
                "dtype": "mixed16", "pp_schedule": "interleaved"},
     "figures": {"tflops_per_gpu": 140, "mfu": 0.45, "aggregate_pflops": 143.8},
     "quote": "| 76.1 | 80 | 10240 | 60 | 8 | 4 | 1024 | 1792 | 140 | 45% | 143.8 |",
     "notes": "Selene: 8 x A100 80GB per node (NVLink/NVSwitch), 8 x 200 Gb/s HDR InfiniBand per node; "
              "nearest meshtrain system: none (perlmutter-80 is 4 per node, 4 x 25 GB/s). FLOPs by the "
              "paper's eq. (3), which counts the recomputation forward; % of a 312 TFLOP/s peak."},
    {"id": "megatron-sc21-gpt-145.6b",
     "what": "GPT 145.6b weak-scaling run (PTD-P, interleaved 1F1B), end-to-end training throughput",
     "source": "Narayanan et al., 'Efficient Large-Scale Language Model Training on GPU Clusters Using "
               "Megatron-LM', SC21, arXiv:2104.04473, Table 1 (§5.1 End-to-End Performance); the same rows "
               "(model-parallel size t*p only) are in "
               "https://github.com/NVIDIA/Megatron-LM/blob/50a4b5fa0280a160cc1b03a1c15faddbc1b1da9a/images/cases_april2021.png "
               "(README, April 2021)",
     "system": "a100-80gb-selene", "gpus": 1536, "gpus_per_node": 8,
     "model": {"kind": "gpt", "n_layer": 80, "n_head": 96, "n_embd": 12288, "block_size": 2048,
               "vocab_size": 51200, "params_billion": 145.6},
     "layout": {"backend": "ddp", "tp": 8, "pp": 8, "cp": 1, "sequence_parallel": False,
                "activation_checkpointing": "full", "micro_batch": None, "global_batch": 2304,
                "dtype": "mixed16", "pp_schedule": "interleaved"},
     "figures": {"tflops_per_gpu": 148, "mfu": 0.47, "aggregate_pflops": 227.1},
     "quote": "| 145.6 | 96 | 12288 | 80 | 8 | 8 | 1536 | 2304 | 148 | 47% | 227.1 |",
     "notes": "Selene: 8 x A100 80GB per node (NVLink/NVSwitch), 8 x 200 Gb/s HDR InfiniBand per node; "
              "nearest meshtrain system: none (perlmutter-80 is 4 per node, 4 x 25 GB/s). FLOPs by the "
              "paper's eq. (3), which counts the recomputation forward; % of a 312 TFLOP/s peak."},
    {"id": "megatron-sc21-gpt-310.1b",
     "what": "GPT 310.1b weak-scaling run (PTD-P, interleaved 1F1B), end-to-end training throughput",
     "source": "Narayanan et al., 'Efficient Large-Scale Language Model Training on GPU Clusters Using "
               "Megatron-LM', SC21, arXiv:2104.04473, Table 1 (§5.1 End-to-End Performance); the same rows "
               "(model-parallel size t*p only) are in "
               "https://github.com/NVIDIA/Megatron-LM/blob/50a4b5fa0280a160cc1b03a1c15faddbc1b1da9a/images/cases_april2021.png "
               "(README, April 2021)",
     "system": "a100-80gb-selene", "gpus": 1920, "gpus_per_node": 8,
     "model": {"kind": "gpt", "n_layer": 96, "n_head": 128, "n_embd": 16384, "block_size": 2048,
               "vocab_size": 51200, "params_billion": 310.1},
     "layout": {"backend": "ddp", "tp": 8, "pp": 16, "cp": 1, "sequence_parallel": False,
                "activation_checkpointing": "full", "micro_batch": None, "global_batch": 2160,
                "dtype": "mixed16", "pp_schedule": "interleaved"},
     "figures": {"tflops_per_gpu": 155, "mfu": 0.5, "aggregate_pflops": 297.4},
     "quote": "| 310.1 | 128 | 16384 | 96 | 8 | 16 | 1920 | 2160 | 155 | 50% | 297.4 |",
     "notes": "Selene: 8 x A100 80GB per node (NVLink/NVSwitch), 8 x 200 Gb/s HDR InfiniBand per node; "
              "nearest meshtrain system: none (perlmutter-80 is 4 per node, 4 x 25 GB/s). FLOPs by the "
              "paper's eq. (3), which counts the recomputation forward; % of a 312 TFLOP/s peak."},
    {"id": "megatron-sc21-gpt-529.6b",
     "what": "GPT 529.6b weak-scaling run (PTD-P, interleaved 1F1B), end-to-end training throughput",
     "source": "Narayanan et al., 'Efficient Large-Scale Language Model Training on GPU Clusters Using "
               "Megatron-LM', SC21, arXiv:2104.04473, Table 1 (§5.1 End-to-End Performance); the same rows "
               "(model-parallel size t*p only) are in "
               "https://github.com/NVIDIA/Megatron-LM/blob/50a4b5fa0280a160cc1b03a1c15faddbc1b1da9a/images/cases_april2021.png "
               "(README, April 2021)",
     "system": "a100-80gb-selene", "gpus": 2520, "gpus_per_node": 8,
     "model": {"kind": "gpt", "n_layer": 105, "n_head": 128, "n_embd": 20480, "block_size": 2048,
               "vocab_size": 51200, "params_billion": 529.6},
     "layout": {"backend": "ddp", "tp": 8, "pp": 35, "cp": 1, "sequence_parallel": False,
                "activation_checkpointing": "full", "micro_batch": None, "global_batch": 2520,
                "dtype": "mixed16", "pp_schedule": "interleaved"},
     "figures": {"tflops_per_gpu": 163, "mfu": 0.52, "aggregate_pflops": 410.2},
     "quote": "| 529.6 | 128 | 20480 | 105 | 8 | 35 | 2520 | 2520 | 163 | 52% | 410.2 |",
     "notes": "Selene: 8 x A100 80GB per node (NVLink/NVSwitch), 8 x 200 Gb/s HDR InfiniBand per node; "
              "nearest meshtrain system: none (perlmutter-80 is 4 per node, 4 x 25 GB/s). FLOPs by the "
              "paper's eq. (3), which counts the recomputation forward; % of a 312 TFLOP/s peak."},
    {"id": "megatron-sc21-gpt-1008b",
     "what": "GPT 1008b weak-scaling run (PTD-P, interleaved 1F1B), end-to-end training throughput",
     "source": "Narayanan et al., 'Efficient Large-Scale Language Model Training on GPU Clusters Using "
               "Megatron-LM', SC21, arXiv:2104.04473, Table 1 (§5.1 End-to-End Performance); the same rows "
               "(model-parallel size t*p only) are in "
               "https://github.com/NVIDIA/Megatron-LM/blob/50a4b5fa0280a160cc1b03a1c15faddbc1b1da9a/images/cases_april2021.png "
               "(README, April 2021)",
     "system": "a100-80gb-selene", "gpus": 3072, "gpus_per_node": 8,
     "model": {"kind": "gpt", "n_layer": 128, "n_head": 160, "n_embd": 25600, "block_size": 2048,
               "vocab_size": 51200, "params_billion": 1008.0},
     "layout": {"backend": "ddp", "tp": 8, "pp": 64, "cp": 1, "sequence_parallel": False,
                "activation_checkpointing": "full", "micro_batch": None, "global_batch": 3072,
                "dtype": "mixed16", "pp_schedule": "interleaved"},
     "figures": {"tflops_per_gpu": 163, "mfu": 0.52, "aggregate_pflops": 502.0},
     "quote": "| 1008.0 | 160 | 25600 | 128 | 8 | 64 | 3072 | 3072 | 163 | 52% | 502.0 |",
     "notes": "Selene: 8 x A100 80GB per node (NVLink/NVSwitch), 8 x 200 Gb/s HDR InfiniBand per node; "
              "nearest meshtrain system: none (perlmutter-80 is 4 per node, 4 x 25 GB/s). FLOPs by the "
              "paper's eq. (3), which counts the recomputation forward; % of a 312 TFLOP/s peak."},
    # ========== Megatron-LM README H100 table (July 2024) ===============================================
    {"id": "megatron-h100-gpt-1.7b",
     "what": "GPT 1.7b weak-scaling benchmark on H100 (Megatron-Core), end-to-end training throughput",
     "source": "https://github.com/NVIDIA/Megatron-LM/blob/d98e8a64ddf34856e74b24714e3bedb2f5a39553/images/model_table.png "
               "(README.md, section 'Performance Benchmarking'; image added in "
               "f2e5db402c44ae309aa6448bcb4ae87e8ae0f5f4, July 2024)",
     "system": "h100-cluster", "gpus": 48, "gpus_per_node": 8,
     "model": {"kind": "gpt", "n_layer": 24, "n_head": 16, "n_embd": 2048, "block_size": 4096,
               "vocab_size": 131072, "params_billion": 1.7},
     "layout": {"backend": "zero1", "tp": 1, "pp": 1, "cp": 1, "dp": 48, "sequence_parallel": False,
                "activation_checkpointing": None, "micro_batch": None, "global_batch": 192, "dtype": "mixed16",
                "overlap": "--overlap-grad-reduce --overlap-param-gather --tp-comm-overlap"},
     "figures": {"tflops_per_gpu": 408.8, "mfu": 0.41, "aggregate_pflops": 19.6},
     "quote": "1.7B | 16 | 2048 | 24 | 1 | 1 | 48 | 48 | 192 | 408.8 | 41% | 19.6",
     "notes": "Table is an image; row transcribed. GPUs per node and node type not stated (8 assumed: "
              "NVIDIA's H100 clusters are DGX H100; nearest meshtrain system dgx-h100). backend zero1 and "
              "sequence_parallel are implied by the overlap flags (module notes)."},
    {"id": "megatron-h100-gpt-7.1b",
     "what": "GPT 7.1b weak-scaling benchmark on H100 (Megatron-Core), end-to-end training throughput",
     "source": "https://github.com/NVIDIA/Megatron-LM/blob/d98e8a64ddf34856e74b24714e3bedb2f5a39553/images/model_table.png "
               "(README.md, section 'Performance Benchmarking'; image added in "
               "f2e5db402c44ae309aa6448bcb4ae87e8ae0f5f4, July 2024)",
     "system": "h100-cluster", "gpus": 96, "gpus_per_node": 8,
     "model": {"kind": "gpt", "n_layer": 30, "n_head": 32, "n_embd": 4096, "block_size": 4096,
               "vocab_size": 131072, "params_billion": 7.1},
     "layout": {"backend": "zero1", "tp": 2, "pp": 1, "cp": 1, "dp": 48, "sequence_parallel": True,
                "activation_checkpointing": None, "micro_batch": None, "global_batch": 192, "dtype": "mixed16",
                "overlap": "--overlap-grad-reduce --overlap-param-gather --tp-comm-overlap"},
     "figures": {"tflops_per_gpu": 465.9, "mfu": 0.47, "aggregate_pflops": 44.7},
     "quote": "7.1B | 32 | 4096 | 30 | 2 | 1 | 48 | 96 | 192 | 465.9 | 47% | 44.7",
     "notes": "Table is an image; row transcribed. GPUs per node and node type not stated (8 assumed: "
              "NVIDIA's H100 clusters are DGX H100; nearest meshtrain system dgx-h100). backend zero1 and "
              "sequence_parallel are implied by the overlap flags (module notes)."},
    {"id": "megatron-h100-gpt-16b",
     "what": "GPT 16b weak-scaling benchmark on H100 (Megatron-Core), end-to-end training throughput",
     "source": "https://github.com/NVIDIA/Megatron-LM/blob/d98e8a64ddf34856e74b24714e3bedb2f5a39553/images/model_table.png "
               "(README.md, section 'Performance Benchmarking'; image added in "
               "f2e5db402c44ae309aa6448bcb4ae87e8ae0f5f4, July 2024)",
     "system": "h100-cluster", "gpus": 192, "gpus_per_node": 8,
     "model": {"kind": "gpt", "n_layer": 32, "n_head": 48, "n_embd": 6144, "block_size": 4096,
               "vocab_size": 131072, "params_billion": 16},
     "layout": {"backend": "zero1", "tp": 4, "pp": 1, "cp": 1, "dp": 48, "sequence_parallel": True,
                "activation_checkpointing": None, "micro_batch": None, "global_batch": 192, "dtype": "mixed16",
                "overlap": "--overlap-grad-reduce --overlap-param-gather --tp-comm-overlap"},
     "figures": {"tflops_per_gpu": 489.1, "mfu": 0.49, "aggregate_pflops": 93.9},
     "quote": "16B | 48 | 6144 | 32 | 4 | 1 | 48 | 192 | 192 | 489.1 | 49% | 93.9",
     "notes": "Table is an image; row transcribed. GPUs per node and node type not stated (8 assumed: "
              "NVIDIA's H100 clusters are DGX H100; nearest meshtrain system dgx-h100). backend zero1 and "
              "sequence_parallel are implied by the overlap flags (module notes)."},
    {"id": "megatron-h100-gpt-32b",
     "what": "GPT 32b weak-scaling benchmark on H100 (Megatron-Core), end-to-end training throughput",
     "source": "https://github.com/NVIDIA/Megatron-LM/blob/d98e8a64ddf34856e74b24714e3bedb2f5a39553/images/model_table.png "
               "(README.md, section 'Performance Benchmarking'; image added in "
               "f2e5db402c44ae309aa6448bcb4ae87e8ae0f5f4, July 2024)",
     "system": "h100-cluster", "gpus": 384, "gpus_per_node": 8,
     "model": {"kind": "gpt", "n_layer": 48, "n_head": 56, "n_embd": 7168, "block_size": 4096,
               "vocab_size": 131072, "params_billion": 32},
     "layout": {"backend": "zero1", "tp": 8, "pp": 1, "cp": 1, "dp": 48, "sequence_parallel": True,
                "activation_checkpointing": None, "micro_batch": None, "global_batch": 192, "dtype": "mixed16",
                "overlap": "--overlap-grad-reduce --overlap-param-gather --tp-comm-overlap"},
     "figures": {"tflops_per_gpu": 459.6, "mfu": 0.46, "aggregate_pflops": 176.5},
     "quote": "32B | 56 | 7168 | 48 | 8 | 1 | 48 | 384 | 192 | 459.6 | 46% | 176.5",
     "notes": "Table is an image; row transcribed. GPUs per node and node type not stated (8 assumed: "
              "NVIDIA's H100 clusters are DGX H100; nearest meshtrain system dgx-h100). backend zero1 and "
              "sequence_parallel are implied by the overlap flags (module notes)."},
    {"id": "megatron-h100-gpt-70b",
     "what": "GPT 70b weak-scaling benchmark on H100 (Megatron-Core), end-to-end training throughput",
     "source": "https://github.com/NVIDIA/Megatron-LM/blob/d98e8a64ddf34856e74b24714e3bedb2f5a39553/images/model_table.png "
               "(README.md, section 'Performance Benchmarking'; image added in "
               "f2e5db402c44ae309aa6448bcb4ae87e8ae0f5f4, July 2024)",
     "system": "h100-cluster", "gpus": 768, "gpus_per_node": 8,
     "model": {"kind": "gpt", "n_layer": 84, "n_head": 64, "n_embd": 8192, "block_size": 4096,
               "vocab_size": 131072, "params_billion": 70},
     "layout": {"backend": "zero1", "tp": 8, "pp": 2, "cp": 1, "dp": 48, "sequence_parallel": True,
                "activation_checkpointing": None, "micro_batch": None, "global_batch": 384, "dtype": "mixed16",
                "overlap": "--overlap-grad-reduce --overlap-param-gather --tp-comm-overlap"},
     "figures": {"tflops_per_gpu": 419.7, "mfu": 0.42, "aggregate_pflops": 322.3},
     "quote": "70B | 64 | 8192 | 84 | 8 | 2 | 48 | 768 | 384 | 419.7 | 42% | 322.3",
     "notes": "Table is an image; row transcribed. GPUs per node and node type not stated (8 assumed: "
              "NVIDIA's H100 clusters are DGX H100; nearest meshtrain system dgx-h100). backend zero1 and "
              "sequence_parallel are implied by the overlap flags (module notes)."},
    {"id": "megatron-h100-gpt-119b",
     "what": "GPT 119b weak-scaling benchmark on H100 (Megatron-Core), end-to-end training throughput",
     "source": "https://github.com/NVIDIA/Megatron-LM/blob/d98e8a64ddf34856e74b24714e3bedb2f5a39553/images/model_table.png "
               "(README.md, section 'Performance Benchmarking'; image added in "
               "f2e5db402c44ae309aa6448bcb4ae87e8ae0f5f4, July 2024)",
     "system": "h100-cluster", "gpus": 1536, "gpus_per_node": 8,
     "model": {"kind": "gpt", "n_layer": 92, "n_head": 80, "n_embd": 10240, "block_size": 4096,
               "vocab_size": 131072, "params_billion": 119},
     "layout": {"backend": "zero1", "tp": 8, "pp": 4, "cp": 1, "dp": 48, "sequence_parallel": True,
                "activation_checkpointing": None, "micro_batch": None, "global_batch": 768, "dtype": "mixed16",
                "overlap": "--overlap-grad-reduce --overlap-param-gather --tp-comm-overlap"},
     "figures": {"tflops_per_gpu": 420.5, "mfu": 0.43, "aggregate_pflops": 645.9},
     "quote": "119B | 80 | 10240 | 92 | 8 | 4 | 48 | 1536 | 768 | 420.5 | 43% | 645.9",
     "notes": "Table is an image; row transcribed. GPUs per node and node type not stated (8 assumed: "
              "NVIDIA's H100 clusters are DGX H100; nearest meshtrain system dgx-h100). backend zero1 and "
              "sequence_parallel are implied by the overlap flags (module notes)."},
    {"id": "megatron-h100-gpt-177b",
     "what": "GPT 177b weak-scaling benchmark on H100 (Megatron-Core), end-to-end training throughput",
     "source": "https://github.com/NVIDIA/Megatron-LM/blob/d98e8a64ddf34856e74b24714e3bedb2f5a39553/images/model_table.png "
               "(README.md, section 'Performance Benchmarking'; image added in "
               "f2e5db402c44ae309aa6448bcb4ae87e8ae0f5f4, July 2024)",
     "system": "h100-cluster", "gpus": 2304, "gpus_per_node": 8,
     "model": {"kind": "gpt", "n_layer": 96, "n_head": 96, "n_embd": 12288, "block_size": 4096,
               "vocab_size": 131072, "params_billion": 177},
     "layout": {"backend": "zero1", "tp": 8, "pp": 6, "cp": 1, "dp": 48, "sequence_parallel": True,
                "activation_checkpointing": None, "micro_batch": None, "global_batch": 1152, "dtype": "mixed16",
                "overlap": "--overlap-grad-reduce --overlap-param-gather --tp-comm-overlap"},
     "figures": {"tflops_per_gpu": 432.8, "mfu": 0.44, "aggregate_pflops": 997.2},
     "quote": "177B | 96 | 12288 | 96 | 8 | 6 | 48 | 2304 | 1152 | 432.8 | 44% | 997.2",
     "notes": "Table is an image; row transcribed. GPUs per node and node type not stated (8 assumed: "
              "NVIDIA's H100 clusters are DGX H100; nearest meshtrain system dgx-h100). backend zero1 and "
              "sequence_parallel are implied by the overlap flags (module notes)."},
    {"id": "megatron-h100-gpt-314b",
     "what": "GPT 314b weak-scaling benchmark on H100 (Megatron-Core), end-to-end training throughput",
     "source": "https://github.com/NVIDIA/Megatron-LM/blob/d98e8a64ddf34856e74b24714e3bedb2f5a39553/images/model_table.png "
               "(README.md, section 'Performance Benchmarking'; image added in "
               "f2e5db402c44ae309aa6448bcb4ae87e8ae0f5f4, July 2024)",
     "system": "h100-cluster", "gpus": 3072, "gpus_per_node": 8,
     "model": {"kind": "gpt", "n_layer": 96, "n_head": 128, "n_embd": 16384, "block_size": 4096,
               "vocab_size": 131072, "params_billion": 314},
     "layout": {"backend": "zero1", "tp": 8, "pp": 8, "cp": 1, "dp": 48, "sequence_parallel": True,
                "activation_checkpointing": None, "micro_batch": None, "global_batch": 1536, "dtype": "mixed16",
                "overlap": "--overlap-grad-reduce --overlap-param-gather --tp-comm-overlap"},
     "figures": {"tflops_per_gpu": 474.4, "mfu": 0.48, "aggregate_pflops": 1457.4},
     "quote": "314B | 128 | 16384 | 96 | 8 | 8 | 48 | 3072 | 1536 | 474.4 | 48% | 1457.4",
     "notes": "Table is an image; row transcribed. GPUs per node and node type not stated (8 assumed: "
              "NVIDIA's H100 clusters are DGX H100; nearest meshtrain system dgx-h100). backend zero1 and "
              "sequence_parallel are implied by the overlap flags (module notes)."},
    {"id": "megatron-h100-gpt-462b",
     "what": "GPT 462b weak-scaling benchmark on H100 (Megatron-Core), end-to-end training throughput",
     "source": "https://github.com/NVIDIA/Megatron-LM/blob/d98e8a64ddf34856e74b24714e3bedb2f5a39553/images/model_table.png "
               "(README.md, section 'Performance Benchmarking'; image added in "
               "f2e5db402c44ae309aa6448bcb4ae87e8ae0f5f4, July 2024)",
     "system": "h100-cluster", "gpus": 6144, "gpus_per_node": 8,
     "model": {"kind": "gpt", "n_layer": 112, "n_head": 144, "n_embd": 18432, "block_size": 4096,
               "vocab_size": 131072, "params_billion": 462},
     "layout": {"backend": "zero1", "tp": 8, "pp": 16, "cp": 1, "dp": 48, "sequence_parallel": True,
                "activation_checkpointing": None, "micro_batch": None, "global_batch": 3072, "dtype": "mixed16",
                "overlap": "--overlap-grad-reduce --overlap-param-gather --tp-comm-overlap"},
     "figures": {"tflops_per_gpu": 459.9, "mfu": 0.47, "aggregate_pflops": 2825.6},
     "quote": "462B | 144 | 18432 | 112 | 8 | 16 | 48 | 6144 | 3072 | 459.9 | 47% | 2825.6",
     "notes": "Table is an image; row transcribed. GPUs per node and node type not stated (8 assumed: "
              "NVIDIA's H100 clusters are DGX H100; nearest meshtrain system dgx-h100). backend zero1 and "
              "sequence_parallel are implied by the overlap flags (module notes)."},
    # ========== nanoGPT (karpathy/nanoGPT) ==============================================================
    {"id": "nanogpt-gpt2-124m-1gpu-mfu",
     "what": "GPT-2 124M on one A100, batch 20 x grad-accum 5 of 1024 tokens: 755 ms/iter, 37% MFU",
     "source": "https://github.com/karpathy/nanoGPT/blob/3341b4cecc9d3a315330ad372c5473cf8de5addd/transformer_sizing.ipynb "
               "(cells after 'what is our model flops utilization (MFU)?')",
     "system": "a100-single", "gpus": 1, "gpus_per_node": 1,
     "model": {"kind": "gpt", "n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024,
               "vocab_size": 50257, "bias": False},
     "layout": {"backend": "ddp", "tp": 1, "pp": 1, "cp": 1, "sequence_parallel": False,
                "activation_checkpointing": "none", "micro_batch": 20, "grad_accum": 5, "global_batch": 100,
                "dtype": "bf16", "compile": True},
     "figures": {"iter_time_s": 0.755, "mfu": 0.3714},
     "quote": "I trained the model above with a batch_size of 20 and grad_accum of 5, which runs in about "
              "755ms on a single A100 GPU. | fraction of A100 used: 37.14%",
     "notes": "MFU against 312 TFLOP/s with the notebook's own FLOPs count (fwd+bwd, incl. attention). A100 "
              "memory size not stated (the notebook's memory cell assumes 40 GB); nearest systems: "
              "perlmutter/polaris (A100-SXM4-40GB). dtype/compile from train.py defaults at that commit "
              "(dtype = 'bfloat16', compile = True; flash attention via scaled_dot_product_attention when "
              "available)."},
    {"id": "nanogpt-gpt2-124m-compile-iter",
     "what": "GPT-2 124M iteration time with and without torch.compile (Dec 2022)",
     "source": "https://github.com/karpathy/nanoGPT/blob/5a725d909837be19f8613379823a51bfd4d611a4/README.md "
               "(section 'efficiency notes'; same text in README at 3adf61e154c3fe3fca428ad6bc3818b27a3b8291)",
     "system": "a100-single", "gpus": 1, "gpus_per_node": 1,
     "model": {"kind": "gpt", "n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024,
               "vocab_size": 50257, "bias": True, "dropout": None},
     "layout": {"backend": "ddp", "tp": 1, "pp": 1, "cp": 1, "sequence_parallel": False,
                "activation_checkpointing": "none", "micro_batch": 8, "global_batch": 8, "dtype": "bf16",
                "compile": True},
     "figures": {"iter_time_s": 0.135, "iter_time_s_without_compile": 0.25},
     "quote": "The improvement from the one line of code is noticeable, e.g. cutting down iteration time "
              "from ~250ms / iter to 135ms / iter.",
     "notes": "Ambiguous: the README does not say which script, batch or GPU. batch 8 x 1024, bf16 are "
              "bench.py's and train.py's defaults at that commit (train.py: dropout 0.1, bench.py: 0); the "
              "README of the time speaks of 'an A100 40GB GPU'. Treat as a loose check."},
    {"id": "nanogpt-gpt2-124m-8xa100-owt",
     "what": "GPT-2 124M reproduction on OpenWebText, one 8 x A100 40GB node, DDP, 600k iterations of ~0.5M "
             "tokens",
     "source": "https://github.com/karpathy/nanoGPT/blob/3adf61e154c3fe3fca428ad6bc3818b27a3b8291/README.md "
               "(intro and section 'reproducing GPT-2') and config/train_gpt2.py at the same commit",
     "system": "a100-40gb-8gpu-node", "gpus": 8, "gpus_per_node": 8,
     "model": {"kind": "gpt", "n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024,
               "vocab_size": 50304, "bias": False, "dropout": 0.0},
     "layout": {"backend": "ddp", "tp": 1, "pp": 1, "cp": 1, "sequence_parallel": False,
                "activation_checkpointing": "none", "micro_batch": 12, "grad_accum": 5, "global_batch": 480,
                "dtype": "bf16", "compile": True, "iterations": 600000},
     "figures": {"train_days": 4},
     "quote": "running on a single 8XA100 40GB node in about 4 days of training. | This will run for about 4 "
              "days using PyTorch Distributed Data Parallel (DDP) and go down to loss of ~2.85. | # 12 batch "
              "size * 1024 block size * 5 gradaccum * 8 GPUs = 491,520 | max_iters = 600000",
     "notes": "config/train_gpt2.py's own comment says '~5 days'. gradient_accumulation_steps = 5 * 8 in the "
              "config is divided by the 8 ranks in train.py (5 per GPU). vocab 50304 is train.py's padded "
              "default when the dataset has no meta.pkl (OpenWebText has none); includes evaluation every 1000 "
              "iterations."},
    # ========== torchtitan, Llama 3 / 3.1 8B ============================================================
    {"id": "torchtitan-llama3-8b-8gpu-fsdp",
     "what": "Llama 3.1 8B, FSDP2 over 8 H100, local batch 2, selective AC, no compile",
     "source": "https://github.com/pytorch/torchtitan/blob/820504e20d1149fbf0b98c567af24c4b0433b22d/benchmarks/llama3_h100_202412_torchtitan.md, "
               "Table 1",
     "system": "h100-96gb-grand-teton", "gpus": 8, "gpus_per_node": 8,
     "model": {"kind": "llama", "n_layer": 32, "n_head": 32, "n_kv_head": 8, "n_embd": 4096,
               "ffn_hidden": 14336, "block_size": 8192, "vocab_size": 128256, "rope_theta": 500000},
     "layout": {"backend": "fsdp", "tp": 1, "pp": 1, "cp": 1, "dp": 8, "sequence_parallel": False,
                "activation_checkpointing": "selective", "micro_batch": 2, "global_batch": 16, "dtype": "bf16",
                "compile": False},
     "figures": {"tokens_per_s_per_gpu": 5762, "memory_gib_per_gpu": 82.4},
     "quote": "| FSDP | 5,762 | 82.4 |",
     "notes": "block_size 8192 not stated in the benchmark (llama3_8b.toml default at 9dec370). ffn_hidden "
              "from torchtitan ModelArgs (ffn_dim_multiplier=1.3, multiple_of=1024); vocab from the Llama 3 "
              "tokenizer. Memory: max reserved, max over ranks. FSDP mixed precision: bf16 params, fp32 "
              "reduce (torchtitan defaults). Selective AC option 'op' (toml default). Nearest meshtrain "
              "system: dgx-h100 (80 GB, 700 W)."},
    {"id": "torchtitan-llama3-8b-8gpu-fsdp-compile",
     "what": "Llama 3.1 8B, FSDP2 over 8 H100, local batch 2, selective AC, torch.compile",
     "source": "https://github.com/pytorch/torchtitan/blob/820504e20d1149fbf0b98c567af24c4b0433b22d/benchmarks/llama3_h100_202412_torchtitan.md, "
               "Table 1",
     "system": "h100-96gb-grand-teton", "gpus": 8, "gpus_per_node": 8,
     "model": {"kind": "llama", "n_layer": 32, "n_head": 32, "n_kv_head": 8, "n_embd": 4096,
               "ffn_hidden": 14336, "block_size": 8192, "vocab_size": 128256, "rope_theta": 500000},
     "layout": {"backend": "fsdp", "tp": 1, "pp": 1, "cp": 1, "dp": 8, "sequence_parallel": False,
                "activation_checkpointing": "selective", "micro_batch": 2, "global_batch": 16, "dtype": "bf16",
                "compile": True},
     "figures": {"tokens_per_s_per_gpu": 6667, "memory_gib_per_gpu": 77.0},
     "quote": "| FSDP + torch.compile | 6,667 | 77.0 |",
     "notes": "block_size 8192 not stated in the benchmark (llama3_8b.toml default at 9dec370). ffn_hidden "
              "from torchtitan ModelArgs (ffn_dim_multiplier=1.3, multiple_of=1024); vocab from the Llama 3 "
              "tokenizer. Memory: max reserved, max over ranks. FSDP mixed precision: bf16 params, fp32 "
              "reduce (torchtitan defaults). Selective AC option 'op' (toml default). Nearest meshtrain "
              "system: dgx-h100 (80 GB, 700 W)."},
    {"id": "torchtitan-llama3-8b-8gpu-fsdp-compile-float8",
     "what": "Llama 3.1 8B, FSDP2 over 8 H100, local batch 2, selective AC, torch.compile + Float8",
     "source": "https://github.com/pytorch/torchtitan/blob/820504e20d1149fbf0b98c567af24c4b0433b22d/benchmarks/llama3_h100_202412_torchtitan.md, "
               "Table 1",
     "system": "h100-96gb-grand-teton", "gpus": 8, "gpus_per_node": 8,
     "model": {"kind": "llama", "n_layer": 32, "n_head": 32, "n_kv_head": 8, "n_embd": 4096,
               "ffn_hidden": 14336, "block_size": 8192, "vocab_size": 128256, "rope_theta": 500000},
     "layout": {"backend": "fsdp", "tp": 1, "pp": 1, "cp": 1, "dp": 8, "sequence_parallel": False,
                "activation_checkpointing": "selective", "micro_batch": 2, "global_batch": 16,
                "dtype": "bf16+float8", "compile": True},
     "figures": {"tokens_per_s_per_gpu": 8532, "memory_gib_per_gpu": 76.8},
     "quote": "| FSDP + torch.compile + Float8 | 8,532 | 76.8 |",
     "notes": "block_size 8192 not stated in the benchmark (llama3_8b.toml default at 9dec370). ffn_hidden "
              "from torchtitan ModelArgs (ffn_dim_multiplier=1.3, multiple_of=1024); vocab from the Llama 3 "
              "tokenizer. Memory: max reserved, max over ranks. FSDP mixed precision: bf16 params, fp32 "
              "reduce (torchtitan defaults). Selective AC option 'op' (toml default). Nearest meshtrain "
              "system: dgx-h100 (80 GB, 700 W)."},
    {"id": "torchtitan-llama3-8b-128gpu-fsdp",
     "what": "Llama 3.1 8B, FSDP2 over 128 H100, local batch 2, selective AC, no compile",
     "source": "https://github.com/pytorch/torchtitan/blob/820504e20d1149fbf0b98c567af24c4b0433b22d/benchmarks/llama3_h100_202412_torchtitan.md, "
               "Table 3",
     "system": "h100-96gb-grand-teton", "gpus": 128, "gpus_per_node": 8,
     "model": {"kind": "llama", "n_layer": 32, "n_head": 32, "n_kv_head": 8, "n_embd": 4096,
               "ffn_hidden": 14336, "block_size": 8192, "vocab_size": 128256, "rope_theta": 500000},
     "layout": {"backend": "fsdp", "tp": 1, "pp": 1, "cp": 1, "dp": 128, "sequence_parallel": False,
                "activation_checkpointing": "selective", "micro_batch": 2, "global_batch": 256, "dtype": "bf16",
                "compile": False},
     "figures": {"tokens_per_s_per_gpu": 5605, "memory_gib_per_gpu": 67.0},
     "quote": "| FSDP | 5,605 | 67.0 |",
     "notes": "block_size 8192 not stated in the benchmark (llama3_8b.toml default at 9dec370). ffn_hidden "
              "from torchtitan ModelArgs (ffn_dim_multiplier=1.3, multiple_of=1024); vocab from the Llama 3 "
              "tokenizer. Memory: max reserved, max over ranks. FSDP mixed precision: bf16 params, fp32 "
              "reduce (torchtitan defaults). Selective AC option 'op' (toml default). Nearest meshtrain "
              "system: dgx-h100 (80 GB, 700 W)."},
    {"id": "torchtitan-llama3-8b-128gpu-fsdp-compile",
     "what": "Llama 3.1 8B, FSDP2 over 128 H100, local batch 2, selective AC, torch.compile",
     "source": "https://github.com/pytorch/torchtitan/blob/820504e20d1149fbf0b98c567af24c4b0433b22d/benchmarks/llama3_h100_202412_torchtitan.md, "
               "Table 3",
     "system": "h100-96gb-grand-teton", "gpus": 128, "gpus_per_node": 8,
     "model": {"kind": "llama", "n_layer": 32, "n_head": 32, "n_kv_head": 8, "n_embd": 4096,
               "ffn_hidden": 14336, "block_size": 8192, "vocab_size": 128256, "rope_theta": 500000},
     "layout": {"backend": "fsdp", "tp": 1, "pp": 1, "cp": 1, "dp": 128, "sequence_parallel": False,
                "activation_checkpointing": "selective", "micro_batch": 2, "global_batch": 256, "dtype": "bf16",
                "compile": True},
     "figures": {"tokens_per_s_per_gpu": 6514, "memory_gib_per_gpu": 62.0},
     "quote": "| FSDP + torch.compile | 6,514 | 62.0 |",
     "notes": "block_size 8192 not stated in the benchmark (llama3_8b.toml default at 9dec370). ffn_hidden "
              "from torchtitan ModelArgs (ffn_dim_multiplier=1.3, multiple_of=1024); vocab from the Llama 3 "
              "tokenizer. Memory: max reserved, max over ranks. FSDP mixed precision: bf16 params, fp32 "
              "reduce (torchtitan defaults). Selective AC option 'op' (toml default). Nearest meshtrain "
              "system: dgx-h100 (80 GB, 700 W)."},
    {"id": "torchtitan-llama3-8b-128gpu-fsdp-compile-float8",
     "what": "Llama 3.1 8B, FSDP2 over 128 H100, local batch 2, selective AC, torch.compile + Float8",
     "source": "https://github.com/pytorch/torchtitan/blob/820504e20d1149fbf0b98c567af24c4b0433b22d/benchmarks/llama3_h100_202412_torchtitan.md, "
               "Table 3",
     "system": "h100-96gb-grand-teton", "gpus": 128, "gpus_per_node": 8,
     "model": {"kind": "llama", "n_layer": 32, "n_head": 32, "n_kv_head": 8, "n_embd": 4096,
               "ffn_hidden": 14336, "block_size": 8192, "vocab_size": 128256, "rope_theta": 500000},
     "layout": {"backend": "fsdp", "tp": 1, "pp": 1, "cp": 1, "dp": 128, "sequence_parallel": False,
                "activation_checkpointing": "selective", "micro_batch": 2, "global_batch": 256,
                "dtype": "bf16+float8", "compile": True},
     "figures": {"tokens_per_s_per_gpu": 8380, "memory_gib_per_gpu": 61.8},
     "quote": "| FSDP + torch.compile + Float8 | 8,380 | 61.8 |",
     "notes": "block_size 8192 not stated in the benchmark (llama3_8b.toml default at 9dec370). ffn_hidden "
              "from torchtitan ModelArgs (ffn_dim_multiplier=1.3, multiple_of=1024); vocab from the Llama 3 "
              "tokenizer. Memory: max reserved, max over ranks. FSDP mixed precision: bf16 params, fp32 "
              "reduce (torchtitan defaults). Selective AC option 'op' (toml default). Nearest meshtrain "
              "system: dgx-h100 (80 GB, 700 W)."},
    {"id": "torchtitan-llama3-8b-8gpu-fsdp8-cp1-seq32768",
     "what": "Llama 3.1 8B, 8 H100, FSDP 8 x CP 1, sequence 32768, local batch 1, full AC, torch.compile + "
             "Float8",
     "source": "https://github.com/pytorch/torchtitan/blob/820504e20d1149fbf0b98c567af24c4b0433b22d/benchmarks/llama3_h100_202412_torchtitan.md, "
               "Table 2",
     "system": "h100-96gb-grand-teton", "gpus": 8, "gpus_per_node": 8,
     "model": {"kind": "llama", "n_layer": 32, "n_head": 32, "n_kv_head": 8, "n_embd": 4096,
               "ffn_hidden": 14336, "block_size": 32768, "vocab_size": 128256, "rope_theta": 500000},
     "layout": {"backend": "fsdp", "tp": 1, "pp": 1, "cp": 1, "dp": 8, "sequence_parallel": False,
                "activation_checkpointing": "full", "micro_batch": 1, "global_batch": 8, "dtype": "bf16+float8",
                "compile": True},
     "figures": {"tokens_per_s_per_gpu": 3890, "memory_gib_per_gpu": 83.9},
     "quote": "| FSDP 8, CP 1 | 32768 | 3,890 | 83.9 |",
     "notes": "FSDP shards over the whole dp x cp mesh in torchtitan; global batch = local batch 1 x FSDP "
              "degree (the table gives the local batch only). Memory: max reserved, max over ranks."},
    {"id": "torchtitan-llama3-8b-8gpu-fsdp4-cp2-seq65536",
     "what": "Llama 3.1 8B, 8 H100, FSDP 4 x CP 2, sequence 65536, local batch 1, full AC, torch.compile + "
             "Float8",
     "source": "https://github.com/pytorch/torchtitan/blob/820504e20d1149fbf0b98c567af24c4b0433b22d/benchmarks/llama3_h100_202412_torchtitan.md, "
               "Table 2",
     "system": "h100-96gb-grand-teton", "gpus": 8, "gpus_per_node": 8,
     "model": {"kind": "llama", "n_layer": 32, "n_head": 32, "n_kv_head": 8, "n_embd": 4096,
               "ffn_hidden": 14336, "block_size": 65536, "vocab_size": 128256, "rope_theta": 500000},
     "layout": {"backend": "fsdp", "tp": 1, "pp": 1, "cp": 2, "dp": 4, "sequence_parallel": False,
                "activation_checkpointing": "full", "micro_batch": 1, "global_batch": 4, "dtype": "bf16+float8",
                "compile": True},
     "figures": {"tokens_per_s_per_gpu": 2540, "memory_gib_per_gpu": 84.2},
     "quote": "| FSDP 4, CP 2 | 65536 | 2,540 | 84.2 |",
     "notes": "FSDP shards over the whole dp x cp mesh in torchtitan; global batch = local batch 1 x FSDP "
              "degree (the table gives the local batch only). Memory: max reserved, max over ranks."},
    {"id": "torchtitan-llama3-8b-8gpu-fsdp2-cp4-seq131072",
     "what": "Llama 3.1 8B, 8 H100, FSDP 2 x CP 4, sequence 131072, local batch 1, full AC, torch.compile + "
             "Float8",
     "source": "https://github.com/pytorch/torchtitan/blob/820504e20d1149fbf0b98c567af24c4b0433b22d/benchmarks/llama3_h100_202412_torchtitan.md, "
               "Table 2",
     "system": "h100-96gb-grand-teton", "gpus": 8, "gpus_per_node": 8,
     "model": {"kind": "llama", "n_layer": 32, "n_head": 32, "n_kv_head": 8, "n_embd": 4096,
               "ffn_hidden": 14336, "block_size": 131072, "vocab_size": 128256, "rope_theta": 500000},
     "layout": {"backend": "fsdp", "tp": 1, "pp": 1, "cp": 4, "dp": 2, "sequence_parallel": False,
                "activation_checkpointing": "full", "micro_batch": 1, "global_batch": 2, "dtype": "bf16+float8",
                "compile": True},
     "figures": {"tokens_per_s_per_gpu": 1071, "memory_gib_per_gpu": 84.0},
     "quote": "| FSDP 2, CP 4 | 131072 | 1,071 | 84.0 |",
     "notes": "FSDP shards over the whole dp x cp mesh in torchtitan; global batch = local batch 1 x FSDP "
              "degree (the table gives the local batch only). Memory: max reserved, max over ranks."},
    {"id": "torchtitan-llama3-8b-8gpu-fsdp1-cp8-seq262144",
     "what": "Llama 3.1 8B, 8 H100, FSDP 1 x CP 8, sequence 262144, local batch 1, full AC, torch.compile + "
             "Float8",
     "source": "https://github.com/pytorch/torchtitan/blob/820504e20d1149fbf0b98c567af24c4b0433b22d/benchmarks/llama3_h100_202412_torchtitan.md, "
               "Table 2",
     "system": "h100-96gb-grand-teton", "gpus": 8, "gpus_per_node": 8,
     "model": {"kind": "llama", "n_layer": 32, "n_head": 32, "n_kv_head": 8, "n_embd": 4096,
               "ffn_hidden": 14336, "block_size": 262144, "vocab_size": 128256, "rope_theta": 500000},
     "layout": {"backend": "fsdp", "tp": 1, "pp": 1, "cp": 8, "dp": 1, "sequence_parallel": False,
                "activation_checkpointing": "full", "micro_batch": 1, "global_batch": 1, "dtype": "bf16+float8",
                "compile": True},
     "figures": {"tokens_per_s_per_gpu": 548, "memory_gib_per_gpu": 84.5},
     "quote": "| FSDP 1, CP 8 | 262144 | 548 | 84.5 |",
     "notes": "FSDP shards over the whole dp x cp mesh in torchtitan; global batch = local batch 1 x FSDP "
              "degree (the table gives the local batch only). Memory: max reserved, max over ranks."},
    {"id": "torchtitan-llama3-8b-64gpu-fsdp8-tp8-vanilla",
     "what": "Llama 3.1 8B, 64 H100, FSDP 8 x TP 8, torch.compile, per-op SAC, local batch 12, bf16, vanilla",
     "source": "https://github.com/pytorch/torchtitan/blob/2887250bbd9103d0bc997ea2efb3a525b5e5dbc0/benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md, "
               "table 'Llama3 8b on 64 H100s with FSDP=8, TP=8, torch.compile, per op SAC, local batch size "
               "12'",
     "system": "h100-96gb-grand-teton", "gpus": 64, "gpus_per_node": 8,
     "model": {"kind": "llama", "n_layer": 32, "n_head": 32, "n_kv_head": 8, "n_embd": 4096,
               "ffn_hidden": 14336, "block_size": 8192, "vocab_size": 128256, "rope_theta": 500000},
     "layout": {"backend": "fsdp", "tp": 8, "pp": 1, "cp": 1, "dp": 8, "sequence_parallel": True,
                "activation_checkpointing": "selective", "micro_batch": 12, "global_batch": 96, "dtype": "bf16",
                "compile": True, "async_tp": False},
     "figures": {"tokens_per_s_per_gpu": 4378},
     "quote": "| None (bfloat16)   | 4378   | 4809.4 | 1.10 |",
     "notes": "'tokens/sec' taken as per GPU (torchtitan logs tps per device). block_size 8192 not stated "
              "(llama3_8b.toml default). torchtitan's TP shards the norms/sequence between blocks (sequence "
              "parallel) by default. global_batch = 12 x FSDP 8 (local batch is per data-parallel rank)."},
    {"id": "torchtitan-llama3-8b-64gpu-fsdp8-tp8-asynctp",
     "what": "Llama 3.1 8B, 64 H100, FSDP 8 x TP 8, torch.compile, per-op SAC, local batch 12, bf16, asynctp",
     "source": "https://github.com/pytorch/torchtitan/blob/2887250bbd9103d0bc997ea2efb3a525b5e5dbc0/benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md, "
               "table 'Llama3 8b on 64 H100s with FSDP=8, TP=8, torch.compile, per op SAC, local batch size "
               "12'",
     "system": "h100-96gb-grand-teton", "gpus": 64, "gpus_per_node": 8,
     "model": {"kind": "llama", "n_layer": 32, "n_head": 32, "n_kv_head": 8, "n_embd": 4096,
               "ffn_hidden": 14336, "block_size": 8192, "vocab_size": 128256, "rope_theta": 500000},
     "layout": {"backend": "fsdp", "tp": 8, "pp": 1, "cp": 1, "dp": 8, "sequence_parallel": True,
                "activation_checkpointing": "selective", "micro_batch": 12, "global_batch": 96, "dtype": "bf16",
                "compile": True, "async_tp": True},
     "figures": {"tokens_per_s_per_gpu": 4809.4},
     "quote": "| None (bfloat16)   | 4378   | 4809.4 | 1.10 |",
     "notes": "'tokens/sec' taken as per GPU (torchtitan logs tps per device). block_size 8192 not stated "
              "(llama3_8b.toml default). torchtitan's TP shards the norms/sequence between blocks (sequence "
              "parallel) by default. global_batch = 12 x FSDP 8 (local batch is per data-parallel rank)."},
    {"id": "torchtitan-llama3-8b-64xa100-sac-layer",
     "what": "Llama 3 8B, FSDP2 over 64 A100 80GB, local batch 1, selective (layer) activation checkpointing",
     "source": "https://github.com/pytorch/torchtitan/blob/1ea476e9f24be439eda358aa864f45c1c37a8a88/docs/performance.md "
               "(section 'Llama 3 performance numbers'; unchanged through 4d88a8a44, Dec 2024)",
     "system": "a100-80gb-cluster", "gpus": 64, "gpus_per_node": 8,
     "model": {"kind": "llama", "n_layer": 32, "n_head": 32, "n_kv_head": 8, "n_embd": 4096,
               "ffn_hidden": 14336, "block_size": 8192, "vocab_size": 128256, "rope_theta": 500000},
     "layout": {"backend": "fsdp", "tp": 1, "pp": 1, "cp": 1, "dp": 64, "sequence_parallel": False,
                "activation_checkpointing": "selective", "micro_batch": 1, "global_batch": 64, "dtype": "bf16",
                "compile": False},
     "figures": {"tokens_per_s_per_gpu": 2904, "mfu": 0.568},
     "quote": "| 8B | 1 | selective layer | 2904 | 56.8% |",
     "notes": "block_size 8192 and compile = false from train_configs/llama3_8b.toml at 1ea476e9f ('a preset "
              "for 64 A100 GPUs'); not stated in the table. MFU as torchtitan's train.py computed it then "
              "(PaLM-style FLOPs per token, against the A100's 312 TFLOP/s bf16 peak). No memory published. "
              "Nearest meshtrain system: none (perlmutter-80 has 4 per node); GPUs per node not stated (8 "
              "assumed)."},
    {"id": "torchtitan-llama3-8b-64xa100-sac-op",
     "what": "Llama 3 8B, FSDP2 over 64 A100 80GB, local batch 1, selective (op) activation checkpointing",
     "source": "https://github.com/pytorch/torchtitan/blob/1ea476e9f24be439eda358aa864f45c1c37a8a88/docs/performance.md "
               "(section 'Llama 3 performance numbers'; unchanged through 4d88a8a44, Dec 2024)",
     "system": "a100-80gb-cluster", "gpus": 64, "gpus_per_node": 8,
     "model": {"kind": "llama", "n_layer": 32, "n_head": 32, "n_kv_head": 8, "n_embd": 4096,
               "ffn_hidden": 14336, "block_size": 8192, "vocab_size": 128256, "rope_theta": 500000},
     "layout": {"backend": "fsdp", "tp": 1, "pp": 1, "cp": 1, "dp": 64, "sequence_parallel": False,
                "activation_checkpointing": "selective", "micro_batch": 1, "global_batch": 64, "dtype": "bf16",
                "compile": False},
     "figures": {"tokens_per_s_per_gpu": 2973, "mfu": 0.582},
     "quote": "| 8B | 1 | selective op | 2973 | 58.2% |",
     "notes": "block_size 8192 and compile = false from train_configs/llama3_8b.toml at 1ea476e9f ('a preset "
              "for 64 A100 GPUs'); not stated in the table. MFU as torchtitan's train.py computed it then "
              "(PaLM-style FLOPs per token, against the A100's 312 TFLOP/s bf16 peak). No memory published. "
              "Nearest meshtrain system: none (perlmutter-80 has 4 per node); GPUs per node not stated (8 "
              "assumed)."},
]
