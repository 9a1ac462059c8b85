"""Names of the target weight formats. No torch here: launch.py's --help and app/ read them too.

nf4 = 4-bit bitsandbytes (CUDA's default); int4 / int8 = torch's CPU weight-only kernels (int4 is
the CPU's default, see models/cpu_quant.py); none = the compute dtype (fp32 on CPU).
"""

QUANTS = ("nf4", "int4", "int8", "none")
CPU_QUANTS = ("int4", "int8")
