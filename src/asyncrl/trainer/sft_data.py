"""SFT data: load prompt/completion chat datasets, tokenize them with loss masks, pack them into rows.

Format: every row has `prompt` and `completion`, each a list of chat messages (a plain string is
read as one user / one assistant message), optionally `tools` (OpenAI function definitions, passed
to the chat template). Tool calls may be OpenAI dicts, verifiers' flat `{id, name, arguments}` or
JSON strings of either.

Loss masks come from tokenizing growing conversation prefixes with the chat template: the tokens a
completion message adds are trained when its role is in `loss_roles` (an assistant message's
generation header, `<|im_start|>assistant\\n` in ChatML, is not: at inference the server writes it).
This needs the template's prefix property (tokens of messages[:k] are a prefix of those of
messages[:k+1]); a template that rewrites history (Qwen3 drops earlier <think> sections) fails with
an error naming the message.

Rows: a step takes samples from a `SampleStream` in (shuffled) order; without packing a row is one
sample, with packing consecutive samples share a row of at most `seq_len` tokens (position ids
restart per sample, which the model turns into a block-diagonal mask). A micro-batch stacks rows.
A sample that does not fit
starts the next row, or stays unconsumed for the next step, so the stream position after a step is
exactly the first unseen sample.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from loguru import logger

from asyncrl.utils.errors import UserError
from asyncrl.utils.messages import openai_messages, openai_tools

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass
class SFTSample:
    input_ids: list[int]
    loss_mask: list[bool]

    def __len__(self) -> int:
        return len(self.input_ids)


# ---- loading -------------------------------------------------------------------------------------


def _data_files(path: Path) -> tuple[str, list[str]]:
    """The `datasets` builder and files of a local file or a directory of jsonl/json/parquet files."""
    if path.is_file():
        files = [path]
    else:
        files = sorted(p for p in path.rglob("*") if p.suffix in FILE_BUILDERS and p.is_file())
        if not files:
            raise UserError(f"data.name = {path} is a directory without .jsonl/.json/.parquet files")
    builders = {FILE_BUILDERS.get(p.suffix) for p in files}
    if None in builders:
        raise UserError(f"data.name = {path}: unsupported file type '{path.suffix}' (use .jsonl, .json or .parquet)")
    if len(builders) > 1:
        raise UserError(f"data.name = {path} mixes json and parquet files; keep one format per directory")
    return builders.pop(), [str(p) for p in files]


def load_sft_dataset(name: str, split: str = "train"):
    """A HF `datasets.Dataset` from a local file/dir (jsonl, json, parquet, save_to_disk) or a hub name."""
    import datasets

    datasets.disable_progress_bars()
    path = Path(name).expanduser()
    try:
        if path.exists():
            if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
                ds = datasets.load_from_disk(str(path))
                ds = ds[split] if isinstance(ds, datasets.DatasetDict) else ds
            else:
                builder, files = _data_files(path)
                ds = datasets.load_dataset(builder, data_files=files, split="train")
        elif path.suffix in FILE_BUILDERS or name.startswith((".", "/", "~")):
            raise UserError(f"data.name = {name}: no such file or directory")
        else:
            ds = datasets.load_dataset(name, split=split)
    except UserError:
        raise
    except Exception as e:  # datasets raises many types (FileNotFound, DatasetNotFound, ConnectionError, ...)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"cannot load dataset '{name}' (split '{split}'): {first}") from e
    missing = {"prompt", "completion"} - set(ds.column_names)
    if missing:
        raise UserError(
            f"dataset '{name}' needs 'prompt' and 'completion' columns (lists of chat messages); "
            f"it has {ds.column_names}"
        )
    if len(ds) == 0:
        raise UserError(f"dataset '{name}' (split '{split}') is empty")
    return ds


# ---- tokenisation --------------------------------------------------------------------------------


def _describe(tokenizer, ids: list[int], at: int) -> str:
    return repr(tokenizer.decode(ids[max(0, at - 8) : at + 8]))


class ConversationTokenizer:
    """Tokenizes prompt/completion rows into `SFTSample`s with the chat template (prefix-checked)."""

    def __init__(self, tokenizer, loss_roles: list[str], seq_len: int | None = None):
        if getattr(tokenizer, "chat_template", None) is None:
            raise UserError(
                f"tokenizer '{tokenizer.name_or_path}' has no chat template; SFT renders prompt/completion "
                "messages with it (use a chat model's tokenizer via --tokenizer.name)"
            )
        self.tokenizer = tokenizer
        self.loss_roles = set(loss_roles)
        self.seq_len = seq_len
        self.truncated = 0

    def _ids(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool = False) -> list[int]:
        if not messages:
            return []
        ids = self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=True, add_generation_prompt=generation_prompt, return_dict=False
        )
        return list(ids)

    def tokenize(
        self, prompt: list[dict], completion: list[dict], tools: list[dict] | None = None, where: str = ""
    ) -> SFTSample:
        """Input ids + loss mask of one conversation; raises UserError when the prefix property fails."""
        messages = prompt + completion
        ids = self._ids(prompt, tools)
        mask = [False] * len(ids)
        for k in range(len(prompt), len(messages)):
            full = self._ids(messages[: k + 1], tools)
            if full[: len(ids)] != ids:
                at = next((i for i, (a, b) in enumerate(zip(ids, full)) if a != b), min(len(ids), len(full)))
                raise UserError(
                    f"chat template of '{self.tokenizer.name_or_path}' breaks the prefix property{where}: adding "
                    f"message {k} (role '{messages[k]['role']}') changes the tokens of messages 0..{k - 1} at "
                    f"position {at} ({_describe(self.tokenizer, ids, at)} became "
                    f"{_describe(self.tokenizer, full, at)}). SFT loss masking needs every conversation prefix "
                    "to tokenize to a prefix of the whole (Qwen3's template, which strips earlier <think> "
                    "sections, does not); use a template without history rewriting via --tokenizer.name"
                )
            trained = messages[k]["role"] in self.loss_roles
            header = len(ids)
            if trained and messages[k]["role"] == "assistant":
                gen = self._ids(messages[:k], tools, generation_prompt=True)
                if full[: len(gen)] == gen:
                    header = len(gen)
            mask += [False] * (header - len(ids)) + [trained] * (len(full) - header)
            ids = full
        if self.seq_len is not None and len(ids) > self.seq_len:
            self.truncated += 1
            ids, mask = ids[: self.seq_len], mask[: self.seq_len]
        return SFTSample(ids, mask)

    def tokenize_row(self, row: dict, index: int) -> SFTSample:
        where = f" (dataset row {index})"
        try:
            prompt = openai_messages(row["prompt"], "user")
            completion = openai_messages(row["completion"], "assistant")
            tools = openai_tools(row.get("tools"))
        except (ValueError, json.JSONDecodeError) as e:
            raise UserError(f"malformed dataset row {index}: {e}") from e
        try:
            return self.tokenize(prompt, completion, tools, where)
        except UserError:
            raise
        except Exception as e:  # jinja errors from the template (e.g. it rejects a role order)
            raise UserError(f"chat template failed on dataset row {index}: {type(e).__name__}: {e}") from e


def fake_sample(index: int, seq_len: int, vocab_size: int, seed: int) -> SFTSample:
    """Variable-length random sample (length in [seq_len/8, seq_len]); the second half is trained."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    length = int(torch.randint(max(2, seq_len // 8), seq_len + 1, (1,), generator=g))
    ids = torch.randint(0, vocab_size, (length,), generator=g).tolist()
    return SFTSample(ids, [i >= length // 2 for i in range(length)])


# ---- ordered stream with an exact position -------------------------------------------------------


class SampleStream:
    """Samples in per-epoch shuffled order; (epoch, index) is the next unseen sample.

    `get(i)` returns the sample at dataset index i, or None to skip it (nothing to train on).
    `max_epochs` None repeats the data forever.
    """

    def __init__(
        self, size: int, get: Callable[[int], SFTSample | None], shuffle: bool, seed: int, max_epochs: int | None
    ):
        self.size, self.get, self.shuffle, self.seed, self.max_epochs = size, get, shuffle, seed, max_epochs
        self.epoch, self.index = 0, 0
        self.skipped = 0
        self._order: list[int] | None = None
        self._order_epoch = -1
        self._peeked: tuple[int, int, SFTSample] | None = None

    def _dataset_index(self) -> int:
        if not self.shuffle:
            return self.index
        if self._order_epoch != self.epoch:
            self._order = list(range(self.size))
            random.Random(f"sft:{self.seed}:{self.epoch}").shuffle(self._order)
            self._order_epoch = self.epoch
        return self._order[self.index]

    def _roll(self) -> None:
        if self.index >= self.size:
            self.epoch, self.index = self.epoch + 1, 0

    def peek(self) -> SFTSample | None:
        """The next sample without consuming it; None when the data is exhausted."""
        skipped_in_a_row = 0
        while True:
            self._roll()
            if self.max_epochs is not None and self.epoch >= self.max_epochs:
                return None
            if self._peeked is not None and self._peeked[:2] == (self.epoch, self.index):
                return self._peeked[2]
            sample = self.get(self._dataset_index())
            if sample is not None:
                self._peeked = (self.epoch, self.index, sample)
                return sample
            self.skipped += 1
            skipped_in_a_row += 1
            if skipped_in_a_row > self.size:
                raise UserError("no sample of the dataset has a token to train on (check data.loss_roles)")
            self.index += 1

    def advance(self) -> None:
        self.index += 1
        self._roll()

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "size": self.size}

    def load_state(self, state: dict) -> None:
        if state.get("size") != self.size:
            logger.warning(
                f"the dataset had {state.get('size')} rows when checkpointed and has {self.size} now; "
                f"continuing at epoch {state['epoch']}, index {min(state['index'], self.size)}"
            )
        self.epoch, self.index = int(state["epoch"]), min(int(state["index"]), self.size)
        self._peeked = None


def take_rows(stream: SampleStream, num_rows: int, seq_len: int, pack: bool) -> list[list[SFTSample]]:
    """Up to `num_rows` rows for one step (fewer only when the data ends), consuming exactly what they hold."""
    rows: list[list[SFTSample]] = []
    current: list[SFTSample] = []
    used = 0
    while True:
        sample = stream.peek()
        if sample is None:
            break
        if current and (not pack or used + len(sample) > seq_len):
            rows.append(current)
            current, used = [], 0
            if len(rows) == num_rows:
                break
        current.append(sample)
        used += len(sample)
        stream.advance()
    if current:
        rows.append(current)
    return rows


# ---- micro-batches -------------------------------------------------------------------------------


@dataclass
class MicroBatch:
    """One forward pass: rows stacked into [rows, longest row], each row holding packed samples.

    Position ids restart at every sample, which HF attention turns into a block-diagonal mask (so a
    row costs O(seq_len^2) attention, not the square of the whole micro-batch). Rows are right-padded
    with a pad pseudo-sample that has its own positions and no loss.
    """

    input_ids: torch.Tensor  # [rows, length]
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    sample_lengths: torch.Tensor  # CPU, real samples only, for FLOP counting
    num_samples: int

    def to(self, device: torch.device) -> MicroBatch:
        return MicroBatch(
            self.input_ids.to(device),
            self.position_ids.to(device),
            self.loss_mask.to(device),
            self.sample_lengths,
            self.num_samples,
        )


def make_micro_batch(rows: list[list[SFTSample]], pad_id: int) -> MicroBatch:
    """Stack rows (empty rows are dropped); no real row at all gives a 1-token dummy with no loss,
    which keeps every rank running the same number of forward/backward passes."""
    rows = [row for row in rows if row]
    if not rows:
        one = torch.zeros(1, 1, dtype=torch.long)
        return MicroBatch(one + pad_id, one.clone(), one.bool(), torch.zeros(0, dtype=torch.long), 0)
    length = max(sum(len(s) for s in row) for row in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    pos = torch.zeros((len(rows), length), dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.bool)
    for r, row in enumerate(rows):
        at = 0
        for s in row:
            ids[r, at : at + len(s)] = torch.tensor(s.input_ids)
            pos[r, at : at + len(s)] = torch.arange(len(s))
            mask[r, at : at + len(s)] = torch.tensor(s.loss_mask)
            at += len(s)
        pos[r, at:] = torch.arange(length - at)
    mask &= pos != 0  # a sample's first token has no prefix in its own sample: never a target
    lengths = torch.tensor([len(s) for row in rows for s in row])
    return MicroBatch(ids, pos, mask, lengths, len(lengths))


def split_for_rank(
    rows: list[list[SFTSample]], batch_size: int, micro_batch_size: int, rank: int, world_size: int
) -> list[list[list[SFTSample]]]:
    """This rank's micro-batches (lists of rows): rows round-robin over ranks, every rank gets the same count."""
    mine = rows[rank::world_size]
    per_rank = batch_size // world_size
    mine += [[] for _ in range(per_rank - len(mine))]
    return [mine[i : i + micro_batch_size] for i in range(0, per_rank, micro_batch_size)]
