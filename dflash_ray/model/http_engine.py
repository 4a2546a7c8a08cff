"""Regeneration through an OpenAI-compatible server the user runs (vLLM's, SGLang's, TGI, `transformers serve`,
llama.cpp's): the same walk over the conversations' turns as the job's own engines (generation.py TurnWalk),
each turn's prompt sent to the server's `/completions` as the text `Rendering` renders, so the template
arguments, tools and system prompt are exactly those `prepare` supervises with.

Per request: `max_tokens` (regenerate.max_new_tokens, within the target's context), the sampling
(temperature 0: greedy), `stop_token_ids` (every end token the target declares; servers that do not know the
field stop at the model's own), `seed`. The answer is the returned text; `finish_reason` "stop" is an end
token, "length" the cap. The server's tokenization of the prompt is checked against Rendering's ids by the
count the server reports (`usage.prompt_tokens`): a row where they differ is counted and its turn dropped, since
the drafter would learn from a prompt the target never saw. A greedy loop is found after the fact, on the
answer's own tokens, by the rule the local engines apply while generating.

Failures: 429 and 5xx (and a connection refused or reset) are retried with exponential backoff up to
`max_retries`. A request still answered 429 or 5xx drops its turn, counted by its status, and the job goes on;
a server that cannot be reached at all is gone (ServerGone, one line naming the URL: the job keeps what it
wrote, a rerun resumes); any other answer (400: a prompt the server refuses) drops that turn, counted by its
status. The API key comes from the environment variable `api_key_env` names, never from a config file, and is
never printed.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

from dflash_ray.config import RegenerateConfig
from dflash_ray.model.generation import (LOOP_MAX_PERIOD, LOOP_MIN_SPAN, ON_MAX_TOKENS, TurnWalk,
                                         declared_end_token_ids, first_loop, sampling_options)

RETRIED = {429, 500, 502, 503, 504}
# fields not every server takes (vLLM's and SGLang's do; `transformers serve` refuses unknown fields with a 422):
# a server that names one in its refusal gets the request again without it, and never again
OPTIONAL_FIELDS = ("stop_token_ids", "seed")


class ServerGone(Exception):
    """The server could not be reached (or kept failing) after every retry."""


class Completions:
    """One server's `/completions`, with retries; thread-safe (one requests.Session per thread)."""

    def __init__(self, url: str, *, model: str | None = None, api_key: str | None = None,
                 max_retries: int = RegenerateConfig.max_retries, timeout_s: float = RegenerateConfig.timeout_s,
                 backoff_s: float = 0.5):
        import threading

        self.base = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.max_retries, self.timeout_s, self.backoff_s = int(max_retries), float(timeout_s), float(backoff_s)
        self.local = threading.local()
        self.unsupported: set[str] = set()
        self.model = model or self._first_model()

    def _session(self):
        import requests

        if not hasattr(self.local, "session"):
            self.local.session = requests.Session()
        return self.local.session

    def _request(self, method: str, path: str, body: dict | None = None):
        """The response: the first one not retried, or the last of the retries (a 429 or 5xx the caller counts);
        ServerGone when the server could not be reached at all on the last try."""
        import requests

        url, r = f"{self.base}{path}", None
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                r = self._session().request(method, url, json=body, headers=self.headers, timeout=self.timeout_s)
            except (requests.ConnectionError, requests.Timeout) as e:
                r = None
                if attempt == self.max_retries:
                    raise ServerGone(f"{self.base}: the server cannot be reached ({type(e).__name__}) after "
                                     f"{self.max_retries} retries; what was regenerated so far is kept: rerun "
                                     "to resume") from None
                continue
            if r.status_code not in RETRIED:
                return r
        return r

    def _first_model(self) -> str:
        r = self._request("GET", "/models")
        try:
            return r.json()["data"][0]["id"]
        except (ValueError, KeyError, IndexError) as e:
            raise ServerGone(f"{self.base}/models: no model listed (HTTP {r.status_code}); name the one it serves "
                             "with regenerate.served_model") from e

    def complete(self, prompt: str, max_tokens: int, sampling: dict, stop_token_ids: list[int]) -> dict:
        """{"text", "finish_reason", "prompt_tokens", "completion_tokens"} or {"error": reason}."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": int(max_tokens),
                "temperature": sampling["temperature"], "top_p": sampling["top_p"], "stop_token_ids": stop_token_ids}
        if sampling["seed"] is not None:
            body["seed"] = sampling["seed"]
        while True:
            sent = {k: v for k, v in body.items() if k not in self.unsupported}
            r = self._request("POST", "/completions", sent)
            if r.status_code not in (400, 422):
                break
            named = {f for f in OPTIONAL_FIELDS if f in sent and f in r.text}
            self.unsupported |= named
            if not named and not (set(sent) & self.unsupported):   # (another thread may have learnt it meanwhile)
                break
        if r.status_code in RETRIED:
            return {"error": f"the server failed it (HTTP {r.status_code}) after {self.max_retries} retries"}
        if r.status_code != 200:
            return {"error": f"the server refused it (HTTP {r.status_code})"}
        try:
            out = r.json()
            choice = out["choices"][0]
            usage = out.get("usage") or {}
            return {"text": choice.get("text") or "", "finish_reason": choice.get("finish_reason"),
                    "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens")}
        except (ValueError, KeyError, IndexError, TypeError):
            return {"error": "the server's answer is not a completion"}


class HttpRegenerator:
    """Regenerator's interface (conversations, tools) -> (regenerated, counts by reason), the answers from a
    server. No model is loaded: the target directory gives the context length and the end tokens."""

    def __init__(self, target_dir: str | None, rendering, *, url: str, served_model: str | None = None,
                 api_key_env: str = RegenerateConfig.api_key_env, max_new_tokens: int,
                 on_max_tokens: str = RegenerateConfig.on_max_tokens, concurrency: int = RegenerateConfig.concurrency,
                 max_retries: int = RegenerateConfig.max_retries, timeout_s: float = RegenerateConfig.timeout_s,
                 sampling: dict | None = None,
                 loop_min_span: int = LOOP_MIN_SPAN, loop_max_period: int = LOOP_MAX_PERIOD, backoff_s: float = 0.5):
        if on_max_tokens not in ON_MAX_TOKENS:
            raise ValueError(f"on_max_tokens: {on_max_tokens!r} is not one of {', '.join(ON_MAX_TOKENS)}")
        self.rendering, self.tok = rendering, rendering.tok
        self.server = Completions(url, model=served_model, api_key=os.environ.get(api_key_env) or None,
                                  max_retries=max_retries, timeout_s=timeout_s, backoff_s=backoff_s)
        self.max_new_tokens, self.on_max_tokens, self.concurrency = int(max_new_tokens), on_max_tokens, int(concurrency)
        self.loops = (loop_min_span, loop_max_period) if on_max_tokens == "drop" and loop_max_period > 0 else None
        self.max_context = _context_length(target_dir)
        self.ends = declared_end_token_ids(self.tok, target_dir) if target_dir else [self.tok.eos_token_id]
        self.end_texts = tuple(self.tok.decode([t]) for t in self.ends)
        self.sampling = sampling_options(sampling)

    def __call__(self, conversations: list, tools: list | None = None):
        walk = TurnWalk(self.rendering, conversations, tools, max_context=self.max_context,
                        on_max_tokens=self.on_max_tokens, end_texts=self.end_texts)
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            while prompts := walk.prompts():
                order = sorted(prompts)
                answers = pool.map(lambda i: self._answer(walk.texts[i], prompts[i]), order)
                for i, (text, stopped, capped_by, generated) in zip(order, answers):
                    walk.counts["generated tokens"] += generated
                    walk.answer(i, text, stopped, capped_by)
        return walk.result()

    def _answer(self, prompt: str, ids: list[int]) -> tuple[str, bool, str, int]:
        """(text, stopped at an end token, what capped it or why there is none, tokens generated)."""
        new = min(self.max_new_tokens, self.max_context - len(ids))
        capped_by = "max_new_tokens" if new == self.max_new_tokens else "the target's context"
        r = self.server.complete(prompt, new, self.sampling, self.ends)
        if "error" in r:
            return "", False, f"error: {r['error']}", 0
        if r["prompt_tokens"] is not None and r["prompt_tokens"] != len(ids):
            return "", False, "error: the server tokenizes the prompt otherwise", 0
        text, stopped = r["text"], r["finish_reason"] == "stop"
        answer = self.tok(text, add_special_tokens=False)["input_ids"]
        generated = r["completion_tokens"] if r["completion_tokens"] is not None else len(answer) + int(stopped)
        looped = first_loop(answer, *self.loops) if self.loops else None
        if looped is not None:
            return "", False, "a greedy loop", generated
        return text, stopped, capped_by, generated


def _context_length(target_dir: str | None) -> int:
    """The target's context (max_position_embeddings of its config.json), else no bound."""
    if not target_dir:
        return 1 << 30
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(target_dir))
    except (OSError, ValueError):
        return 1 << 30
    config = getattr(config, "text_config", config)
    return int(getattr(config, "max_position_embeddings", None) or 1 << 30)
