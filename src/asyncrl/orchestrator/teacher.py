"""The teacher of on-policy distillation: a second inference server that scores the student's exact tokens.

`TeacherClient.connect` (at every orchestrator start, a resumed one too) waits for the teacher's /health, checks
its API key, learns its model name (`teacher.model`, else /v1/models' first entry) and context length, and
checks that it tokenizes like the student's server (same ids for `PROBE`, same vocab size where either server
says it): distilling through another tokenizer would compare logprobs of unrelated tokens, so a mismatch is
refused in one line naming both models.

`score(sample)` asks for the teacher's logprob of each of the sample's own tokens (vLLM's wire shape: POST
/v1/completions with the token ids as the prompt, `prompt_logprobs = 0`, `max_tokens = 1`), and returns them
aligned with the sample: element t is log p_teacher(token t | tokens < t), element 0 is 0.0 (nothing precedes
it). Only the part the trainer sees is scored: up to the last loss token, at most `seq_len` tokens, and at most
the teacher's context less the one token it generates; tokens past what was scored get no teacher logprob (the
list is shorter than the sample) and so no distillation signal. At most `max_concurrent` requests are in flight.
Connection errors and 5xx answers are retried with backoff; a 4xx answer, a malformed one, or a teacher still
unreachable after the retries is a UserError naming the teacher's URL and what it answered.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import httpx
from loguru import logger

from asyncrl.config.orchestrator import TeacherConfig
from asyncrl.core.errors import UserError
from asyncrl.orchestrator.client import key_refused, root_client, server_root, wait_healthy
from asyncrl.orchestrator.filtering import Group
from asyncrl.orchestrator.rollouts import gather_all
from asyncrl.orchestrator.samples import TokenSample

# ASCII, digits, whitespace runs, accented and CJK characters, emoji: tokenizers that differ anywhere usual differ here
PROBE = "Hello, World! 0123456789 3.14159\n\n\t  tabs  and   spaces;  café naïve Ærø señor 日本語の文章 中文 🙂🚀👍🏽"
RETRIES = 5
BACKOFF_S = 0.5


def teacher_hint(url: str) -> str:
    return (
        f"start the teacher with `inference --model.name <teacher> --server.port <port>` (or rl's [teacher]) "
        f"or point [orchestrator.teacher] at a running one (now {url})"
    )


class TeacherClient:
    """Async client of the teacher server: connect (checks), then score samples."""

    def __init__(self, config: TeacherConfig, seq_len: int):
        self.config = config
        self.url = config.url
        self.root = server_root(config.url)
        self.seq_len = seq_len
        self.api_key_var = config.api_key_var
        self._http = root_client(config)
        self._slots = asyncio.Semaphore(config.max_concurrent) if config.max_concurrent else None
        self.model: str | None = config.model
        self.max_model_len: int | None = None
        self.unscored_tokens = 0  # loss tokens past the teacher's context (counted, warned about once)

    async def close(self) -> None:
        await self._http.aclose()

    # ---- connect: health, key, model, tokenizer ---------------------------------------------------------------
    async def connect(self, student_tokens: list[int], student_model: str, student_vocab: int | None = None) -> None:
        """Wait for the teacher and check it (module docstring); `student_tokens`: the student server's ids of
        PROBE (`tokenize(PROBE)` there)."""
        await self.wait_healthy()
        models = await self._get_json("/v1/models")
        cards = [m for m in models.get("data") or [] if isinstance(m, dict) and "id" in m]
        if not cards:
            raise UserError(f"teacher at {self.root} lists no model at /v1/models (answered {str(models)[:200]})")
        if self.model is None:
            self.model = str(cards[0]["id"])
        card = next((m for m in cards if m["id"] == self.model), None)
        if card is None:
            raise UserError(
                f"teacher at {self.root} serves {[m['id'] for m in cards]}, not teacher.model = {self.model!r}; "
                "set orchestrator.teacher.model to one of them (or leave it unset for the first)"
            )
        self.max_model_len = _positive_int(card.get("max_model_len"))
        answer = await self._post_json("/tokenize", {"model": self.model, "prompt": PROBE})
        tokens, vocab = answer.get("tokens"), _positive_int(answer.get("vocab_size") or card.get("vocab_size"))
        if tokens != student_tokens or (vocab is not None and student_vocab is not None and vocab != student_vocab):
            raise UserError(
                f"the teacher {self.model!r} ({self.root}) has another tokenizer than the student "
                f"{student_model!r}: they tokenize a probe text differently"
                + (f" (vocab sizes {vocab} vs {student_vocab})" if vocab != student_vocab and vocab else "")
                + "; on-policy distillation needs a teacher with the student's tokenizer"
            )
        logger.info(
            f"teacher {self.model!r} at {self.root} (context {self.max_model_len or 'unknown'}): same tokenizer "
            "as the student"
        )

    async def wait_healthy(self, poll: float = 0.2) -> None:
        await wait_healthy(
            self._http, "teacher server", self.root, self.config.health_timeout, teacher_hint(self.url), poll
        )

    # ---- scoring ----------------------------------------------------------------------------------------------
    def scored_length(self, sample: TokenSample) -> int:
        """How many of the sample's first tokens are sent: up to its last loss token, within seq_len and the
        teacher's context (less the one token the request generates)."""
        last = max((t for t, m in enumerate(sample.loss_mask) if m), default=-1)
        n = min(last + 1, self.seq_len)
        if self.max_model_len is not None:
            n = min(n, self.max_model_len - 1)
        return max(n, 0)

    async def score(self, sample: TokenSample) -> list[float]:
        """The teacher's logprob of each of the sample's first `scored_length` tokens (element 0: 0.0)."""
        n = self.scored_length(sample)
        cut = sum(sample.loss_mask[n : self.seq_len])
        if cut:
            if not self.unscored_tokens:
                logger.warning(
                    f"{cut} loss tokens of a sample lie past the teacher's context ({self.max_model_len} tokens, one "
                    "of them for the token a scoring request generates): they get no distillation signal; start the "
                    f"teacher with max_model_len >= seq_len + 1 = {self.seq_len + 1}"
                )
            self.unscored_tokens += cut
        if n < 2:
            return [0.0] * n
        ids = sample.input_ids[:n]
        body = {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
        answer = await self._post_json("/v1/completions", body, retry=True)
        return self._logprobs(answer, ids)

    async def score_group(self, group: Group) -> list[list[float]]:
        """The teacher's logprobs of every sample of the group's valid rollouts, in order."""
        return await gather_all([self.score(s) for r in group.valid for s in r.samples])

    def _logprobs(self, answer: dict, ids: list[int]) -> list[float]:
        try:
            entries = answer["choices"][0]["prompt_logprobs"]
        except (KeyError, IndexError, TypeError):
            entries = None
        if not isinstance(entries, list) or len(entries) != len(ids):
            got = "none" if entries is None else f"{len(entries) if isinstance(entries, list) else type(entries)}"
            raise UserError(
                f"teacher at {self.root} answered no usable prompt_logprobs (wanted {len(ids)}, got {got}): it must "
                "answer /v1/completions with prompt_logprobs (asyncrl's `inference`, or vLLM)"
            )
        out = [0.0]
        for t in range(1, len(ids)):
            entry = entries[t] if isinstance(entries[t], dict) else {}
            value = entry.get(str(ids[t]))
            lp = value.get("logprob") if isinstance(value, dict) else None
            if not isinstance(lp, (int, float)) or math.isnan(lp):
                raise UserError(
                    f"teacher at {self.root} gave no logprob for prompt token {t} (id {ids[t]}): "
                    f"{str(entries[t])[:200]}"
                )
            out.append(max(float(lp), -1e4))  # -inf (a token the teacher rules out): a large finite penalty
        return out

    # ---- HTTP -------------------------------------------------------------------------------------------------
    async def _get_json(self, path: str) -> dict:
        return await self._request("GET", path, None, retry=True)

    async def _post_json(self, path: str, body: dict, retry: bool = True) -> dict:
        if self._slots is None:
            return await self._request("POST", path, body, retry)
        async with self._slots:
            return await self._request("POST", path, body, retry)

    async def _request(self, method: str, path: str, body: dict | None, retry: bool) -> dict:
        """The JSON answer; transient failures (connection errors, 5xx) retried, the rest a UserError."""
        last = ""
        for attempt in range(RETRIES if retry else 1):
            if attempt:
                await asyncio.sleep(min(BACKOFF_S * 2 ** (attempt - 1), 8.0))
            try:
                response = await self._http.request(method, path, json=body)
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                continue
            if response.status_code >= 500:
                last = f"HTTP {response.status_code}: {_message(response)}"
                continue
            if response.status_code in (401, 403):
                option, status = "orchestrator.teacher.api_key_var", response.status_code
                raise key_refused("teacher server", "teacher", self.root, status, self.api_key_var, option)
            if response.status_code != 200:
                raise UserError(
                    f"teacher server at {self.root} refused {method} {path} ({response.status_code}): "
                    f"{_message(response)}"
                )
            try:
                answer = response.json()
            except ValueError:
                answer = None
            if not isinstance(answer, dict):
                raise UserError(f"teacher at {self.root} answered {path} with no JSON object: {_message(response)}")
            return answer
        raise UserError(
            f"teacher server at {self.root} stopped answering {method} {path} ({last}, {RETRIES if retry else 1} "
            f"tries); {teacher_hint(self.url)}"
        )


def _message(response: httpx.Response) -> str:
    """The server's error message (OpenAI's error body, or the text), on one line."""
    try:
        body: Any = response.json()
        text = body.get("error", {}).get("message") if isinstance(body.get("error"), dict) else body.get("detail")
    except (ValueError, AttributeError):
        text = None
    return " ".join(str(text or response.text).split())[:300]


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
