"""`meshtrain plan`'s cost model: every parallel layout of a run, costed and ranked from a config, a model's facts
and a machine description alone (no process, no torch.distributed, no Trainer). What measures this machine, and
checks the model against runs, is the measured side (plan/measured/); the command is commands/plan.py.

    systems.py    real machines (Polaris, Perlmutter, Aurora, Frontier, DGX H100), every figure with its source
    machines.py   the machine as the cost model reads it (from a shipped system; measured/this_machine.py: this one)
    workload.py   the model, built once on the meta device through its ModelSpec
    shares.py     what a rank holds of the model under a layout: parameters, gradients, optimizer state (exact)
    cost.py       per layout: memory by term and peak; step time as compute, exposed communication, bubble
    search.py     every layout `train` accepts on N nodes × G devices, costed and ranked
"""
