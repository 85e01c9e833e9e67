"""What this machine can do: the one place the rest of meshtrain asks about the hardware.

    hardware.py    what the device is (name, ISA or compute capability, memory, native bf16/fp16): no timing
    measure.py     timed figures taken robustly: matmul peak per dtype, memory bandwidth
    datasheet.py   dense peaks of known accelerators
    profile.py     the cached profile (~/.cache/meshtrain/machine.json): measured figures, MFU peaks,
                   collective bandwidth recorded by `collectives --bench --record`
    precision.py   train.dtype=auto: the dtype this device computes natively, and why
    survey.py      the whole profile of one device as one dict (what `meshtrain machine` prints)
"""

from meshtrain.machine.hardware import Hardware, describe
from meshtrain.machine.precision import Precision, choose
from meshtrain.machine.profile import Peak, measured, measured_peak, peak_flops

__all__ = ["Hardware", "Peak", "Precision", "choose", "describe", "measured", "measured_peak", "peak_flops"]
