"""SFT data pipeline: loss masks from the chat template, the prefix check, loading, stream order, packing."""

import json

import pytest

from asyncrl.core.errors import UserError
from asyncrl.trainer.sft.data import ConversationTokenizer, SFTSample, fake_sample, load_sft_dataset
from asyncrl.trainer.sft.packing import SampleStream, make_micro_batch, split_for_rank, take_rows
from asyncrl.utils.messages import openai_messages, openai_tools

# Like Qwen3's template in the way that matters: earlier assistant turns lose their reasoning.
HISTORY_REWRITING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and m.reasoning_content and loop.last %}"
    "<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def trained_text(tokenizer, sample: SFTSample) -> str:
    return tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])


def test_single_turn_trains_only_the_answer(tokenizer):
    conv = ConversationTokenizer(tokenizer, ["assistant"])
    s = conv.tokenize([{"role": "user", "content": "Reverse the text: abc"}], [{"role": "assistant", "content": "cba"}])
    full = tokenizer.decode(s.input_ids)
    assert full == "<|im_start|>user\nReverse the text: abc<|im_end|>\n<|im_start|>assistant\ncba<|im_end|>\n"
    assert trained_text(tokenizer, s) == "cba<|im_end|>\n"  # no prompt, no generation header
    assert len(s.input_ids) == len(s.loss_mask)


def test_multi_turn_with_tools_masks_user_and_tool_messages(tokenizer):
    conv = ConversationTokenizer(tokenizer, ["assistant"])
    call = json.dumps({"id": "c1", "name": "calculate", "arguments": json.dumps({"expression": "1+2"})})
    completion = openai_messages(
        [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "3", "tool_call_id": "c1"},
            {"role": "assistant", "content": "The answer is 3"},
        ],
        "assistant",
    )
    tools = openai_tools([{"name": "calculate", "description": "math", "parameters": {"type": "object"}}])
    s = conv.tokenize([{"role": "user", "content": "1+2?"}], completion, tools)
    text, trained = tokenizer.decode(s.input_ids), trained_text(tokenizer, s)
    assert '"name": "calculate"' in text and "<tools>" in text  # tool defs and calls rendered
    assert "<tool_call>" in trained and "The answer is 3<|im_end|>" in trained
    assert "<tool_response>" not in trained and "1+2?" not in trained and "<tools>" not in trained


def test_loss_roles_are_configurable(tokenizer):
    prompt = [{"role": "user", "content": "hi"}]
    completion = [
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "b"},
    ]
    both = ConversationTokenizer(tokenizer, ["assistant", "user"]).tokenize(prompt, completion)
    only = ConversationTokenizer(tokenizer, ["assistant"]).tokenize(prompt, completion)
    assert "again" in trained_text(tokenizer, both) and "again" not in trained_text(tokenizer, only)
    assert "hi" not in trained_text(tokenizer, both)  # prompt messages are never trained


def test_prefix_property_violation_names_the_message(tokenizer):
    import copy

    bad = copy.copy(tokenizer)
    bad.chat_template = HISTORY_REWRITING_TEMPLATE
    conv = ConversationTokenizer(bad, ["assistant"])
    prompt = [{"role": "user", "content": "q1"}]
    completion = [
        {"role": "assistant", "content": "a1", "reasoning_content": "think"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"},
    ]
    with pytest.raises(UserError, match=r"prefix property \(dataset row 7\).*message 2 \(role 'user'\)") as e:
        conv.tokenize_row({"prompt": prompt, "completion": completion}, 7)
    assert "Qwen3" in str(e.value) and "--tokenizer.name" in str(e.value)
    # without reasoning nothing is rewritten, so the same template is fine
    plain = [dict(m, reasoning_content=None) for m in completion]
    conv.tokenize_row({"prompt": prompt, "completion": plain}, 0)


def test_openai_messages_strings_none_fields_and_flat_tool_calls():
    assert openai_messages("hello", "user") == [{"role": "user", "content": "hello"}]
    msgs = openai_messages(
        [
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": None,
                "tool_calls": [{"id": "x", "name": "f", "arguments": "{}", "type": None}],
            }
        ],
        "assistant",
    )
    assert msgs == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}, "id": "x"}],
        }
    ]
    with pytest.raises(ValueError, match="role"):
        openai_messages([{"content": "no role"}], "user")
    assert openai_tools(None) is None
    wrapped = {"type": "function", "function": {"name": "f", "parameters": {}}}
    assert openai_tools([wrapped]) == [wrapped]


def test_malformed_row_and_missing_template_errors(tokenizer):
    conv = ConversationTokenizer(tokenizer, ["assistant"])
    with pytest.raises(UserError, match="malformed dataset row 3"):
        conv.tokenize_row({"prompt": 5, "completion": "x"}, 3)
    import copy

    none = copy.copy(tokenizer)
    none.chat_template = None
    with pytest.raises(UserError, match="no chat template"):
        ConversationTokenizer(none, ["assistant"])


def test_truncation_to_seq_len(tokenizer):
    conv = ConversationTokenizer(tokenizer, ["assistant"], seq_len=10)
    s = conv.tokenize([{"role": "user", "content": "a long prompt here"}], [{"role": "assistant", "content": "x"}])
    assert len(s) == 10 and conv.truncated == 1


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [
    {"prompt": [{"role": "user", "content": f"q{i}"}], "completion": [{"role": "assistant", "content": f"a{i}"}]}
    for i in range(5)
]


def test_load_jsonl_parquet_dir_and_errors(tmp_path):
    ds = load_sft_dataset(str(_write_jsonl(tmp_path / "d.jsonl", ROWS)))
    assert len(ds) == 5 and ds[2]["completion"][0]["content"] == "a2"
    pq = tmp_path / "pq"
    pq.mkdir()
    ds.to_parquet(str(pq / "part-0.parquet"))
    assert len(load_sft_dataset(str(pq))) == 5
    with pytest.raises(UserError, match="no such file"):
        load_sft_dataset(str(tmp_path / "missing.jsonl"))
    with pytest.raises(UserError, match="needs 'prompt' and 'completion'"):
        load_sft_dataset(str(_write_jsonl(tmp_path / "bad.jsonl", [{"messages": []}])))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="without .jsonl"):
        load_sft_dataset(str(tmp_path / "empty"))


def _stream(n=10, lengths=None, shuffle=True, seed=0, max_epochs=None):
    lengths = lengths or [3] * n
    return SampleStream(n, lambda i: SFTSample([i] * lengths[i], [True] * lengths[i]), shuffle, seed, max_epochs)


def _ids(rows):
    return [s.input_ids[0] for row in rows for s in row]


def test_stream_shuffles_each_epoch_and_covers_all():
    s = _stream(max_epochs=2)
    first = _ids(take_rows(s, 10, 100, pack=False))
    second = _ids(take_rows(s, 10, 100, pack=False))
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second and first != list(range(10))
    assert take_rows(s, 10, 100, pack=False) == [] and s.peek() is None
    assert _ids(take_rows(_stream(max_epochs=1), 10, 100, pack=False)) == first  # seeded


def test_packing_respects_seq_len_and_resumes_exactly():
    lengths = [4, 7, 2, 9, 3, 5, 6, 1, 8, 2]
    s = _stream(lengths=lengths)
    rows = take_rows(s, 2, 10, pack=True)
    assert len(rows) == 2 and all(sum(len(x) for x in row) <= 10 for row in rows)
    state = s.state()
    expected = _ids(take_rows(s, 3, 10, pack=True))
    resumed = _stream(lengths=lengths)
    resumed.load_state(state)
    assert _ids(take_rows(resumed, 3, 10, pack=True)) == expected  # the next unseen sample, not a skipped one
    # every sample is used once per epoch, in order, none lost at row/step boundaries
    whole = _stream(lengths=lengths, max_epochs=1)
    got = []
    while batch := take_rows(whole, 2, 10, pack=True):
        got += _ids(batch)
    assert sorted(got) == list(range(10))


def test_stream_skips_samples_without_loss_and_fails_if_all_empty():
    s = SampleStream(4, lambda i: None if i % 2 else SFTSample([i], [True]), False, 0, 1)
    assert _ids(take_rows(s, 10, 5, pack=False)) == [0, 2] and s.skipped == 2
    with pytest.raises(UserError, match="no sample"):
        SampleStream(3, lambda i: None, False, 0, None).peek()


def test_split_for_rank_and_micro_batches():
    rows = [[SFTSample([1, 2, 3], [False, True, True])], [SFTSample([4, 5], [True, True]), SFTSample([6], [False])]]
    r0 = split_for_rank(rows, batch_size=4, micro_batch_size=1, rank=0, world_size=2)
    r1 = split_for_rank(rows, batch_size=4, micro_batch_size=1, rank=1, world_size=2)
    assert len(r0) == len(r1) == 2  # the missing rows become empty dummies on both ranks
    mb = make_micro_batch(r1[0], pad_id=0)
    assert mb.input_ids.tolist() == [[4, 5, 6]] and mb.position_ids.tolist() == [[0, 1, 0]]
    assert mb.loss_mask.tolist() == [[False, True, False]]  # a sample's first token is never a target
    assert mb.num_samples == 2 and mb.sample_lengths.tolist() == [2, 1]
    stacked = make_micro_batch([rows[1], rows[0]], pad_id=9)  # padded to the longest row
    assert stacked.input_ids.tolist() == [[4, 5, 6], [1, 2, 3]]
    two = make_micro_batch([[SFTSample([1, 2, 3, 4], [False] * 2 + [True] * 2)], [SFTSample([5, 6], [False, True])]], 9)
    assert two.input_ids.tolist() == [[1, 2, 3, 4], [5, 6, 9, 9]]
    assert two.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 0, 1]]  # padding is its own pseudo-sample
    assert two.loss_mask.tolist() == [[False, False, True, True], [False, True, False, False]]
    dummy = make_micro_batch(r1[1], pad_id=7)
    assert dummy.input_ids.tolist() == [[7]] and not dummy.loss_mask.any() and dummy.num_samples == 0


def test_fake_samples_vary_in_length():
    lengths = {len(fake_sample(i, 64, 100, seed=0)) for i in range(20)}
    assert len(lengths) > 5 and min(lengths) >= 8 and max(lengths) <= 64
    s = fake_sample(3, 64, 100, 0)
    assert s.input_ids == fake_sample(3, 64, 100, 0).input_ids and any(s.loss_mask) and not s.loss_mask[0]
