"""The teacher of on-policy distillation: a second inference server that scores the student's exact tokens.

`TeacherClient.connect` (at every orchestrator start, a resumed one too) waits for the teacher's /health, checks
its API key, learns its model name (`teacher.model`, else /v1/models' first entry) and context length, and
checks that it tokenizes like the student's server (same ids for `PROBE`, same vocab size where either server
says it): distilling through another tokenizer would compare logprobs of unrelated tokens, so a mismatch is
refused in one line naming both models.

`score(sample)` asks for the teacher's logprob of each of the sample's own tokens (vLLM's wire shape: POST
/v1/completions with the token ids as the prompt, `prompt_logprobs = 0`, `max_tokens = 1`; `score_group` sends
a group's samples as one request, a batch of id lists with a choice each), and returns them
aligned with the sample: element t is log p_teacher(token t | tokens < t) from the sample's first loss token on,
0.0 before it (the prompt is never trained on). An asyncrl teacher (its /v1/models card says `owned_by:
asyncrl`) is asked with `logprob_start_len` = that position and lists nothing before it, so a short completion
after a long prompt does not ship the prompt's top k (vLLM ignores the field and lists every position; the
client reads the same positions either way). Only the part the trainer sees is scored: up to the last loss
token, at most `seq_len` tokens, and at most the teacher's context less the one token it generates; tokens past
what was scored get no teacher logprob (the list is shorter than the sample) and so no distillation signal. At
most `max_concurrent` requests are in flight.

One class per scoring mode, each a `TeacherClient` (`teacher_client` picks it from `[orchestrator.distill]`):
- `TeacherClient` (reverse_kl, `top_k = 0`): the sampled tokens' logprobs only.
- `BaselineTeacher` (reverse_kl, `top_k` > 0): each score also carries a per-position baseline
  (`TeacherScores.baseline`): the reverse KL at position t estimated from the teacher's and the student's top-k
  logprobs there (the student's from its own server, the same prompt-logprobs request), sum over the student's
  top tokens x of s(x) (log s(x) - log t(x)), a token outside the teacher's top k taking the teacher's k-th
  logprob. It depends on the tokens before t only, so subtracting it from the sampled token's advantage keeps
  the gradient unbiased and takes out most of its variance (every sampled token is no longer pushed down by the
  average KL).
- `DenseTeacher` (`distill.kind = "forward_kl"`): each score instead carries the teacher's top-k at every
  position (`TeacherScores.top`: {token id: logprob}, the sampled token included, cut to that however many the
  server lists; an id outside the vocabulary is a UserError naming the teacher), the target distribution the
  trainer's cross-entropy term pulls the student toward; the student's server is not asked.

Connection errors and 5xx answers are retried with backoff; a 4xx answer, a malformed one, a teacher still
unreachable after the retries, or one that lets two requests in a row run past `teacher.timeout` (60 s: a
scoring request is a prefill) is a UserError naming the teacher's URL and what it answered.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import httpx
from loguru import logger

from asyncrl.config.orchestrator import DistillConfig, EndpointConfig, TeacherConfig
from asyncrl.core.errors import UserError
from asyncrl.orchestrator.client import key_refused, root_client, server_root, wait_healthy
from asyncrl.orchestrator.filtering import Group
from asyncrl.orchestrator.rollouts import gather_all
from asyncrl.orchestrator.samples import TeacherScores, TokenSample

# ASCII, digits, whitespace runs, accented and CJK characters, emoji: tokenizers that differ anywhere usual differ here
PROBE = "Hello, World! 0123456789 3.14159\n\n\t  tabs  and   spaces;  café naïve Ærø señor 日本語の文章 中文 🙂🚀👍🏽"
RETRIES = 5
TIMEOUTS = 2  # requests in a row that time out: the teacher hangs (a scoring request takes seconds)
KEY_OPTIONS = {"teacher": "orchestrator.teacher.api_key_var", "student": "orchestrator.client.api_key_var"}
BACKOFF_S = 0.5


def teacher_hint(url: str) -> str:
    return (
        f"start the teacher with `inference --model.name <teacher> --server.port <port>` (or rl's [teacher]) "
        f"or point [orchestrator.teacher] at a running one (now {url})"
    )


class TeacherClient:
    """Async client of the teacher server: connect (checks), then score samples, the sampled tokens only (the
    subclasses add what their mode needs). `student`: the client of the student's own server where a mode scores
    there too (`BaselineTeacher`), else None."""

    top_k = 0  # the top tokens listed per position
    student: TeacherClient | None = None

    def __init__(self, config: TeacherConfig, seq_len: int, role: str = "teacher"):
        self.config = config
        self.role = role  # "teacher", or "student" for the client of the student's server; named in errors
        self.key_option = KEY_OPTIONS[role]
        self.url = config.url
        self.root = server_root(config.url)
        self.seq_len = seq_len
        self.api_key_var = config.api_key_var
        self._http = root_client(config)
        self._slots = asyncio.Semaphore(config.max_concurrent) if config.max_concurrent else None
        self.model: str | None = config.model
        self.max_model_len: int | None = None
        self.vocab_size: int | None = None  # the tokenizer's, as the teacher or the student's server says it
        self.trims = False  # the server is asyncrl's: it lists prompt logprobs only from `logprob_start_len` on
        self.unscored_tokens = 0  # loss tokens past the teacher's context (counted, warned about once)

    async def close(self) -> None:
        await self._http.aclose()

    # ---- connect: health, key, model, tokenizer ---------------------------------------------------------------
    async def connect(self, student_tokens: list[int], student_model: str, student_vocab: int | None = None) -> None:
        """Wait for the teacher and check it (module docstring); `student_tokens`: the student server's ids of
        PROBE (`tokenize(PROBE)` there)."""
        await self.wait_healthy()
        cards = await self._model_cards(required=True)
        if self.model is None:
            self.model = str(cards[0]["id"])
        card = next((m for m in cards if m["id"] == self.model), None)
        if card is None:
            raise UserError(
                f"teacher at {self.root} serves {[m['id'] for m in cards]}, not teacher.model = {self.model!r}; "
                "set orchestrator.teacher.model to one of them (or leave it unset for the first)"
            )
        self.max_model_len = _positive_int(card.get("max_model_len"))
        self.trims = _asyncrl([card])
        answer = await self._post_json("/tokenize", {"model": self.model, "prompt": PROBE})
        tokens, vocab = answer.get("tokens"), _positive_int(answer.get("vocab_size") or card.get("vocab_size"))
        self.vocab_size = vocab or student_vocab
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

    async def _model_cards(self, required: bool) -> list[dict]:
        """The server's /v1/models entries (each with an id); `required`: a UserError if it lists none."""
        models = await self._get_json("/v1/models")
        cards = [m for m in models.get("data") or [] if isinstance(m, dict) and "id" in m]
        if required and not cards:
            raise UserError(f"{self.role} at {self.root} lists no model at /v1/models (answered {str(models)[:200]})")
        return cards

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

    def _plan(self, sample: TokenSample) -> tuple[list[int], int]:
        """(the ids to send, the first position trained on) for one sample; counts (and warns once about) loss
        tokens past the teacher's context."""
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
        return sample.input_ids[:n], max(1, sample.loss_mask.index(True)) if n else 1

    async def score(self, sample: TokenSample) -> TeacherScores:
        """The teacher's logprob of each of the sample's first `scored_length` tokens (module docstring)."""
        return (await self.score_many([sample]))[0]

    async def score_group(self, group: Group) -> list[TeacherScores]:
        """The teacher's scores of every sample of the group's valid rollouts, in order."""
        return await self.score_many(group.samples)

    async def score_many(self, samples: list[TokenSample]) -> list[TeacherScores]:
        """`score` of each sample, all in one request to the teacher (and, for a baseline, one to the student's
        server): a group's samples share their prompt, and one request of 8 prompts costs both ends far less
        than 8 requests."""
        plans = [self._plan(s) for s in samples]
        out = [TeacherScores([0.0] * len(ids)) for ids, _ in plans]
        todo = [i for i, (ids, _) in enumerate(plans) if len(ids) >= 2]
        if not todo:
            return out
        prompts, starts = [plans[i][0] for i in todo], [plans[i][1] for i in todo]
        answers = await self._answers(prompts, min(starts))
        for i, answer, ids, start in zip(todo, answers, prompts, starts):
            out[i] = self._scores(answer, ids, start)
        return out

    async def _answers(self, prompts: list[list[int]], start: int) -> list[Any]:
        """What the mode's scores of each prompt are made of: here the teacher's prompt_logprobs entries."""
        return self._entries(await self.prompt_logprobs(prompts, self.top_k, start), prompts)

    def _scores(self, entries: Any, ids: list[int], start: int) -> TeacherScores:
        """One prompt's scores from its `_answers` entry."""
        return TeacherScores(self._logprobs(entries, ids, start))

    async def prompt_logprobs(self, prompts: list[list[int]], k: int, start: int = 1) -> dict:
        """The server's answer to one prompt-logprobs request for the token-id `prompts` (plus the top k at each
        position; a choice per prompt), wanted from position `start` on: asyncrl's server then lists nothing
        before it (others list every position)."""
        body = {"model": self.model, "prompt": prompts, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": k}
        if self.trims and start > 1:
            body["logprob_start_len"] = start
        return await self._post_json("/v1/completions", body, retry=True)

    def _entries(self, answer: dict, prompts: list[list[int]]) -> list[list]:
        """The prompt_logprobs of the answer's choice for each of `prompts` (by the choices' `index`): one entry
        per token of that prompt (a UserError where it has not)."""
        try:
            choices = {c.get("index", j): c for j, c in enumerate(answer["choices"])}
        except (KeyError, TypeError, AttributeError):
            choices = {}
        out = []
        for j, ids in enumerate(prompts):
            entries = choices[j].get("prompt_logprobs") if isinstance(choices.get(j), dict) else None
            if not isinstance(entries, list) or len(entries) != len(ids):
                got = "none" if entries is None else f"{len(entries) if isinstance(entries, list) else type(entries)}"
                raise UserError(
                    f"{self.role} at {self.root} answered no usable prompt_logprobs (wanted {len(ids)}, got {got}): "
                    "it must answer /v1/completions with prompt_logprobs (asyncrl's `inference`, or vLLM)"
                )
            out.append(entries)
        return out

    def _listed(self, entry: Any, t: int) -> dict[int, float]:
        """{token id: logprob} of one position's prompt_logprobs entry (a UserError for an id that is no integer)."""
        try:
            return {int(x): lp for x, lp in _top(entry).items()}
        except ValueError:
            raise UserError(
                f"{self.role} at {self.root} listed a token id that is no integer at prompt position {t}: "
                f"{str(entry)[:200]} (prompt_logprobs keys are token ids, as vLLM and asyncrl's `inference` give them)"
            ) from None

    def _logprobs(self, entries: list, ids: list[int], start: int = 1) -> list[float]:
        """The teacher's logprob of each of `ids` from position `start` on (earlier positions: 0.0), from its
        prompt_logprobs `entries`."""
        out = [0.0] * min(start, len(ids))
        for t in range(len(out), len(ids)):
            entry = entries[t] if isinstance(entries[t], dict) else {}
            value = entry.get(str(ids[t]))
            lp = value.get("logprob") if isinstance(value, dict) else None
            if not isinstance(lp, (int, float)) or math.isnan(lp):
                raise UserError(
                    f"{self.role} at {self.root} gave no logprob for prompt token {t} (id {ids[t]}): "
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
        last, timed_out = "", 0
        for attempt in range(RETRIES if retry else 1):
            if attempt:
                await asyncio.sleep(min(BACKOFF_S * 2 ** (attempt - 1), 8.0))
            try:
                response = await self._http.request(method, path, json=body)
            except httpx.TimeoutException:
                timed_out += 1
                if timed_out == TIMEOUTS or not retry:
                    raise UserError(
                        f"{self.role} server at {self.root} did not answer {method} {path} within "
                        f"{self.config.timeout:g} s, {timed_out} time(s) in a row: it hangs or is overloaded "
                        f"(orchestrator.teacher.timeout sets the limit); {teacher_hint(self.url)}"
                    ) from None
                continue
            except httpx.HTTPError as e:
                last, timed_out = (f"{type(e).__name__}: {e}" if str(e) else type(e).__name__), 0
                continue
            timed_out = 0  # an answer: the timeouts counted are in a row
            if response.status_code >= 500:
                last = f"HTTP {response.status_code}: {_message(response)}"
                continue
            if response.status_code in (401, 403):
                status = response.status_code
                raise key_refused(
                    f"{self.role} server", self.role, self.root, status, self.api_key_var, self.key_option
                )
            if response.status_code != 200:
                raise UserError(
                    f"{self.role} server at {self.root} refused {method} {path} ({response.status_code}): "
                    f"{_message(response)}"
                )
            try:
                answer = response.json()
            except ValueError:
                answer = None
            if not isinstance(answer, dict):
                raise UserError(f"{self.role} at {self.root} answered {path} with no JSON object: {_message(response)}")
            return answer
        raise UserError(
            f"{self.role} server at {self.root} stopped answering {method} {path} ({last}, {RETRIES if retry else 1} "
            f"tries); {teacher_hint(self.url)}"
        )


class DenseTeacher(TeacherClient):
    """forward_kl: each score also carries the teacher's top-k at every trained position (`TeacherScores.top`)."""

    def __init__(self, config: TeacherConfig, seq_len: int, top_k: int):
        super().__init__(config, seq_len)
        self.top_k = top_k

    def _scores(self, entries: Any, ids: list[int], start: int) -> TeacherScores:
        scores = super()._scores(entries, ids, start)
        scores.top = [self._top_k(e, t, ids[t]) if t >= start else {} for t, e in enumerate(entries)]
        return scores

    def _top_k(self, entry: Any, t: int, token: int) -> dict[int, float]:
        """Position t's listed tokens cut to the `top_k` likeliest plus the sampled `token` (a server may list
        more than it was asked: all of them would go into the batch), every id checked against the vocabulary."""
        listed = self._listed(entry, t)
        bad = [x for x in listed if x < 0 or (self.vocab_size is not None and x >= self.vocab_size)]
        if bad:
            raise UserError(
                f"{self.role} at {self.root} listed token id {bad[0]} at prompt position {t}, outside the "
                f"vocabulary of {self.vocab_size} tokens: it is no teacher for this student's tokenizer"
            )
        keep = sorted(listed, key=listed.__getitem__, reverse=True)[: self.top_k]
        return {x: listed[x] for x in {*keep, token} if x in listed}


class BaselineTeacher(TeacherClient):
    """reverse_kl with top_k > 0: each score also carries the baseline (`TeacherScores.baseline`), from the
    teacher's and the student's top-k, the student's asked of its own server (`student`) in the same request."""

    def __init__(self, config: TeacherConfig, seq_len: int, top_k: int, student: TeacherClient):
        super().__init__(config, seq_len)
        self.top_k, self.student = top_k, student

    async def close(self) -> None:
        await super().close()
        await self.student.close()

    async def connect(self, student_tokens: list[int], student_model: str, student_vocab: int | None = None) -> None:
        """The teacher's checks, then the student server's context, which bounds what the baseline may send."""
        await super().connect(student_tokens, student_model, student_vocab)
        cards = await self.student._model_cards(required=False)
        lengths = (n for m in cards if (n := _positive_int(m.get("max_model_len"))))
        self.student.max_model_len, self.student.trims = min(lengths, default=None), _asyncrl(cards)

    async def _answers(self, prompts: list[list[int]], start: int) -> list[Any]:
        """(teacher entries, student entries) per prompt; the student's cut to its context (less the token a
        request generates)."""
        limit = self.student.max_model_len
        own = [ids[: limit - 1] if limit else ids for ids in prompts]
        teacher, student = await gather_all(
            [self.prompt_logprobs(prompts, self.top_k, start), self.student.prompt_logprobs(own, self.top_k, start)]
        )
        return list(zip(self._entries(teacher, prompts), self.student._entries(student, own)))

    def _scores(self, entries: Any, ids: list[int], start: int) -> TeacherScores:
        teacher, student = entries
        kl = reverse_kl(student, teacher, start)
        baseline = kl + [0.0] * (len(ids) - len(kl))  # past the student's context: no baseline
        return TeacherScores(self._logprobs(teacher, ids, start), baseline=baseline)


def teacher_client(
    config: TeacherConfig, seq_len: int, distill: DistillConfig, client: EndpointConfig, model: str
) -> TeacherClient:
    """The teacher's client for the distillation mode: forward_kl lists its top-k per position; reverse_kl with
    top_k > 0 also scores on the student's server (`client`, naming `model`) for the baseline."""
    if distill.kind == "forward_kl":
        return DenseTeacher(config, seq_len, distill.top_k)
    if not distill.top_k:
        return TeacherClient(config, seq_len)
    fields = client.model_dump(include=set(EndpointConfig.model_fields))
    student_config = TeacherConfig(**fields, model=model, max_concurrent=config.max_concurrent)
    return BaselineTeacher(config, seq_len, distill.top_k, TeacherClient(student_config, seq_len, role="student"))


def reverse_kl(student: list, teacher: list, start: int = 1) -> list[float]:
    """Per position, sum over the student's listed tokens x of s(x) (log s(x) - log t(x)); a token the teacher's
    entry lacks takes its lowest listed logprob (an upper bound on t(x)). Entries are vLLM's prompt_logprobs
    ({"<id>": {"logprob": ...}}; the first is None); positions before `start` (at least 0) get 0.0."""
    out = [0.0] * min(start, len(student), len(teacher))
    for s_entry, t_entry in zip(student[len(out) :], teacher[len(out) :]):
        s_lp, t_lp = _top(s_entry), _top(t_entry)
        floor = min(t_lp.values(), default=-1e4)
        out.append(sum(math.exp(lp) * (lp - t_lp.get(x, floor)) for x, lp in s_lp.items()))
    return out


def _asyncrl(cards: list[dict]) -> bool:
    """Whether /v1/models cards are all asyncrl's server's (`owned_by`): it honours `logprob_start_len`."""
    return bool(cards) and all(m.get("owned_by") == "asyncrl" for m in cards)


def _top(entry: Any) -> dict[str, float]:
    """{token id: logprob} of one prompt_logprobs entry (finite logprobs only)."""
    if not isinstance(entry, dict):
        return {}
    out = {}
    for x, v in entry.items():
        lp = v.get("logprob") if isinstance(v, dict) else None
        if isinstance(lp, (int, float)) and math.isfinite(lp):
            out[x] = float(lp)
    return out


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
