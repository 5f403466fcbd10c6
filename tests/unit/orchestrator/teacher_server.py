"""A real teacher for the orchestrator's distillation tests: a local HTTP server (FastAPI in a thread) that serves
a real tiny HF model with transformers and answers in vLLM's wire shape (DISTILL.md's contract): /health,
/v1/models, /tokenize and /v1/completions with `prompt_logprobs` over a token-id prompt.

Knobs for the error paths: `api_key` (401 without it), `vocab_shift` (another tokenizer: every /tokenize id
moved), `die_after` (after that many scoring requests every request answers 503, as a teacher going down does),
`refuse` (a 400 with an OpenAI error body for every scoring request), `owned_by` ("asyncrl": its /v1/models card
says so and it honours `logprob_start_len`, as asyncrl's server does; else it lists every position, as vLLM
does). A request's prompt is one token-id list or a batch of them (a choice each). `requests` records (time,
prompt) of every prompt scored, `bodies` every scoring request's body."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from server_proc import serve_in_thread


class TeacherServer:
    def __init__(
        self,
        model_dir: Path,
        name: str = "teacher",
        api_key: str | None = None,
        vocab_shift: int = 0,
        die_after: int | None = None,
        refuse: bool = False,
        max_model_len: int = 512,
        owned_by: str | None = None,
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.name, self.api_key, self.vocab_shift = name, api_key, vocab_shift
        self.die_after, self.refuse, self.max_model_len = die_after, refuse, max_model_len
        self.owned_by = owned_by  # "asyncrl": it also honours logprob_start_len (else ignored, as vLLM does)
        self.requests: list[tuple[float, list[int]]] = []
        self.bodies: list[dict] = []
        self._lock = threading.Lock()
        self.url, self._stop = serve_in_thread(self._app(), 30)
        self.base_url = self.url + "/v1"

    def __enter__(self) -> TeacherServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop()

    def logprobs(self, ids: list[int]) -> list[float]:
        """log p(ids[t] | ids[:t]) for t >= 1 under the model (what the server answers), element 0 = 0.0."""
        lp = self.distributions(ids).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        return [0.0] + lp.tolist()

    def distributions(self, ids: list[int]) -> torch.Tensor:
        """[len(ids) - 1, V]: row t - 1 is the log-distribution of the token at position t."""
        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits[:-1], -1)

    def choice(self, index: int, ids: list[int], body: dict) -> dict:
        """One prompt's choice: vLLM's prompt_logprobs shape, the prompt's token then the top k per position."""
        dists, k = self.distributions(ids), int(body.get("prompt_logprobs") or 0)
        entries: list = [None]
        for i, dist in zip(ids[1:], dists):
            vals, top_ids = dist.topk(k) if k else (torch.zeros(0), torch.zeros(0, dtype=torch.long))
            top = [(i, dist[i].item())] + list(zip(top_ids.tolist(), vals.tolist()))
            entries.append({str(x): {"logprob": lp, "rank": 1, "decoded_token": self.tok.decode([x])} for x, lp in top})
        if self.owned_by == "asyncrl" and body.get("logprob_start_len"):
            start = min(body["logprob_start_len"], len(entries))
            entries[:start] = [None] * start
        return {"index": index, "text": "x", "finish_reason": "length", "prompt_logprobs": entries}

    def _app(self) -> FastAPI:
        app, server = FastAPI(), self

        def denied(request: Request) -> JSONResponse | None:
            if server.api_key and request.headers.get("authorization") != f"Bearer {server.api_key}":
                return JSONResponse({"error": {"message": "invalid API key", "code": 401}}, status_code=401)
            return None

        @app.get("/health")
        def health():
            return {"status": "ok"}

        @app.get("/v1/models")
        def models(request: Request):
            if (no := denied(request)) is not None:
                return no
            card = {"object": "model", "max_model_len": server.max_model_len}
            if server.owned_by is not None:
                card["owned_by"] = server.owned_by
            return {"object": "list", "data": [{"id": server.name, **card}]}

        @app.post("/tokenize")
        async def tokenize(request: Request):
            if (no := denied(request)) is not None:
                return no
            body = await request.json()
            ids = [i + server.vocab_shift for i in server.tok.encode(body["prompt"], add_special_tokens=True)]
            return {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids}

        @app.post("/v1/completions")
        async def completions(request: Request):
            if (no := denied(request)) is not None:
                return no
            body = await request.json()
            prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]  # one, or a batch
            with server._lock:
                server.requests += [(time.monotonic(), list(ids)) for ids in prompts]
                server.bodies.append(body)
                n = len(server.bodies)
            if server.die_after is not None and n > server.die_after:
                return JSONResponse({"error": {"message": "engine is not running", "code": 503}}, status_code=503)
            if server.refuse:
                msg = f"This model's maximum context length is {server.max_model_len} tokens"
                return JSONResponse({"error": {"message": msg, "code": 400}}, status_code=400)
            choices = [server.choice(j, ids, body) for j, ids in enumerate(prompts)]
            return {"id": "cmpl-1", "object": "text_completion", "model": server.name, "choices": choices}

        return app
