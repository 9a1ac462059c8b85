"""launch.py's commands in this interpreter (the device machine's own torch), skipping the .venv
bootstrap, which would need a package registry. Usage: python3 .ci/device/aerie.py nvml | COMMAND ARGS (as launch.py's)"""
import sys

sys.path.insert(0, ".")
import launch  # noqa: E402

if sys.argv[1:2] == ["nvml"]:
    from core.tune.probe import Probe, load_nvml

    reading = Probe(load_nvml()).read()
    for g in reading.gpus:
        print(f"NVML: GPU {g.index} {g.name}: total {g.total / 2**30:.1f} GiB, used {g.used / 2**30:.1f}, free {g.free / 2**30:.1f}")
    print("NVML note:", reading.gpu_note)
else:
    launch.run_command(sys.argv[1:])
