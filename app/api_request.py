"""An OpenAI chat-completions request body, checked and turned into what the chat service takes.

Every field Aerie cannot honour is refused with a 400 that names it, rather than ignored: a client
that asks for two choices, tools or log-probabilities must not get an answer without them.

Aerie's one extension is an "aerie" object. `"aerie": {"strategy": "plain"}` decodes this answer
with that drafter (plain, prompt_lookup or eagle) instead of the tuner's choice, as the page's A/B
run does: the tuner does not count it as a turn. `launch.py bench --serve` times each strategy so.
"""

import math
from dataclasses import dataclass
from typing import Any

from core.config import DRAFTERS, SamplingConfig

MAX_STOPS = 4              # as OpenAI
ROLES = ("system", "developer", "user", "assistant")
SEED_LIMIT = 2**63         # the engine's generator takes a signed 64-bit seed
# Fields with a value that changes the answer in ways Aerie does not implement; the value shown is
# the one that asks for nothing, so a client sending the defaults explicitly still works.
NEUTRAL = {"n": 1, "logprobs": False, "top_logprobs": None, "tools": None, "tool_choice": None,
           "functions": None, "function_call": None, "frequency_penalty": 0, "presence_penalty": 0,
           "logit_bias": None}
STRATEGIES = DRAFTERS  # the drafters a request may ask for by name


class ApiError(Exception):
    """A request Aerie answers with an error in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class CompletionRequest:
    messages: tuple[dict, ...]   # user and assistant turns as {"role", "content": str}
    system_prompt: str           # the system (and developer) messages, joined
    sampling: SamplingConfig
    stop: tuple[str, ...]
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the token counts
    strategy: str | None = None  # aerie.strategy: this answer's drafter; None = the tuner's choice


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param)


def unicode_text(text: str, where: str) -> str:
    """`text` if it is valid Unicode. JSON's \\u escapes can spell half of a surrogate pair
    ("\\udc80"), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad(where, f"{where} holds a lone surrogate ({text[exc.start]!r} at character {exc.start}); "
                         "send valid Unicode text.") from None
    return text


def message_text(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (other parts are refused)."""
    if isinstance(content, str):
        return unicode_text(content, where)
    if content is None:
        return ""
    if not isinstance(content, list):
        raise bad(where, f"{where} must be a string or a list of text parts.")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad(where, f"{where} has a {kind!r} part; Aerie reads only text parts.")
        texts.append(unicode_text(part["text"], where))
    return "".join(texts)


def parse_messages(body: dict) -> tuple[tuple[dict, ...], str]:
    """(user and assistant turns, system prompt). System and developer messages may come anywhere;
    together they become the system prompt."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "'messages' must be a non-empty list.")
    turns, system = [], []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(where, f"{where} must be an object with 'role' and 'content'.")
        role = message.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}.")
        text = message_text(message.get("content"), f"{where}.content")
        if role in ("system", "developer"):
            system.append(text)
        else:
            turns.append({"role": role, "content": text})
    if not any(t["role"] == "user" for t in turns):
        raise bad("messages", "'messages' needs at least one user message.")
    return tuple(turns), "\n\n".join(system)


def readable(value: float) -> str:
    """A bound as people write it: 1,000,000 and 9,223,372,036,854,775,807, not 1e+06."""
    return f"{int(value):,}" if value == int(value) else f"{value:,}"


def number(body: dict, name: str, low: float, high: float, whole: bool = False) -> float | int | None:
    """body[name] checked to lie in [low, high]; None when absent or null."""
    value = body.get(name)
    if value is None:
        return None
    kind = "a whole number" if whole else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (whole and value != int(value)):
        raise bad(name, f"'{name}' must be {kind}, got {value!r}.")
    if not low <= value <= high:
        raise bad(name, f"'{name}' must be from {readable(low)} to {readable(high)}, got {value!r}.")
    return int(value) if whole else float(value)


def parse_sampling(body: dict, defaults: SamplingConfig) -> SamplingConfig:
    temperature = number(body, "temperature", 0, 2)
    top_p = number(body, "top_p", 0, 1)
    if top_p == 0:
        raise bad("top_p", "'top_p' must be above 0.")
    top_k = number(body, "top_k", 0, 1_000_000, whole=True)  # not OpenAI's, but llama.cpp and vLLM take it
    # max_completion_tokens replaced max_tokens in OpenAI's API; either is read, the newer first.
    max_new = number(body, "max_completion_tokens", 1, 1_000_000, whole=True)
    max_new = max_new if max_new is not None else number(body, "max_tokens", 1, 1_000_000, whole=True)
    seed = number(body, "seed", 0, SEED_LIMIT - 1, whole=True)
    given = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "max_new_tokens": max_new, "seed": seed}
    fields = {"temperature": defaults.temperature, "top_p": defaults.top_p, "top_k": defaults.top_k,
              "max_new_tokens": defaults.max_new_tokens, "seed": defaults.seed}
    fields.update({k: v for k, v in given.items() if v is not None})
    return SamplingConfig(**fields)


def parse_stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOPS:
        raise bad("stop", f"'stop' must be a string or a list of at most {MAX_STOPS} strings.")
    return tuple(dict.fromkeys(unicode_text(s, "stop") for s in stops if s))


def parse_extension(body: dict) -> str | None:
    """The "aerie" object's strategy; None when it is absent (the tuner chooses)."""
    extension = body.get("aerie")
    if extension is None:
        return None
    if not isinstance(extension, dict):
        raise bad("aerie", "'aerie' must be an object, like {\"strategy\": \"plain\"}.")
    unknown = sorted(set(extension) - {"strategy"})
    if unknown:
        raise bad(f"aerie.{unknown[0]}", f"'aerie.{unknown[0]}' is not an Aerie option; it takes only 'strategy'.")
    strategy = extension.get("strategy")
    if strategy is not None and strategy not in STRATEGIES:
        raise bad("aerie.strategy", f"'aerie.strategy' must be one of {', '.join(STRATEGIES)}, got {strategy!r}.")
    return strategy


def refuse_unsupported(body: dict) -> None:
    for name, neutral in NEUTRAL.items():
        value = body.get(name)
        if value not in (None, neutral, [], {}, "none"):
            raise bad(name, f"'{name}' = {value!r} is not supported by Aerie.")
    response_format = body.get("response_format")
    if response_format is not None and (not isinstance(response_format, dict) or response_format.get("type") != "text"):
        raise bad("response_format", "Only response_format {'type': 'text'} is supported by Aerie.")


def parse_request(body: Any, defaults: SamplingConfig) -> CompletionRequest:
    """The checked request; raises ApiError (400) naming the first field that is wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    refuse_unsupported(body)
    turns, system = parse_messages(body)
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad("stream", f"'stream' must be true or false, got {stream!r}.")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("stream_options", "'stream_options' must be an object.")
    return CompletionRequest(messages=turns, system_prompt=system, sampling=parse_sampling(body, defaults),
                             stop=parse_stop(body), stream=bool(stream), include_usage=bool(options.get("include_usage")),
                             strategy=parse_extension(body))
