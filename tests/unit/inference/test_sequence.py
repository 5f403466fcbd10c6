"""Per-sequence bookkeeping: incremental detokenization, stop strings/ids, eos, min/max tokens."""

import pytest

from asyncrl.inference.api.backend import SamplingParams
from asyncrl.inference.engine.sequence import Sequence

EOS = 258  # <|im_end|>


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def run(tok, text_or_ids, max_len=1000, **kw):
    params = SamplingParams(max_tokens=kw.pop("max_tokens", 100), **kw)
    seq = Sequence(0, tok.encode("prompt"), params, tok, {EOS})
    ids = tok.encode(text_or_ids) if isinstance(text_or_ids, str) else text_or_ids
    deltas = []
    for t in ids:
        done = seq.append(t, -1.0, None, max_len)
        d = seq.take_delta()
        if d is not None:
            deltas.append(d)
        if done:
            break
    return seq, deltas


def test_text_and_multibyte_characters(tok):
    seq, deltas = run(tok, "héllo wörld ✓")
    assert seq.text == "héllo wörld ✓" and seq.finish_reason is None
    assert "".join(d.text for d in deltas) == seq.text
    assert all("\ufffd" not in d.text for d in deltas)  # no half characters streamed
    assert sum(len(d.token_ids) for d in deltas) == len(tok.encode("héllo wörld ✓"))


def test_eos_finishes_and_is_kept_in_ids_not_text(tok):
    ids = tok.encode("hi") + [EOS] + tok.encode("more")
    seq, deltas = run(tok, ids)
    assert seq.finish_reason == "stop" and seq.stop_reason is None
    assert seq.output_ids == tok.encode("hi") + [EOS] and seq.text == "hi"
    assert deltas[-1].finish_reason == "stop"
    seq, _ = run(tok, ids, ignore_eos=True)
    assert seq.finish_reason is None and len(seq.output_ids) == len(ids)


def test_min_tokens_bans_eos_until_reached(tok):
    seq = Sequence(0, [1], SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=[7]), tok, {EOS})
    assert seq.banned_ids() == [7, EOS]
    seq.append(65, 0.0, None, 100)
    seq.append(66, 0.0, None, 100)
    assert seq.banned_ids() == []


def test_stop_strings_across_tokens(tok):
    seq, deltas = run(tok, "abc STOP def", stop=["STOP", "zz"])
    assert seq.finish_reason == "stop" and seq.stop_reason == "STOP"
    assert seq.text == "abc " and "".join(d.text for d in deltas) == "abc "
    assert tok.decode(seq.output_ids) == "abc STOP"  # ids run up to the token completing the stop
    seq, _ = run(tok, "abc STOP def", stop=["STOP"], include_stop_str_in_output=True)
    assert seq.text == "abc STOP"


def test_streamed_text_holds_back_a_possible_stop(tok):
    _, deltas = run(tok, "xxST", stop=["STOP"])
    streamed = "".join(d.text for d in deltas)
    assert streamed == "x"  # "xST" could still become "STOP": held back
    seq, deltas = run(tok, "xxSTAB", stop=["STOP"], max_tokens=6)
    assert seq.finish_reason == "length" and "".join(d.text for d in deltas) == "xxSTAB"


def test_stop_token_ids_and_limits(tok):
    seq, _ = run(tok, "abcdef", stop_token_ids=[ord("c")])
    assert seq.output_ids == tok.encode("abc") and seq.stop_reason == ord("c") and seq.text == "abc"
    seq, _ = run(tok, "abcdef", max_tokens=4)
    assert seq.finish_reason == "length" and seq.text == "abcd"
    seq, _ = run(tok, "abcdef", max_len=len(tok.encode("prompt")) + 3)
    assert seq.finish_reason == "length" and len(seq.output_ids) == 3


def test_logprobs_travel_with_tokens(tok):
    params = SamplingParams(max_tokens=3, logprobs=1)
    seq = Sequence(2, [1], params, tok, {EOS})
    seq.append(65, -0.5, [(65, -0.5)], 100)
    seq.append(66, -1.5, [(66, -1.5)], 100)
    d = seq.take_delta()
    assert d.index == 2 and d.token_ids == [65, 66] and d.logprobs == [-0.5, -1.5]
    assert d.top_logprobs == [[(65, -0.5)], [(66, -1.5)]]
    assert seq.take_delta() is None
