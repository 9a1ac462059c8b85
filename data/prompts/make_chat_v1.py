"""Writes chat_v1.jsonl: chat-style training prompts of Aerie's own making, for the kinds of request
the embedded model's head accepts least on MT-bench (writing, role-play, extraction, STEM and
humanities explanations; assets/heads/smollm2-135m-instruct/README.md). Templates crossed with
topic lists, plus extraction tasks over passages of ../shared/prompts/t0_sample.jsonl (already in
mix_v1). Deterministic (seed 1234); standard library only. Decontaminated: a prompt sharing half
its content words with any MT-bench turn is dropped.

    python3 data/prompts/make_chat_v1.py   # -> data/prompts/chat_v1.jsonl
"""

import json
import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHARED = HERE.parents[2] / "shared"
COUNTS = {"writing": 2000, "roleplay": 1200, "stem": 800, "humanities": 800, "extraction": 700}

FORMS = ["a persuasive essay", "a blog post", "a short story", "a poem", "a product description", "a cover letter",
         "an email to a colleague", "a short speech", "a news article", "a restaurant review", "a film review",
         "a social media post", "a newsletter introduction", "a diary entry", "a letter to an old friend", "an op-ed",
         "a press release", "a toast for a retirement party", "a motivational message", "a how-to guide",
         "a list of tips", "a dialogue between two characters", "a fairy tale", "a limerick", "a job advertisement",
         "a complaint letter", "a thank-you note", "a book blurb", "a podcast episode outline", "a lesson summary"]
TOPICS = ["remote work", "learning a second language", "electric bicycles", "a new neighbourhood bakery",
          "the history of the bicycle", "urban gardening", "saving money on groceries", "a rainy day in the city",
          "a lost dog finding its way home", "the first day at a new school", "public libraries", "recycling at home",
          "a mountain hiking trip", "night trains across Europe", "home-made bread", "a chess tournament",
          "volunteering at an animal shelter", "the joy of reading", "a small fishing village", "smartwatches",
          "a robot who learns to paint", "the importance of sleep", "minimalism", "a community festival",
          "space tourism", "a family recipe", "board games", "the ocean at night", "a city without cars",
          "online privacy", "learning to swim as an adult", "a haunted lighthouse", "coffee culture", "a bookshop cat",
          "renewable energy in small towns", "a time traveller in the 1920s", "kindness to strangers", "honeybees",
          "a startup that failed", "moving to a new country", "street musicians", "a winter market",
          "the value of handwritten letters", "a school science fair", "video calls with grandparents",
          "a marathon for charity", "an abandoned amusement park", "a new public park", "fermented foods",
          "a lighthouse keeper's last night", "teamwork", "a lost wallet returned", "wild mushrooms", "desert stars"]
TONES = ["", " Keep it under 150 words.", " Use a humorous tone.", " Write it for teenagers.", " Use simple language.",
         " Make it formal.", " Use three short paragraphs.", " End with a question to the reader.",
         " Include a title.", " Make it upbeat and encouraging."]
VERBS = ["Write", "Compose", "Draft", "Create"]

PERSONAS = ["a medieval blacksmith", "a pirate captain", "a detective in 1940s London", "a pastry chef",
            "a tour guide in an old European city", "an astronaut on the space station", "a kindergarten teacher",
            "a personal fitness coach", "a wine expert", "a park ranger", "a travel agent", "a librarian",
            "a ship's navigator", "a museum curator", "a taxi driver in a busy city", "a beekeeper",
            "a customer support agent for a phone company", "a career counsellor", "a dragon guarding a treasure",
            "a talking cat", "a village elder", "a radio host", "a lighthouse keeper", "a chess grandmaster",
            "a gardener", "a sports commentator", "a nutritionist", "a time traveller from the year 3000",
            "a stand-up comedian", "a wise old owl", "a lawyer explaining a contract", "a mountain guide"]
TASKS = ["introduce yourself to a new visitor", "describe a typical day at work", "give advice to a beginner",
         "tell me about the hardest moment of your career", "explain what you enjoy most about your job",
         "recommend three things I should try", "tell me what mistakes newcomers make",
         "describe the most unusual request you ever had", "tell a short story from your past",
         "explain how to get started in your field", "convince me to try something new",
         "describe your favourite tool and why", "react to a customer who is unhappy", "plan my weekend for me"]
RP = ["Pretend you are {p}. {T}.", "Act as {p} and {t}.", "Imagine you are {p}. Please {t}.",
      "You are {p}. Stay in character and {t}.", "Take on the role of {p}: {t}."]

STEM = ["how vaccines train the immune system", "plate tectonics", "why the sky is blue", "how a refrigerator works",
        "the water cycle", "how batteries store energy", "what DNA mutations are", "how airplanes stay in the air",
        "the greenhouse effect", "what an algorithm is", "how the internet routes data", "black holes",
        "how compound interest works", "what a catalyst does in a chemical reaction", "how tides are caused",
        "the difference between weather and climate", "how solar panels produce electricity", "how the heart pumps blood",
        "what entropy means", "how antibiotics work", "what a prime number is", "how earthquakes are measured",
        "how GPS finds a location", "why ice floats", "how a microwave oven heats food", "what a gene is",
        "the structure of an atom", "how rainbows form", "how a compiler turns code into a program",
        "what makes a material a good conductor", "how bridges carry heavy loads", "how the eye focuses light"]
HUMANITIES = ["the causes of the First World War", "the Renaissance", "the idea of a social contract",
              "the invention of the printing press", "why the Roman Empire declined", "utilitarianism",
              "the role of myths in ancient cultures", "the Industrial Revolution", "the separation of powers",
              "the spread of writing systems", "the Silk Road", "existentialism", "the abolition of slavery",
              "the origins of democracy in Athens", "what makes a poem a sonnet", "the impact of the radio on society",
              "stoicism", "the Cold War", "the history of the Olympic Games", "the role of museums",
              "the rise of cities in the Middle Ages", "the ethics of lying", "the meaning of freedom of speech",
              "the history of money", "impressionist painting", "the Reformation", "why languages change over time",
              "the purpose of education", "the Enlightenment", "opportunity cost", "the tragedy of the commons"]
EXPLAIN = ["Explain {c} in simple terms.", "Explain {c} to a high school student.", "Explain {c} with an example.",
           "Describe {c} and why it matters.", "Give a short overview of {c}.", "Explain {c} in three key points.",
           "How would you teach {c} to a ten-year-old?", "Summarise what is known about {c}.",
           "What are common misconceptions about {c}?", "Write a short explainer on {c}."]
EXTRACT = ["List every person, place and organisation the passage names, as JSON with the keys people, places and "
           "organisations.", "Summarise the passage in three bullet points.",
           "Give the passage a title and a two-sentence summary.", "List the dates and numbers in the passage and "
           "what each refers to.", "What is the main claim of the passage, and what evidence supports it?",
           "Write three questions that the passage answers, each with its answer.",
           "Extract the key terms of the passage with a one-line definition of each.",
           "Rewrite the passage in plain language for a young reader.", "Is the tone of the passage neutral, positive "
           "or negative? Explain with quotes."]
DEPTH = ["", " Keep it short.", " Use an everyday analogy.", " Use a numbered list.", " Mention one open question.",
         " Answer in two paragraphs."]
WORD = re.compile(r"[a-z]{4,}")
TASK_WORDS = re.compile(r"\b(question|answer|options?|choose|exercise|following|generate|select)\b", re.IGNORECASE)
LEAD = re.compile(r"^(I can use this background:|Background:|- )\s*")


def words(text: str) -> set[str]:
    return set(WORD.findall(text.lower()))


def passages(rng: random.Random) -> list[str]:
    """The longest paragraph (300-1500 characters) of each T0 prompt that has one, quotes stripped,
    if it reads as a passage: several sentences, no question, none of the task's own wording."""
    found = []
    for line in (SHARED / "prompts" / "t0_sample.jsonl").read_text().split("\n"):
        if not line.strip():
            continue
        blocks = [LEAD.sub("", b.strip().strip('"').strip()) for b in json.loads(line)["prompt"].split("\n\n")]
        block = max(blocks, key=len)
        if (300 <= len(block) <= 1500 and "?" not in block and block.count(". ") >= 3
                and not TASK_WORDS.search(block)):
            found.append(block)
    rng.shuffle(found)
    return found


def candidates(kind: str, rng: random.Random, texts: list[str]):
    while True:
        if kind == "writing":
            yield f"{rng.choice(VERBS)} {rng.choice(FORMS)} about {rng.choice(TOPICS)}.{rng.choice(TONES)}"
        elif kind == "roleplay":
            t = rng.choice(TASKS)
            yield rng.choice(RP).format(p=rng.choice(PERSONAS), t=t, T=t[0].upper() + t[1:])
        elif kind in ("stem", "humanities"):
            yield rng.choice(EXPLAIN).format(c=rng.choice(STEM if kind == "stem" else HUMANITIES)) + rng.choice(DEPTH)
        else:
            yield f"{rng.choice(EXTRACT)}\n\n{texts.pop()}"


def bench_turns() -> list[str]:
    """Every turn of the MT-bench questions the prompts must not resemble."""
    return [t for line in (SHARED / "bench" / "mt_bench.jsonl").read_text().split("\n") if line.strip()
            for t in json.loads(line)["turns"]]


def shares_words(prompt: str, bench: list[set[str]]) -> bool:
    """Whether `prompt` shares half its content words with a turn (`bench`: each turn's words)."""
    w = words(prompt)
    return any(len(w & b) >= 0.5 * max(len(w), 1) for b in bench)


def draw(counts: dict[str, int], make: Callable[[str], Iterator[str]], source: str,
         rejected: Callable[[str], bool]) -> list[dict]:
    """counts[kind] distinct prompts of each kind from `make(kind)`'s candidates, none `rejected`
    (fewer where the candidates run out), as rows {"source": f"{source}:{kind}", "prompt"}."""
    seen, rows = set(), []
    for kind, count in counts.items():
        made = 0
        for prompt in make(kind):
            if prompt in seen or rejected(prompt):
                continue
            seen.add(prompt)
            rows.append({"source": f"{source}:{kind}", "prompt": prompt})
            made += 1
            if made == count:
                break
    return rows


def write_prompts(rows: list[dict], rng: random.Random, path: Path) -> None:
    rng.shuffle(rows)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} prompts -> {path}")


def main() -> None:
    rng = random.Random(1234)
    bench = [words(t) for t in bench_turns()]
    texts = passages(rng)
    rows = draw(COUNTS, lambda kind: candidates(kind, rng, texts), "aerie-chat-v1", lambda p: shares_words(p, bench))
    write_prompts(rows, rng, HERE / "chat_v1.jsonl")


if __name__ == "__main__":
    main()
