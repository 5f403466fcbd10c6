"""SFT samples: load prompt/completion chat datasets and tokenize them into ids + loss masks.

Format: every row has `prompt` and `completion`, each a list of chat messages (a plain string is
read as one user / one assistant message), optionally `tools` (OpenAI function definitions, passed
to the chat template). Tool calls may be OpenAI dicts, verifiers' flat `{id, name, arguments}` or
JSON strings of either (`utils.messages` turns them into OpenAI form).

Loss masks come from tokenizing growing conversation prefixes with the chat template: the tokens a
completion message adds are trained when its role is in `loss_roles` (an assistant message's
generation header, `<|im_start|>assistant\\n` in ChatML, is not: at inference the server writes it).
This needs the template's prefix property (tokens of messages[:k] are a prefix of those of
messages[:k+1]); a template that rewrites history (Qwen3 drops earlier <think> sections) fails with
an error naming the message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from asyncrl.core.errors import UserError
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
