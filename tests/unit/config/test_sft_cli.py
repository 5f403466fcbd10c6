"""`sft` user mistakes end in one `error:` line and exit 2, before any model is trained."""

import json

import pytest

from asyncrl.core.errors import UserError
from asyncrl.entrypoints.sft import main
from asyncrl.trainer.sft.loop import check_batch_shape


def run_main(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "Traceback" not in "\n".join(err)
    return err[-1]


def test_missing_dataset_file(tiny_model_dir, tmp_path, capsys):
    msg = run_main(
        [
            "--model.name",
            str(tiny_model_dir),
            "--data.name",
            str(tmp_path / "nope.jsonl"),
            "--output-dir",
            str(tmp_path),
            "--log.level",
            "error",
        ],
        capsys,
    )
    assert "nope.jsonl: no such file" in msg


def test_prefix_property_failure_before_training(tiny_model_dir, tmp_path, capsys):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = (  # drops the reasoning of every assistant turn but the last, like Qwen3
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content and loop.last %}"
        "<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    tok.save_pretrained(tmp_path / "tok")
    row = {
        "prompt": [{"role": "user", "content": "q"}],
        "completion": [
            {"role": "assistant", "content": "a", "reasoning_content": "r"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "b"},
        ],
    }
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(row) + "\n")
    msg = run_main(
        [
            "--model.name",
            str(tiny_model_dir),
            "--tokenizer.name",
            str(tmp_path / "tok"),
            "--data.name",
            str(data),
            "--output-dir",
            str(tmp_path),
            "--log.level",
            "error",
        ],
        capsys,
    )
    assert "prefix property (dataset row 0)" in msg and "message 2 (role 'user')" in msg
    assert not (tmp_path / "weights").exists()


def test_batch_must_split_over_ranks():
    check_batch_shape(8, 2, 2)
    with pytest.raises(UserError, match="multiple of 4"):
        check_batch_shape(6, 2, 2)  # 3 rows per rank are not whole micro-batches of 2
    with pytest.raises(UserError, match="multiple of 6"):
        check_batch_shape(4, 2, 3)  # 4 rows do not split over 3 ranks
