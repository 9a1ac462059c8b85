"""Writes chat_v2.jsonl: more prompts of Aerie's own making for the MT-bench categories the head
still accepts least after chat_v1 (tokens a round at d3k4n16: extraction 1.81, humanities 2.21;
assets/heads/smollm2-135m-instruct/README.md), of the kinds MT-bench asks for: structured extraction
(JSON, tables, ratings, labels) over passages, and humanities and STEM questions in two parts. The passages are first the embedded model's own chat_v1 answers (data/answers/...-chat_v1)
that ended by themselves, without a loop, 300-1,500 characters long (text in the register of its
answers, which T0's are not), then chat_v1's T0 passages with new tasks. Deterministic (seed 2345, the chat_v1 store as committed,
the tokenizer decoding without clean-up). Decontaminated more strictly than chat_v1: a prompt is
dropped if it shares half its content words or any four words in a row with an MT-bench turn, and
no topic or template is taken from MT-bench's questions.

    .venv/bin/python data/prompts/make_chat_v2.py   # -> data/prompts/chat_v2.jsonl (needs the tokenizer)
"""

import random
import re
import sys
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))   # the repo root: core/ and models/

from cli import default_cache_dir  # noqa: E402
from core.train.answers import read_answers, read_manifest  # noqa: E402
from data.prompts.make_chat_v1 import (HUMANITIES, STEM, bench_turns, draw, shares_words, words,  # noqa: E402
                                      write_prompts)
from data.prompts.make_chat_v1 import passages as t0_passages  # noqa: E402

COUNTS = {"extraction": 1500, "humanities": 1400, "stem": 500}
STORE = HERE.parent / "answers" / "smollm2-135m-instruct-none-bf16-chat_v1"
STORE_ANSWERS = 5323   # the chat_v1 store as committed: another count would draw other passages

EXTRACT = [
    "Extract every person, place, date and number mentioned in the text below. Return a JSON object with the keys "
    "people, places, dates and numbers, each a list (empty if none).",
    "Read the text below and fill in this template, one line each:\nTitle:\nMain topic:\nTone:\nIntended audience:",
    "Rate the text below from 1 to 5 for clarity and from 1 to 5 for persuasiveness, with one sentence of "
    "justification for each score. Answer in JSON with the keys clarity, persuasiveness and reasons.",
    "Quote the three most important sentences of the text below, and say in a few words why each matters.",
    "Turn the main facts of the text below into a Markdown table with two columns: fact and detail.",
    "Classify the text below as one of: advertisement, story, news, letter, review, guide, explanation, speech. "
    "Give the label on the first line, then one sentence of reasoning.",
    "List the main points of the text below as a numbered list of at most five items.",
    "Answer in JSON with the keys topic, sentiment (positive, neutral or negative) and keywords (a list of five "
    "words) for the text below.",
    "Summarise the text below in at most 50 words, in a formal register.",
    "Write three questions a reader could answer from the text below, each followed by its answer.",
    "Identify any claims in the text below that would need a source, and say what kind of source would support each.",
    "Extract every action the text below recommends or describes, as a bulleted list of short imperative phrases.",
    "Give the text below a headline of at most ten words and a one-sentence lead, as a news editor would.",
    "Find the words in the text below that express feelings or opinions, and list them with the sentence they "
    "come from.",
]
EXTRACT_TEXT = ["\n\n{t}", "\n\nText:\n{t}", "\n\n\"\"\"\n{t}\n\"\"\"", "\n\n---\n{t}\n---"]

MORE_HUMANITIES = [
    "the minimum wage", "globalisation",
    "the Great Depression", "the French Revolution", "Confucianism", "the Magna Carta", "Kant's categorical imperative",
    "social media and democracy", "urbanisation", "the welfare state", "the scientific revolution",
    "colonialism and its legacy", "the role of a free press", "supply and demand", "the gig economy",
    "cultural heritage and tourism", "the ethics of artificial intelligence", "the history of public health",
    "the role of art in protest movements", "nationalism in the nineteenth century", "the ancient Egyptian state",
    "trade unions", "behavioural economics", "the rule of law", "human rights after 1945", "the Meiji Restoration",
]
ANALYSE = [
    "What is {c}, and why does it still matter today?",
    "Write about {c}: the key facts first, then what people have disagreed about.",
    "Compare {c} with {d}, with one concrete example of each.",
    "Describe {c}. Then explain how views of it have changed over time.",
    "What can a student learn from {c}? Answer in a short essay with an introduction and a conclusion.",
    "Give the strongest arguments for and against a common opinion about {c}.",
    "Plan a one-hour workshop about {c} for adult learners: its goals, activities and a closing exercise.",
    "Imagine you are a museum guide. Explain {c} to visitors in a few short paragraphs.",
    "Write a short essay on {c}, then suggest two questions for further reading.",
    "Outline the key ideas behind {c}, and give an example of each from everyday life.",
]
STEM_ASK = [
    "Describe {c} step by step, and name one everyday situation where it matters.",
    "Explain {c}. Then describe an experiment a student could do to observe it.",
    "Name a common mistake people make when they explain {c}, and correct it.",
    "Explain {c} to a curious adult, using one equation or number if it helps.",
    "Explain {c}, then {d}, and say whether the two are connected.",
    "A student asks about {c}. Give a clear answer and a follow-up question to check their understanding.",
]


def looped(ids: list[int], n: int = 8) -> bool:
    """Whether some n-gram of token ids repeats: the greedy 135M model's loops do."""
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return len(set(grams)) < len(grams)


def passages() -> list[str]:
    """chat_v1's answers that ended by themselves without a loop, 300-1,500 characters, decoded
    (popped first), then chat_v1's T0 passages, for other tasks than chat_v1 set on them."""
    from transformers import AutoTokenizer

    from models.embedded import embedded_model_dir
    manifest = read_manifest(STORE)
    if sum(s["answers"] for s in manifest["shards"]) != STORE_ANSWERS:
        raise SystemExit(f"{STORE} no longer holds the {STORE_ANSWERS} answers chat_v2 was drawn from")
    cap = manifest["source"]["target"]["max_new_tokens"]   # an answer this long was cut, not ended
    tok = AutoTokenizer.from_pretrained(embedded_model_dir(default_cache_dir()))
    found = []
    for _, row in read_answers(STORE):
        ids = row["answer_ids"]
        if len(ids) >= cap or looped(ids):
            continue
        text = tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False).strip()
        if 300 <= len(text) <= 1500:
            found.append(text)
    random.Random(3456).shuffle(found)
    return t0_passages(random.Random(1234)) + found


def grams(text: str, n: int = 4) -> set[tuple[str, ...]]:
    """The text's runs of n words, lower-cased."""
    w = re.findall(r"[a-z0-9']+", text.lower())
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def candidates(kind: str, rng: random.Random, texts: list[str]) -> Iterator[str]:
    topics = HUMANITIES + MORE_HUMANITIES if kind == "humanities" else STEM
    while True:
        if kind == "extraction":
            if not texts:
                return   # one prompt per passage: fewer than COUNTS's when the 4-word filter drops some
            yield rng.choice(EXTRACT) + rng.choice(EXTRACT_TEXT).format(t=texts.pop())
        else:
            c, d = rng.sample(topics, 2)
            yield rng.choice(ANALYSE if kind == "humanities" else STEM_ASK).format(c=c, d=d)


def main() -> None:
    rng = random.Random(2345)
    turns = bench_turns()
    bench, bench_grams = [words(t) for t in turns], set().union(*map(grams, turns))
    texts = passages()
    print(f"{len(texts)} passages from {STORE.name}")
    rows = draw(COUNTS, lambda kind: candidates(kind, rng, texts), "aerie-chat-v2",
                lambda p: bool(grams(p) & bench_grams) or shares_words(p, bench))
    write_prompts(rows, rng, HERE / "chat_v2.jsonl")


if __name__ == "__main__":
    main()
