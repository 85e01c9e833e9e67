"""`meshtrain report`: one or more runs as one self-contained HTML page (plots embedded) and the same plots as PNGs.

    runs.py      what a run directory holds, read back: config, metrics rows, samples, images, checkpoints, facts
    plots.py     the figures (matplotlib, Agg): loss, learning rate, gradient norm, throughput and MFU, the
                 step-time breakdown, memory per rank, the ranks' spread of step time
    page.py      the page: header tables, the figures, the workload's own evaluation, a comparison of runs

The command line is commands/report.py.
"""
