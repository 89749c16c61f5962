"""How regeneration talks to a serving engine: addresses, the server's kind and prompt form,
the completion request and the checks on its reply.

`data.regenerate_served` sends training prompts to OpenAI-compatible servers (vLLM, SGLang) and
llama.cpp's ``llama-server``; this module is the one place that knows their wire formats:
token-id prompts with ``return_token_ids`` (``/v1/completions``) or ``return_tokens``
(``/completion``), the one-token probe that finds a server refusing token-id prompts, and the
parsing that turns a reply into the answer's token ids (or says why it cannot: `GarbageReply`).
The HTTP calls themselves are `lightning_spec.http_json`.
"""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import PurePosixPath
from typing import Any

from lightning_spec.data.regenerate import GenerationSettings
from lightning_spec.http_json import RequestFailed, get_json, post_json

__all__ = [
    "GarbageReply",
    "Reply",
    "Server",
    "ServerUnavailable",
    "answer_tokens",
    "check_servers",
    "completion_request",
    "describe_server",
    "end_of_turn_id",
    "parse_reply",
    "parse_server_urls",
    "probe_prompt_form",
]

log = logging.getLogger(__name__)

Message = dict[str, str]

RETRYABLE_CLIENT_CODES = (408, 429)
"""4xx answers that say "not now" (request timeout, too many requests), not "never"."""
PROBE_TOKENS = 8
"""Prompt tokens of the one-token probe that finds whether a server takes token-id prompts."""


class ServerUnavailable(RuntimeError):
    """A server that cannot be used: it does not answer, or not as a completion server does."""


class GarbageReply(ValueError):
    """An answer that is JSON but not a completion (missing or malformed fields)."""


# --------------------------------------------------------------------------------------------
# Servers: addresses, kinds, the probe
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Server:
    """One server as this client talks to it."""

    url: str
    api: str
    """``openai`` (``/v1/completions``: vLLM, SGLang, ...) or ``llamacpp`` (``/completion``)."""
    model: str
    """The served model's name (sent as ``model`` to an OpenAI-style server)."""
    prompt_as_text: bool = False
    """The server refused token-id prompts: prompts go as their text."""


def parse_server_urls(spec: str | Sequence[str] | None) -> list[str]:
    """The server addresses of ``URL[,URL...]`` (or a list of them), each checked for its form
    (``http(s)://HOST[:PORT][/PATH]``) and without a trailing ``/`` or ``/v1`` (the OpenAI
    clients' base-URL habit), so a mistyped address fails here, before any work."""
    if spec is None:
        return []
    parts = (
        spec.split(",") if isinstance(spec, str) else [p for s in spec for p in str(s).split(",")]
    )
    urls: list[str] = []
    for part in parts:
        text = part.strip().rstrip("/")
        if not text:
            continue
        parsed = urllib.parse.urlsplit(text)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(
                f"{text!r} is not a server URL: write http://HOST:PORT (e.g. http://127.0.0.1:8000)"
            )
        try:
            parsed.port  # noqa: B018 - raises ValueError for a port that is not a number
        except ValueError:
            raise ValueError(f"{text!r}: the port is not a number (http://HOST:PORT)") from None
        if parsed.query or parsed.fragment:
            raise ValueError(f"{text!r}: a server URL has no query or fragment")
        if text.endswith("/v1"):
            text = text[: -len("/v1")]
        if text in urls:
            raise ValueError(f"{text} is named twice (raise the concurrency instead)")
        urls.append(text)
    return urls


def describe_server(url: str, *, timeout: float = 10.0) -> Server:
    """The kind of server at `url` and the model it serves, from GET requests only (llama.cpp's
    ``/props``, else ``/v1/models``); `ServerUnavailable` with the reason when neither answers."""
    try:
        props = get_json(url + "/props", timeout=timeout)
    except RequestFailed:
        props = None  # not llama.cpp (or not up: /v1/models says which)
    if isinstance(props, dict) and (
        "default_generation_settings" in props or "build_info" in props
    ):
        alias = props.get("model_alias") or PurePosixPath(str(props.get("model_path") or "")).name
        return Server(url, "llamacpp", str(alias or "llama-server"))
    try:
        models = get_json(url + "/v1/models", timeout=timeout)
    except RequestFailed as failure:
        raise ServerUnavailable(
            f"{url} does not answer as an OpenAI-compatible server (GET /v1/models: {failure}); "
            "is it running and reachable from here? (vllm serve, llama-server, "
            "lightning-spec serve --engine vllm)"
        ) from None
    try:
        model = str(models["data"][0]["id"])
    except (KeyError, IndexError, TypeError):
        raise ServerUnavailable(
            f"{url}/v1/models names no model (answered {str(models)[:200]})"
        ) from None
    return Server(url, "openai", model)


def check_servers(spec: str | Sequence[str], *, timeout: float = 10.0) -> list[Server]:
    """Every server of `spec` described (`describe_server`), or one `ServerUnavailable` naming
    each that is not usable: what a run checks before it does any work."""
    urls = parse_server_urls(spec)
    if not urls:
        raise ValueError("no server URL given (http://HOST:PORT[,http://HOST:PORT...])")
    servers, problems = [], []
    for url in urls:
        try:
            servers.append(describe_server(url, timeout=timeout))
        except ServerUnavailable as error:
            problems.append(str(error))
    if problems:
        raise ServerUnavailable("; ".join(problems))
    return servers


def completion_request(
    server: Server,
    prompt_ids: Sequence[int],
    prompt_text: str | None,
    *,
    settings: GenerationSettings,
    max_new_tokens: int,
    seed: int,
) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of one completion of `prompt_ids` (their text for a server that takes
    no ids) under `settings`. llama.cpp's samplers that `settings` does not name are switched
    off (its defaults filter with min_p and penalise repeats)."""
    prompt: Any = prompt_text if server.prompt_as_text else [int(t) for t in prompt_ids]
    if server.api == "llamacpp":
        body: dict[str, Any] = {
            "prompt": prompt, "n_predict": int(max_new_tokens), "return_tokens": True,
            "stream": False, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0,
        }  # fmt: skip
        if settings.greedy:
            body.update(temperature=0.0, top_k=1)
        else:
            body.update(temperature=settings.temperature, top_p=settings.top_p,
                        top_k=settings.top_k, seed=seed)  # fmt: skip
        return "/completion", body
    body = {
        "model": server.model, "prompt": prompt, "max_tokens": int(max_new_tokens),
        "temperature": 0.0 if settings.greedy else settings.temperature, "return_token_ids": True,
    }  # fmt: skip
    if not settings.greedy:
        body.update(top_p=settings.top_p, seed=seed)
        if settings.top_k > 0:
            body["top_k"] = settings.top_k
    return "/v1/completions", body


@dataclass(frozen=True)
class Reply:
    """What a completion answer says, whichever kind of server gave it."""

    tokens: list[int] | None
    """The answer's token ids; None when the server gave text only."""
    text: str | None
    stopped: bool
    """True: the model ended its turn (EOS, a stop); False: the length limit cut it."""


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    )


def parse_reply(api: str, reply: Any) -> Reply:
    """The `Reply` in a server's JSON answer; `GarbageReply` when it is not a completion."""
    if not isinstance(reply, dict):
        raise GarbageReply(f"a JSON {type(reply).__name__}, not an object")
    if api == "llamacpp":
        tokens, text = reply.get("tokens"), reply.get("content")
        stop_type = reply.get("stop_type")
        if stop_type in ("eos", "word"):
            stopped = True
        elif stop_type == "limit":
            stopped = False
        elif reply.get("stopped_eos") or reply.get("stopped_word"):  # before stop_type existed
            stopped = True
        elif reply.get("stopped_limit") or reply.get("truncated"):
            stopped = False
        else:
            raise GarbageReply(f"no stop_type (keys: {', '.join(sorted(reply)[:12])})")
    else:
        choices = reply.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise GarbageReply(f"no choices (keys: {', '.join(sorted(reply)[:12])})")
        choice = choices[0]
        tokens, text = choice.get("token_ids"), choice.get("text")
        finish = choice.get("finish_reason")
        if finish not in ("stop", "length"):
            raise GarbageReply(f"finish_reason {finish!r}")
        stopped = finish == "stop"
    if tokens is not None and not _is_token_list(tokens):
        raise GarbageReply("token ids that are not a list of non-negative integers")
    if text is not None and not isinstance(text, str):
        raise GarbageReply("a text that is not a string")
    if tokens is not None and not tokens and text:
        tokens = None  # an empty id list beside a text: the server did not return ids
    if tokens is None and text is None:
        raise GarbageReply("neither token ids nor text")
    return Reply(tokens, text, stopped)


def end_of_turn_id(tokenizer: Any, eos_ids: Sequence[int]) -> int | None:
    """The id added to an answer whose server said it stopped but sent no end token (a text
    answer drops it): the tokenizer's EOS when it ends turns, else the smallest end id."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int) and eos in eos_ids:
        return eos
    return min(eos_ids) if eos_ids else None


def answer_tokens(
    reply: Reply, tokenizer: Any, eos_ids: Sequence[int], end_of_turn: int | None
) -> tuple[list[int], str, bool | None]:
    """``(tokens, finish, round trip)`` of one answer, in `regenerate`'s form: cut after the first
    end-of-turn token (``finish = "eos"``; one is added when the server stopped without sending
    it), else ``"length"``. Text-only answers are tokenized here; the round trip says whether
    ``decode(tokenize(text)) == text`` (None: the server gave ids)."""
    round_trip: bool | None = None
    if reply.tokens is not None:
        tokens = list(reply.tokens)
    else:
        text = reply.text or ""
        tokens = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        back = tokenizer.decode(
            tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        round_trip = back == text
    eos = set(eos_ids)
    cut = next((i for i, token in enumerate(tokens) if token in eos), None)
    if cut is not None:
        return tokens[: cut + 1], "eos", round_trip
    if reply.stopped:
        if end_of_turn is not None:
            tokens.append(end_of_turn)
        return tokens, "eos", round_trip
    return tokens, "length", round_trip


def probe_prompt_form(
    server: Server, probe_ids: Sequence[int], tokenizer: Any, *, timeout: float = 600.0
) -> Server:
    """`server` after a one-token completion of `probe_ids`: sent as ids, then (on a 4xx) as
    their text; `ServerUnavailable` when it takes neither or answers no completion."""
    settings = GenerationSettings(max_new_tokens=1)

    def ask(candidate: Server, text: str | None) -> None:
        path, body = completion_request(
            candidate, probe_ids, text, settings=settings, max_new_tokens=1, seed=0
        )
        parse_reply(candidate.api, post_json(candidate.url + path, body, timeout=timeout))

    try:
        ask(server, None)
        return server
    except GarbageReply as bad:
        raise ServerUnavailable(f"{server.url}: its completion answer is not one ({bad})") from None
    except RequestFailed as failure:
        if not failure.client_error:
            raise ServerUnavailable(
                f"{server.url}: a one-token completion got no answer ({failure})"
            ) from None
        refused = failure
    as_text = replace(server, prompt_as_text=True)
    text = tokenizer.decode(list(probe_ids), skip_special_tokens=False,
                            clean_up_tokenization_spaces=False)  # fmt: skip
    try:
        ask(as_text, text)
    except (RequestFailed, GarbageReply) as failure:
        raise ServerUnavailable(
            f"{server.url} refuses the prompt as token ids ({refused}) and as text ({failure})"
        ) from None
    log.warning(
        "%s takes no token-id prompts (%s): prompts go as text, which it tokenizes itself",
        server.url,
        refused,
    )
    return as_text
