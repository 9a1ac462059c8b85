"""Where an EAGLE draft's time goes on this machine: the embedded model and its shipped head, the
compiled runner, one 64-token answer at a fixed tree with the head's step eager and (on CUDA)
again with it as CUDA graphs, each draft timed and the last few profiled (torch.profiler, CPU and
CUDA). On an H200 drafts took 72 ms at d2k10n64 where the latency
profile predicted ~5 ms; this says why. Usage: python3 .ci/device/draft_profile.py [cuda|cpu]"""

import sys
import time

sys.path.insert(0, ".")
import launch  # noqa: E402

launch.keep_compiled_code(launch.default_cache_dir())  # before torch: the bench after this reuses the compiled code

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from core.config import SamplingConfig, TreeConfig  # noqa: E402
from core.engine import Engine  # noqa: E402
from core.service.drafters import make_drafter  # noqa: E402
from core.service.spec import EngineSpec  # noqa: E402
from core.runtime.runner import RunnerConfig, TargetRunner  # noqa: E402
from models.target import LoadSpec, load_target  # noqa: E402

device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
cache = launch.default_cache_dir()
target = load_target(LoadSpec(model=None, device=device, cache_dir=cache))
head = str(launch.ROOT / "assets" / "heads" / "smollm2-135m-instruct")
drafter = make_drafter(target, EngineSpec(head=head, strategy="eagle", tree=TreeConfig(2, 10, 64), cache_dir=cache))
runner = TargetRunner(target, RunnerConfig(compile=device == "cuda"), drafter.feature_layers)
runner.warm_up(print)
engine = Engine(target, drafter, runner)
messages = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]
prompt = list(target.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
draft = drafter.draft  # the drafter's own, before answer() wraps it


def answer(label: str) -> None:
    """One 64-token answer: each draft timed synchronized, the last few profiled."""
    times, profiled = [], []

    def timed_draft(context, fresh):
        if len(times) >= 12 and len(profiled) < 4:
            with profile(activities=activities) as prof:
                proposed = draft(context, fresh)
                sync()
            profiled.append(prof)
            return proposed
        sync()
        t0 = time.perf_counter()
        proposed = draft(context, fresh)
        sync()
        times.append(1000 * (time.perf_counter() - t0))
        return proposed

    drafter.draft = timed_draft
    engine.reset()
    rounds = list(engine.generate(prompt, SamplingConfig(max_new_tokens=64)))[1:]
    print(f"== {label}")
    print("draft ms per round (synchronized):", " ".join(f"{t:.1f}" for t in times))
    print("engine's own draft_s ms:", " ".join(f"{1000 * s.draft_s:.1f}" for s in rounds))
    print("verify ms:", " ".join(f"{1000 * s.verify_s:.1f}" for s in rounds))
    print(profiled[-1].key_averages().table(sort_by="cpu_time_total", row_limit=25))
    if device == "cuda":
        print(profiled[-1].key_averages().table(sort_by="cuda_time_total", row_limit=12))


answer("eager head step")
if device == "cuda":  # what core/service/factory.py does on a GPU: the head's step as CUDA graphs
    t0 = time.perf_counter()
    drafter.warm_up(print)
    print(f"head step compiled in {time.perf_counter() - t0:.1f} s")
    answer("graphed head step")
