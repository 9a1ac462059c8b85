"""launch.py's commands in this interpreter (the device machine's own torch), skipping the .venv
bootstrap, which would need a package registry. Usage: python3 .ci/device/aerie.py bench|generate|train|nvml ARGS"""
import sys

sys.path.insert(0, ".")
import launch  # noqa: E402

cmd, rest = sys.argv[1], sys.argv[2:]
if cmd == "bench":
    args = launch.parse_args(rest, bench=True)
    launch.keep_compiled_code(args.cache_dir)
    launch.run_bench(args)
elif cmd == "generate":
    launch.run_generate(launch.parse_generate_args(rest))
elif cmd == "train":
    launch.run_train(launch.parse_train_args(rest))
elif cmd == "nvml":
    from core.probe import Probe, load_nvml

    reading = Probe(load_nvml()).read()
    for g in reading.gpus:
        print(f"NVML: GPU {g.index} {g.name}: total {g.total / 2**30:.1f} GiB, used {g.used / 2**30:.1f}, free {g.free / 2**30:.1f}")
    print("NVML note:", reading.gpu_note)
else:
    sys.exit(f"unknown command {cmd}: bench, generate, train or nvml")
