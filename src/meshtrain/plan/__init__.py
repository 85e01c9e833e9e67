"""`meshtrain plan`: a cost model of every parallel layout, ranked, explained, and checked against measured runs.

    systems.py    real machines (Polaris, Perlmutter, Aurora, Frontier, DGX H100), every figure with its source
    machines.py   the machine as the cost model reads it: a shipped system, or this one, measured
    workload.py   the model, built once on the meta device through its ModelSpec
    shares.py     what a rank holds of the model under a layout: parameters, gradients, optimizer state (exact)
    cost.py       per layout: memory by term and peak; step time as compute, exposed communication, bubble
    search.py     every layout `train` accepts on N nodes × G devices, costed and ranked; parallel.plan=auto
    calibrate.py  this machine's fixed costs per kind of layout (a tiny model) and its ranks' shared-core slowdown
    measure.py    one layout run for a few steps: bytes held, peak tensor bytes, step time (per rank)
    validate.py   predicted against measured, with the errors
    command.py    the command line
"""
