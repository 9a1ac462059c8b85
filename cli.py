"""launch.py's command line: the arguments of its commands (the app, bench, train, generate) and
the defaults they share. Standard library only, like the bootstrap: `--help` works before setup."""

import argparse
import os
from pathlib import Path

from core.config import DRAFT_ROWS, DRAFTERS  # torch-free
from models.quants import ATTENTIONS, LINEARS, QUANTS  # torch-free

ROOT = Path(__file__).resolve().parent


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or (Path.home() / ".cache")
    return Path(base) / "aerie"


def parse_args(argv: list[str], bench: bool = False) -> argparse.Namespace:
    description = ("Aerie's benchmark: every decoding strategy on the same prompts, greedy, in one process; "
                   "a per-category table, then one JSON line." if bench else
                   "Aerie: a fast local chat with lossless speculative decoding. Other commands: "
                   "launch.py test | bench | train | generate (each has --help).")
    p = argparse.ArgumentParser(prog="launch.py" + (" bench" if bench else ""), description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", help="Hugging Face id or local folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--quant", choices=QUANTS, help="weights: nf4 = 4-bit bitsandbytes (default on CUDA), int4/int8 = torch CPU kernels (int4 is the CPU default), none = unquantized (fp32 on a CPU, bf16 on a GPU: fp16 before Ampere)")
    p.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--head", help="EAGLE head: Hugging Face id, local folder, 'random' (an untrained head, for testing) or "
                   "'none' (no EAGLE head, not even the embedded model's)")
    p.add_argument("--allow-pickle", action="store_true", help="allow loading a head stored as pickle (pytorch_model.bin)")
    p.add_argument("--medusa", help="Medusa heads: Hugging Face id or local folder, FasterDecoding's layout or Aerie's "
                   "(default: the heads Aerie ships for the embedded model; 'none': no Medusa drafter)")
    p.add_argument("--depth", type=natural, help="EAGLE tree: expansion steps, longest draft = depth + 1 (default: the tuner's choice)")
    p.add_argument("--top-k", type=positive, help="EAGLE tree: children per expanded node (default: the tuner's choice)")
    p.add_argument("--total-tokens", type=positive, help="EAGLE tree: tokens verified per round, root included (default: the tuner's choice)")
    p.add_argument("--static-tree", action="store_true", help="EAGLE-1's fixed 26-node tree (mc_sim_7b_63) instead of the dynamic one")
    p.add_argument("--draft-rows", choices=DRAFT_ROWS, default="auto",
                   help="which rows of an EAGLE-1 head's draft vocabulary it drafts from, where the head names a narrow subset "
                        "(the shipped head: 8,192 of 16,384): narrow, wide, or auto = narrow on a CPU (every row a draft step "
                        "scores is read from memory), wide on a GPU. The answer is the same either way")
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir(), help="where converted and downloaded models live")
    p.add_argument("--vram-reserve", type=float, default=0.5, metavar="GB",
                   help="GPU memory (GiB) to leave to other programs; a model that does not fit beside it is partly offloaded to RAM")
    p.add_argument("--attention", choices=ATTENTIONS, default="auto",
                   help="a CPU int4/int8 target's attention: rows = Aerie's fp32 kernel, 3-6x cheaper, exact beside a 4-bit "
                        "kernel that computes each row alone; sdpa = torch's SDPA in fp64, exact on any kernel; auto (default) = "
                        "rows where the machine's 4-bit kernel computes each row alone (q4_rows, AMX), else sdpa")
    p.add_argument("--kernel-mix", action="store_true",
                   help="on a CPU with AMX, let trees run on Aerie's AMX 4-bit kernel from the size where it wins while one token stays "
                        "on torch's: the same weights summed in another order, so greedy text may part from plain decoding's at a "
                        "near-tie (the bench counts them: tie_divergences). Default: one kernel for every size")
    p.add_argument("--no-compile", action="store_true",
                   help="run the target's forward eagerly instead of one compiled graph per tree size (slower; no compile at first start)")
    if bench:
        p.add_argument("--prompts", type=Path, default=ROOT / "assets" / "bench" / "mt_bench.jsonl", help="MT-bench style jsonl (first turns are used; default: the 80 MT-bench questions)")
        p.add_argument("--limit", type=positive, help="number of prompts, picked round-robin across categories")
        p.add_argument("--max-new-tokens", type=positive, default=128, help="tokens generated per prompt and strategy")
        p.add_argument("--context", type=natural, default=0, help="pad each prompt with filler to about this many tokens")
        p.add_argument("--strategies", help="comma-separated subset of plain, hf_generate, hf_prompt_lookup, "
                       "prompt_lookup, lookahead, layer_skip, medusa, eagle (plain always runs; default: all but layer_skip, "
                       "whose first run measures which layers to skip, about a minute on 2 cores)")
        p.add_argument("--compare-default-tree", action="store_true",
                       help="add eagle_default_tree: EAGLE's published default (60 tokens, depth 6, top_k 10) beside the tuned eagle")
        p.add_argument("--trees", help="add fixed EAGLE shapes, e.g. '0,4,5 2,4,12' (depth,top_k,total_tokens each, and optionally a "
                            "copy round's length: '0,1,2,0' drafts with the head alone): a grid in one run")
        p.add_argument("--verify-delay-ms", type=float, default=0.0, metavar="MS",
                       help="simulate a slow (offloaded) target: every target prefill and verify waits MS more, the same for "
                       "any tree size, plain decoding's included; the tuner then plans SpecExec's big best-first trees "
                       "(transformers' generate, hf_*, is not slowed and not run unless asked)")
        p.add_argument("--serve", action="store_true",
                       help="also ask a live Aerie server (launch.py --no-browser on a free port, with these model flags) "
                       "for the same answers through its OpenAI API, and print its wall-clock tok/s beside the bench's")
        p.add_argument("--page", action="store_true",
                       help="with --serve, also type each prompt into the server's page in Chromium (headless, driven by "
                       "Playwright) and time the tuned answer from Enter until the page shows its end")
    else:
        p.add_argument("--strategy", default="auto", choices=["auto", *DRAFTERS],
                       help="auto = the tuner's choice (eagle with a head, prompt lookup without); a drafter's name pins it")
        p.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1: this machine only)")
        p.add_argument("--port", type=port_number, default=7860, help="first port to try; the next free one is used if taken")
        p.add_argument("--no-browser", action="store_true", help="do not open a browser tab")
        p.add_argument("--api-key", help="key the OpenAI-compatible API at /v1 asks for (Authorization: Bearer KEY); "
                       "required with a --host beyond this machine; default: $AERIE_API_KEY")
        p.add_argument("--chats", type=Path, metavar="FILE",
                       help="the SQLite file saved chats live in (default: Aerie's folder in the user's data folder: "
                       "~/.local/share/aerie, ~/Library/Application Support/Aerie or %%APPDATA%%\\Aerie)")
        p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                       help="a web origin (e.g. http://127.0.0.1:3000) whose pages may call Aerie without the key; repeatable")
    return p.parse_args(argv)


def parse_train_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="launch.py train", description="Aerie: train an EAGLE draft head or Medusa heads by self-distillation.")
    p.add_argument("--out", type=Path, required=True, help="folder for the head (model.safetensors + config.json), checkpoint and logs")
    p.add_argument("--model", help="Hugging Face id or local folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--quant", choices=QUANTS, help="target weights (default: nf4 on CUDA, none on CPU: at many rows fp32 oneDNN beats the int4 kernel)")
    p.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir(), help="where converted and downloaded models live")
    p.add_argument("--answers", type=Path, nargs="+", help="distill jsonl files, answer stores (launch.py generate) or folders of them (default: the model's stores under "
                   "data/answers, and for the embedded model ../shared/distill/smollm2-135m-instruct)")
    p.add_argument("--features", type=Path, help="folder of captured target features, shareable between runs (default: OUT/features)")
    p.add_argument("--kind", choices=["eagle1", "eagle3", "medusa"], default="eagle1", help="head architecture (medusa: "
                   "Medusa-1 heads on the frozen target, drafting from the EAGLE head's draft vocabulary, see --head)")
    p.add_argument("--medusa-heads", type=int, default=4, help="medusa: heads, guessing 2 .. N+1 tokens ahead")
    p.add_argument("--medusa-layers", type=int, default=1, help="medusa: ResBlocks per head")
    p.add_argument("--medusa-own-projection", action="store_true", help="medusa: each head trains its own projection "
                   "onto the draft vocabulary (Medusa-1's; 10 MB a head here) instead of sharing the model's LM head rows")
    p.add_argument("--head", help="medusa: the EAGLE-1 head whose draft vocabulary the heads project onto "
                   "(default: the model's shipped head, if any; none: the most frequent answer tokens)")
    p.add_argument("--draft-vocab", type=int, help="eagle3: keep the N most frequent answer tokens (default: the whole vocabulary); eagle1: draft from N rows of "
                   "the target's LM head, the most frequent answer tokens (default 8192; --init-from keeps its head's and adds the next most frequent)")
    p.add_argument("--ttt-steps", type=int, help="training-time test: unrolled draft steps (default: 1 for eagle1, 5 for eagle3)")
    p.add_argument("--init-from-target", type=int, nargs="?", const=-1, metavar="LAYER", help="start the head's layer from this target layer (default when given without a number: the last)")
    p.add_argument("--init-from", metavar="HEAD_DIR", help="start from a head trained earlier (same --kind): train it further on more data")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-tokens", type=int, help="use at most this many training answer tokens (default: all)")
    p.add_argument("--val-tokens", type=int, default=16_000, help="validation answer tokens, from a fixed ~2%% of the conversations")
    p.add_argument("--lr", type=float, default=7e-4, help="peak learning rate (linear warm-up, cosine decay)")
    p.add_argument("--batch-tokens", type=int, default=1536, help="padded tokens per optimizer step")
    p.add_argument("--noise", type=float, default=0.1, help="regularisation: the first draft step's target features get "
                   "uniform noise U(-a, a), a = NOISE * the features' RMS (EAGLE's U(-0.1, 0.1)); 0 = none")
    p.add_argument("--weight-decay", type=float, default=0.0, help="regularisation: AdamW's decoupled weight decay")
    p.add_argument("--linear", choices=["auto", *LINEARS], default="auto", help="the feature capture's CPU matmuls (as "
                   "generate's --linear): auto = whichever times fastest here")
    p.add_argument("--objective", choices=["ce", "lk", "lk-greedy"], default="ce", help="token loss: cross-entropy to the "
                   "target's distribution (EAGLE's), LK's -log acceptance at temperature 1, or at temperature 0 "
                   "(-log q of the target's argmax)")
    p.add_argument("--replay", type=float, default=0.0, help="extra loss weight of positions the head's own greedy chain "
                   "reaches and gets wrong (the errors a verify exposes); 0 = none")
    p.add_argument("--fc-norm", action="store_true", help="eagle1: an RMSNorm on each of fc's inputs (EAGLE-3.1's "
                   "fc_norm; the head then loads in Aerie, not in vLLM's EAGLE-1 loader)")
    p.add_argument("--amp", choices=["fp32", "bf16"], default="fp32", help="the head's training matmuls on a CPU: fp32, "
                   "or bf16 autocast with fp32 master weights (faster where the CPU has AMX or AVX512-BF16)")
    p.add_argument("--flattest", type=float, metavar="SHARE", help="train on this share of the conversations, those "
                   "whose answers the target is least sure of (highest mean entropy); default: all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=200, help="steps between checkpoints")
    p.add_argument("--eval-every", type=int, default=0, help="steps between validations and head snapshots (default: at epoch ends)")
    p.add_argument("--threads", type=int, help="CPU threads (default: torch's, one per core); 1 is faster while another job holds a core")
    p.add_argument("--time-limit", type=float, metavar="MIN", help="stop with a checkpoint after this many minutes; --resume goes on")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt exactly where it stopped")
    return p.parse_args(argv)


def natural(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number")
    return value


def port_number(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (1-65535)")
    return value


def default_head(model: str | None) -> str | None:
    """The head Aerie ships for the embedded model, when it is the one asked for."""
    shipped = ROOT / "assets" / "heads" / "smollm2-135m-instruct"
    return str(shipped) if model is None and (shipped / "config.json").is_file() else None


def default_medusa(model: str | None) -> str | None:
    """The Medusa heads Aerie ships for the embedded model, when it is the one asked for."""
    shipped = ROOT / "assets" / "heads" / "smollm2-135m-instruct-medusa"
    return str(shipped) if model is None and (shipped / "config.json").is_file() else None


def parse_generate_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="launch.py generate", description="Aerie: the target's greedy answers to training "
                                "prompts, continuously batched, kept as token ids in an answer store (rerun to resume).")
    p.add_argument("--out", type=Path, help="answer store folder; prompts already in it are skipped (default: "
                   "data/answers/MODEL-WEIGHTS-KERNELS, committed, at most 40 MB under data/)")
    p.add_argument("--model", help="Hugging Face id or local folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--quant", choices=QUANTS, help="target weights (default: nf4 on CUDA, none on CPU: at many rows fp32 oneDNN beats the int4 kernel)")
    p.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir(), help="where converted and downloaded models live")
    p.add_argument("--prompts", type=Path, default=ROOT.parent / "shared" / "prompts" / "mix_v1.jsonl",
                   help="jsonl with a 'prompt' field, shuffled with random.Random(1234) as ../shared/distill did")
    p.add_argument("--start", type=int, help="first shuffled prompt (default 9287: ../shared/distill answered mix_v1's "
                   "shuffled prompts 0-840 and 6000-9286; 841-5999 are unused too)")
    p.add_argument("--limit", type=int, help="shuffled prompts to take from --start (default: all the rest; 110 with --compare-hf)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--prompt-cap", type=int, default=256, help="skip prompts longer than this once chat-templated")
    p.add_argument("--batch", type=int, help="rows decoding together (default: what fits a quarter of free RAM, at most "
                   "64 on CPU; half of free VRAM, at most 256, on CUDA)")
    p.add_argument("--threads", type=int, help="CPU threads (default: torch's, one per core); 1 while another job holds a core")
    p.add_argument("--linear", choices=["auto", *LINEARS], default="auto",
                   help="CPU matmuls: oneDNN fp32, bf16x3 (oneDNN bf16 on the weights' exact three-term split, "
                   "inputs rounded to bf16 as the served int4 kernel does; AMX or AVX512-BF16), bf16 (the weights "
                   "rounded to bf16 too), torch's default (MKL), or auto = whichever a quick timing finds fastest")
    p.add_argument("--features", type=Path, metavar="DIR", help="also keep each answer's target features and teacher "
                   "logits here, for `launch.py train --features DIR` (saves train its own pass over the answers)")
    p.add_argument("--kinds", choices=["eagle1", "eagle3"], nargs="+", default=["eagle1"],
                   help="with --features: the head kinds whose features to keep (both: ~4x the disk of eagle1 alone)")
    p.add_argument("--compare-hf", type=int, nargs="?", const=48, metavar="BATCH",
                   help="benchmark instead: the same prompts through transformers generate (batch 48 unless given), "
                   "then through Aerie's generator; print both tokens/s and the ratio, write nothing")
    args = p.parse_args(argv)
    if args.out is not None and args.out.suffix in (".jsonl", ".gz"):
        p.error("--out is a folder (an answer store), not a file")
    return args
