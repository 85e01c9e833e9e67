"""The planner's measured side: what runs on this machine to feed and check the cost model (plan/), which in turn
never imports it. It depends on the cost model and on train/ (a layout is measured through the Trainer's own step).

    this_machine.py  this machine as the cost model reads it: matmul and attention rates, bandwidth, fixed costs and
                     recorded collectives, measured and cached (machine/profile.py)
    fixed_costs.py   what calibrate.py measured, read back from the profile
    calibrate.py     the fixed costs of each kind of layout (a tiny model at two depths) and the slowdown of ranks
                     sharing cores
    measure.py       one layout run for a few steps: bytes held, peak tensor bytes, step time (per rank)
    validate.py      predicted against measured, with the errors
    auto.py          parallel.plan=auto: the layout `train` runs, chosen by rank 0 before the Trainer is built
"""
