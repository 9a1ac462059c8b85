"""Names of the target weight formats and of a CPU target's attention kernels. No torch here:
launch.py's --help and app/ read them too.

nf4 = 4-bit bitsandbytes (CUDA's default); int4 / int8 = torch's CPU weight-only kernels (int4 is
the CPU's default, see models/cpu_quant.py); none = the compute dtype (fp32 on CPU).
"""

QUANTS = ("nf4", "int4", "int8", "none")
CPU_QUANTS = ("int4", "int8")
# --linear of generate and train: the matmuls of an unquantized CPU model (core/runtime/cpu_linear.py)
LINEARS = ("default", "onednn", "bf16x3", "bf16")
# A CPU_QUANTS target's attention (core/runtime/runner.py): torch's SDPA in fp64 (exact), the fp32
# row kernel (models/attention.py; exact where the linears compute each row alone too), or "auto"
# (the default): rows where the chosen 4-bit kernel computes each row alone, else fp64 SDPA.
ATTENTIONS = ("auto", "sdpa", "rows")
