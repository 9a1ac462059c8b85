"""What the tuner learned of a head's acceptance, kept between starts.

The first answer after a start is planned from the prior (the head's held-out chain acceptance,
core/tune/shapes.py `prior_table`), which the chats it serves may not share: the shipped head's
held-out chains promised 2.6 tokens a round for a d2k1n4 chain where MT-bench gave 1.8, so each
start's first answer ran a tree that lost to plain decoding (0.69-0.77x on the page, 2-core Zen 4)
before the rounds taught the tuner better. The counts the chats taught are kept per model,
quantization and head (acceptance is the model's and the head's, not the machine's) and start the
next session, scaled down to REMEMBERED offers per depth so that its own chats still move them.

The measured speedups of the last answers of each drafter (`Tuner.heard`: the rivals', prompt
lookup's, from turns, races and A/Bs) are kept too, per model, head and machine (the latency
profile's key: a speedup is this machine's), so that a start plans a rival an earlier race found
faster, and does not try again a prompt lookup that measured slower than plain.
"""

import hashlib
import json
from pathlib import Path

import torch

from core.files import write_whole
from core.tune.shapes import PositionalAcceptance
from core.tune.tuner import RIVAL_RUNS

VERSION = 1
REMEMBERED = 64.0   # offers per depth a start keeps of what earlier sessions saw


def acceptance_path(cache_dir: Path, key: dict) -> Path:
    return keyed_path(cache_dir / "acceptance", key)


def keyed_path(folder: Path, key: dict) -> Path:
    digest = hashlib.sha1(json.dumps({"version": VERSION, **key}, sort_keys=True).encode()).hexdigest()[:16]
    return folder / f"{digest}.json"


def recall(path: Path, prior: torch.Tensor) -> PositionalAcceptance:
    """The acceptance earlier sessions kept at `path` on top of `prior`, or the prior alone where
    there is none (a stored table of another shape or an unreadable file is said, then ignored)."""
    acceptance = PositionalAcceptance(prior)
    if not path.is_file():
        return acceptance
    try:
        data = json.loads(path.read_text())
        hits, trials = torch.tensor(data["hits"]), torch.tensor(data["trials"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        print(f"Aerie: starting the tuner from the head's prior: {path} is unreadable ({e}).", flush=True)
        return acceptance
    if hits.shape != prior.shape or trials.shape != prior.shape:
        print(f"Aerie: starting the tuner from the head's prior: {path} holds a {tuple(trials.shape)} table.", flush=True)
        return acceptance
    # Rank 0 is offered at every round that reaches a depth: the most trials of its row.
    scale = REMEMBERED / trials[:, :1].clamp(min=REMEMBERED)                  # (D, 1), <= 1
    acceptance.restore(hits * scale, trials * scale)
    return acceptance


def keep(path: Path, acceptance: PositionalAcceptance) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_whole(path, json.dumps({"hits": acceptance.hits.tolist(), "trials": acceptance.trials.tolist()}).encode())


def speeds_path(cache_dir: Path, profile_key: dict) -> Path:
    return keyed_path(cache_dir / "speeds", profile_key)


def recall_speeds(path: Path) -> dict[str, list[float]]:
    """The measured speedups earlier sessions kept at `path` (strategy -> last answers'), or none."""
    if not path.is_file():
        return {}
    try:
        heard = json.loads(path.read_text())
        return {str(name): [float(x) for x in runs][-RIVAL_RUNS:] for name, runs in heard.items()}
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError) as e:
        print(f"Aerie: the tuner starts without earlier answers' speeds: {path} is unreadable ({e}).", flush=True)
        return {}


def keep_speeds(path: Path, heard: dict[str, list[float]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_whole(path, json.dumps(heard).encode())   # Tuner.record keeps each drafter's last RIVAL_RUNS
