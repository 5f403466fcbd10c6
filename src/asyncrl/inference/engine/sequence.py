"""One generated sequence's bookkeeping: its tokens, incremental detokenization and stop conditions.

Lives on the engine thread; every method is plain Python (no torch). `FastDecode` gives a sequence the
same text as its tokenizer's `decode` at a third of the cost where it can (two decodes per token).
"""

from __future__ import annotations

from asyncrl.inference.api.backend import PromptLogprobs, SamplingParams, SeqDelta

_PROMPT_CONTEXT = 5  # prompt tokens decoded with the output so leading-space rules apply correctly


class FastDecode:
    """`decode(ids, skip_special_tokens)` of a HF tokenizer: the Rust tokenizer's own decode when the HF
    wrapper adds nothing to it (a fast tokenizer that overrides neither `decode` nor `_decode` and cleans up
    no spaces), else the tokenizer's `decode`. The wrapper's argument handling costs twice the decode."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode
        if _plain_fast(tokenizer):
            backend = tokenizer._tokenizer
            self.decode = lambda ids, skip_special_tokens=False: backend.decode(ids, skip_special_tokens)


def _plain_fast(tokenizer) -> bool:
    """Whether `tokenizer.decode(ids, skip)` is exactly its Rust tokenizer's `decode(ids, skip)`."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return False
    cls = type(tokenizer)
    return (
        isinstance(tokenizer, TokenizersBackend)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is TokenizersBackend._decode
        and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
    )


class Sequence:
    """Tokens and text of one choice; `append` applies a sampled token and says if it finished."""

    def __init__(self, index: int, prompt_ids: list[int], params: SamplingParams, tokenizer, eos_ids: set[int]):
        self.index = index
        self.params = params
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.prompt_len = len(prompt_ids)
        self.output_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        # incremental detokenization over (prompt tail + output), as prefix/read offsets
        self._ids = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""
        self._emitted = 0  # chars of `text` already handed out
        self._holdback = max((len(s) for s in params.stop), default=1) - 1
        # pending output not yet delivered
        self._new_ids: list[int] = []
        self._new_logprobs: list[float] = []
        self._new_top: list[list[tuple[int, float]]] = []
        self.prompt_logprobs: PromptLogprobs | None = None  # set at prefill when asked; goes out with the first delta
        self.routed_experts = None  # set at its finish when routes are recorded; goes out with the last delta
        self._banned: list[int] | None = None  # banned_ids before min_tokens, once built

    @property
    def length(self) -> int:
        """Tokens in context (prompt + output)."""
        return self.prompt_len + len(self.output_ids)

    def banned_ids(self) -> list[int]:
        """Tokens that may not be sampled yet (eos and stop ids before min_tokens)."""
        if len(self.output_ids) >= self.params.min_tokens:
            return []
        if self._banned is None:  # the same until min_tokens: built once
            ids = set(self.params.stop_token_ids)
            if not self.params.ignore_eos:
                ids |= self.eos_ids
            self._banned = sorted(ids)
        return self._banned

    def append(self, token: int, logprob: float, top: list[tuple[int, float]] | None, max_len: int) -> bool:
        """Record a sampled token; returns True when the sequence has finished."""
        p = self.params
        self.output_ids.append(token)
        self._new_ids.append(token)
        self._new_logprobs.append(logprob)
        if top is not None:
            self._new_top.append(top)
        self._detokenize(token)
        n_out = len(self.output_ids)
        if n_out >= p.min_tokens:
            if token in self.eos_ids and not p.ignore_eos:
                self.finish_reason = "stop"
            elif token in p.stop_token_ids:
                self.finish_reason, self.stop_reason = "stop", token
            elif p.stop:
                self._check_stop_strings()
        if self.finish_reason is None and (n_out >= p.max_tokens or self.length >= max_len):
            self.finish_reason = "length"
        if self.finish_reason is not None:
            self._flush_text()
        return self.finish_reason is not None

    def abort(self) -> None:
        self.finish_reason = "abort"

    def _detokenize(self, token: int) -> None:
        self._ids.append(token)
        skip = self.params.skip_special_tokens
        prefix = self.tokenizer.decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
        full = self.tokenizer.decode(self._ids[self._prefix_offset :], skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)

    def _flush_text(self) -> None:
        """At the end, emit what an incomplete multi-byte character held back."""
        if self._read_offset < len(self._ids) and not isinstance(self.stop_reason, str):
            skip = self.params.skip_special_tokens
            prefix = self.tokenizer.decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
            full = self.tokenizer.decode(self._ids[self._prefix_offset :], skip_special_tokens=skip)
            self.text += full[len(prefix) :]
            self._read_offset = len(self._ids)

    def _check_stop_strings(self) -> None:
        longest = self._holdback + 1
        start = max(0, self._emitted - longest)
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            at = self.text.find(stop, start)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is not None:
            at, stop = best
            self.text = self.text[: at + len(stop)] if self.params.include_stop_str_in_output else self.text[:at]
            self.finish_reason, self.stop_reason = "stop", stop

    def take_delta(self) -> SeqDelta | None:
        """Everything new since the last call (None if nothing); text near a possible stop string waits."""
        done = self.finish_reason is not None
        upto = len(self.text) if done else max(self._emitted, len(self.text) - self._holdback)
        if not self._new_ids and upto == self._emitted and not done:
            return None
        delta = SeqDelta(
            index=self.index,
            token_ids=self._new_ids,
            logprobs=self._new_logprobs,
            top_logprobs=self._new_top if self.params.logprobs else None,
            text=self.text[self._emitted : upto],
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            prompt_logprobs=self.prompt_logprobs,
            routed_experts=self.routed_experts if done else None,
        )
        self.prompt_logprobs = None
        self._emitted = upto
        self._new_ids, self._new_logprobs, self._new_top = [], [], []
        return delta
